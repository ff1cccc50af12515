"""Shared test setup. Nothing in the test suite may reach the network."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # after the offline switches

# In-process models run on one thread: on a 2-core machine shared with stage subprocesses, a
# second torch thread mostly waits for a busy core (10x slower steps were measured).
torch.set_num_threads(1)

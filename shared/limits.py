"""Constants of the wire contract that the gateway and every stage share.

Everything a stage knows about its model (sizes, steps, voices, sample rates) is published by
that stage's Describe RPC instead; only rules of the protocol itself live here.
"""

from __future__ import annotations

import re

#: Longest request id accepted anywhere (gateway routes, gRPC API, stage streams).
MAX_REQUEST_ID_CHARS = 128

#: The characters a request id may hold, everywhere: ASCII letters, digits and . _ : - (an id
#: travels in gRPC metadata, HTTP headers and log lines). Match it only after the length check.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:\-]+")

#: Seeds are proto int64 fields: [0, MAX_SEED].
MAX_SEED = 2**63 - 1

#: The voice name that means "the recipe's default voice".
DEFAULT_VOICE = "default"

#: The voice name that means "the voice of the reference clip" (voice cloning).
CLONE_VOICE = "clone"

#: Largest gRPC message a stage accepts or sends (latents and audio chunks stay far below).
MAX_STAGE_MESSAGE_BYTES = 64 * 1024 * 1024

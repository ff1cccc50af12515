"""Constants of the wire contract that the gateway and every stage share.

Everything a stage knows about its model (sizes, steps, voices, sample rates) is published by
that stage's Describe RPC instead; only rules of the protocol itself live here.
"""

from __future__ import annotations

import re

#: Longest request id a client may choose (gateway routes, gRPC API).
MAX_REQUEST_ID_CHARS = 128

#: Length of an owner id: an API key's, "key-" + 16 hex digits (gateway/auth.py `owner_id`).
#: Every owner id has this one length, so that an owner-qualified id cannot be confused.
OWNER_ID_CHARS = 20

#: Longest request id a stage accepts (stage streams, cancel by id at a stage). With API keys
#: on, the stages know a request by its owner-qualified id, `<client id>:<owner>`
#: (gateway/cancel.py `stage_request_id`): the client's id, whose parts' suffixes (`.<i>`) the
#: gateway already fits within MAX_REQUEST_ID_CHARS, plus ":" and the owner id.
MAX_STAGE_REQUEST_ID_CHARS = MAX_REQUEST_ID_CHARS + 1 + OWNER_ID_CHARS

#: The characters a request id may hold, everywhere: ASCII letters, digits and . _ : - (an id
#: travels in gRPC metadata, HTTP headers and log lines). Match it only after the length check.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:\-]+")

#: Seeds are proto int64 fields: [0, MAX_SEED].
MAX_SEED = 2**63 - 1

#: Largest flow shift a request may set (DenoiseStart.flow_shift; Wan uses 3 to 12): the DiT
#: refuses more, and the gateway checks it before calling any stage.
MAX_FLOW_SHIFT = 100.0

#: The voice name that means "the recipe's default voice".
DEFAULT_VOICE = "default"

#: The voice name that means "the voice of the reference clip" (voice cloning).
CLONE_VOICE = "clone"

#: Largest gRPC message a stage accepts or sends (latents and audio chunks stay far below).
MAX_STAGE_MESSAGE_BYTES = 64 * 1024 * 1024

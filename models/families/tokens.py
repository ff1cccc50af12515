"""Vocabulary lookups every model family needs."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of one token of the vocabulary; a token the tokenizer lacks is an error (not the
    unknown-token id, which `convert_tokens_to_ids` would silently give)."""
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int) or found == tokenizer.unk_token_id:
        raise ValueError(f"token {token!r} is not in the tokenizer's vocabulary")
    return found

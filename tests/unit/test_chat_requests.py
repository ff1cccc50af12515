"""Chat without a model: the sentence splitter that feeds speech, and the OpenAI chat body."""

from __future__ import annotations

import pytest

from stagemesh.gateway.chat.pipeline import (
    FIRST_PIECE_MAX_WORDS,
    AudioOutput,
    ChatTurn,
    SentenceSplitter,
)
from stagemesh.gateway.chat.routes import chat_request
from stagemesh.gateway.errors import InvalidRequest


def split(text: str, piece: int = 1, max_chars: int = 300) -> list[str]:
    """Feed `text` in pieces of `piece` characters, as tokens arrive; then flush."""
    splitter = SentenceSplitter(max_chars)
    sentences: list[str] = []
    for start in range(0, len(text), piece):
        sentences += splitter.push(text[start:start + piece])
    return sentences + splitter.flush()


def test_sentences_leave_as_soon_as_they_end() -> None:
    splitter = SentenceSplitter()
    assert splitter.push("The sea is vast") == []
    assert splitter.push(".") == []  # "vast.5"? The end is known once a space follows the mark
    assert splitter.push(" It is") == ["The sea is vast."]
    assert splitter.flush() == ["It is"]


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_numbers_lists_and_quotes_do_not_cut_a_sentence(piece: int) -> None:
    text = ('1. The sea covers 70.8% of Earth! 2. Waves come from wind... "Really?" she said.'
            "\nThe end")
    assert split(text, piece) == ["1. The sea covers 70.8% of Earth!",
                                  "2. Waves come from wind...", '"Really?"', "she said.",
                                  "The end"]


def test_a_sentence_without_an_end_is_cut_at_a_space_when_too_long() -> None:
    sentences = split("word " * 30, piece=7, max_chars=40)
    assert all(len(s) <= 40 for s in sentences)
    assert " ".join(sentences).split() == ["word"] * 30


def test_nothing_speakable_is_not_a_sentence() -> None:
    assert split("... !") == []
    assert split("") == []


def test_the_openai_body_of_a_spoken_streamed_answer() -> None:
    request, options = chat_request({
        "model": "smollm2", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "developer", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                  {"type": "text", "text": "there"}]}],
        "max_completion_tokens": 20, "temperature": 0.5, "seed": 3,
        "modalities": ["text", "audio"], "audio": {"voice": "default", "format": "pcm16"}})
    assert request.messages == (ChatTurn("system", "Be brief."), ChatTurn("user", "Hi there"))
    assert request.max_tokens == 20 and request.temperature == 0.5 and request.seed == 3
    assert request.audio == AudioOutput(voice="default", format="pcm16")
    assert options.stream and options.include_usage


@pytest.mark.parametrize(("body", "field"), [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["."]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]},
     "audio"),
    ({"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "default"}}, "audio"),
    ({"messages": [{"role": "user", "content": "x"}], "modalities": ["audio"]}, "modalities"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
])
def test_a_bad_field_is_a_400_naming_it(body: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        chat_request(body)
    assert refused.value.field_name == field


def first_pieces(text: str, piece: int = 2) -> list[str]:
    """An answer's pieces as the chat pipeline speaks them (the first one ends at a clause)."""
    splitter = SentenceSplitter(first_clause=True)
    pieces: list[str] = []
    for start in range(0, len(text), piece):
        pieces += splitter.push(text[start:start + piece])
    return pieces + splitter.flush()


def test_the_first_piece_of_an_answer_ends_at_its_first_clause_the_others_are_sentences() -> None:
    assert first_pieces("Once upon a time, a ship sailed the sea, far away. It was old, and "
                        "slow.") == ["Once upon a time,", "a ship sailed the sea, far away.",
                                     "It was old, and slow."]
    # Too few words for a clause: the sentence goes on; a number's comma is no clause mark.
    assert first_pieces("Yes, the capital of France is Paris. It is big.") == [
        "Yes, the capital of France", "is Paris.", "It is big."]
    assert first_pieces("About 1,000 people live there now.") == [
        "About 1,000 people live there now."]
    # A long first sentence without a mark is cut after FIRST_PIECE_MAX_WORDS words, or just
    # before the words there that lead into the rest.
    long = "The old ship sailed slowly across the wide and quiet sea at night."
    pieces = first_pieces(long)
    assert len(pieces[0].split()) == FIRST_PIECE_MAX_WORDS and " ".join(pieces) == long
    assert len(pieces) == 2
    assert first_pieces("The answer to this classic question lies in the spider's anatomy. "
                        "It has eight legs.") == [
        "The answer to this classic question lies", "in the spider's anatomy.",
        "It has eight legs."]


def test_a_first_piece_ends_before_its_verb_or_as_soon_as_its_sentence_mark_is_written() -> None:
    splitter = SentenceSplitter(first_clause=True)
    assert splitter.push("The capital of France") == []
    assert splitter.push(" is") == ["The capital of France"]  # the subject is said at once
    assert splitter.push(" Paris.") == []  # later pieces wait for what follows their mark
    assert splitter.push(" It") == ["is Paris."]
    # A short first sentence leaves with its mark, not one token later.
    assert SentenceSplitter(first_clause=True).push("A spider has 8 legs.") == [
        "A spider has 8 legs."]
    # A mark that what follows could continue waits: a number's point, a one-letter
    # abbreviation.
    for text in ("It costs 3.", "For example e."):
        assert SentenceSplitter(first_clause=True).push(text) == [], text
    # No break after fewer than FIRST_CLAUSE_WORDS words, nor after a word that leads into
    # the verb; a word that only begins like one ("island") is no verb.
    assert first_pieces("A spider has eight legs.") == ["A spider has eight legs."]
    assert first_pieces("The one that is red is mine.") == ["The one that is red", "is mine."]
    assert SentenceSplitter(first_clause=True).push("Old ships sailed islands far away") == []

"""Chat: Thinker -> (piece by piece) Talker -> Codec, streaming text and speech together.

The thinker writes the answer token by token; each `delta` is emitted at once as text. With
audio output, a SentenceSplitter cuts the text into pieces as it arrives, and each finished
piece is spoken through the speech recipe's own pipeline (`speech.pipeline.speak`) while the
thinker keeps writing: the first piece's audio leaves long before the answer ends. Pieces are
sentences; with `first_clause` (the realtime route's turns) the first piece is the answer's
first clause (a few words up to a comma or a verb, its first sentence if shorter, or a capped
number of words), so the voice starts after a handful of tokens, and the later ones stay whole
sentences, for their prosody, written while the first one plays. Pieces are spoken one after
another, in order, so the audio is one continuous stream; each is announced (`SpokenText`) as
it goes to the talker.

Every stage call (the thinker's and each piece's talker and codec) runs under the request's
one CancelScope: a cancel by id, a passed deadline or a client that goes away stops all of them
at their next step, and the first failure of either side cancels the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stagemesh.gateway.chat.protocol import AUDIO_FORMATS, ROLES, AudioOutput, ChatRequest, ChatTurn
from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.mesh.calls import CancelScope, call_stage, side_by_side
from stagemesh.gateway.mesh.events import Done, Emit, Output, StageEvent, stream_pipeline
from stagemesh.gateway.recipes import Recipe, Task
from stagemesh.gateway.speech.audio import AudioFormat, Samples, StreamEncoder
from stagemesh.gateway.speech.pipeline import AudioPiece, SpeechJob, prepare_speech, speak
from stagemesh.gateway.speech.protocol import SpeechRequest
from stagemesh.gateway.transcriptions.pipeline import TranscriptionJob, listen, prepare_audio
from stagemesh.gateway.transcriptions.protocol import decode_base64_audio
from stagemesh.shared.limits import MAX_SEED
from stagemesh.shared.proto.v1 import gateway_service_pb2 as gateway_pb
from stagemesh.shared.proto.v1 import thinker_service_pb2 as pb
from stagemesh.shared.proto.v1 import thinker_service_pb2_grpc

if TYPE_CHECKING:  # the async stub class exists only in the generated .pyi file
    from stagemesh.shared.proto.v1.thinker_service_pb2_grpc import ThinkerServiceAsyncStub

#: A sentence longer than this is cut at a space: the talker starts sooner, and stays bounded.
MAX_SENTENCE_CHARS = 300
#: An answer's first piece ends at a clause mark once it has FIRST_CLAUSE_WORDS words, before
#: the verb or conjunction that follows that many (_BREAK_WORDS: "The capital of France | is
#: Paris."), at a space once it has FIRST_PIECE_MAX_WORDS, or at its sentence's end as soon as
#: the mark is written, whichever comes first: the voice starts after a few tokens instead of a
#: whole sentence's (a spoken answer's first sentence is often 7-9 tokens, its subject 4-6).
FIRST_CLAUSE_WORDS = 3
FIRST_PIECE_MAX_WORDS = 8
#: Words a first piece may end before, once FIRST_CLAUSE_WORDS words precede them (after a
#: word that is not itself a leading one): where a spoken sentence's subject meets its verb, or
#: a clause begins, a listener hears a natural break.
_BREAK_WORDS = ("is", "are", "was", "were", "has", "have", "had", "will", "would", "can",
                "could", "should", "must", "may", "might", "but", "because", "which", "who")
#: Words a capped first piece does not end on (its voice would fall mid-phrase): the cut moves
#: before them ("... lies | in the spider's anatomy", not "... lies in | the spider's ...").
_LEADING_WORDS = frozenset({
    "a", "an", "the", "of", "in", "on", "at", "to", "for", "with", "by", "from", "into", "about",
    "as", "and", "or", "but", "nor", "so", "that", "which", "who", "whose", "is", "are", "was",
    "were", "be", "been", "being", "has", "have", "had", "do", "does", "did", "will", "would",
    "can", "could", "should", "my", "your", "his", "her", "its", "our", "their", "this", "these",
    "those"})
#: Text that stands in for the sentences while the speech request is checked before any stage.
_PROBE_TEXT = "Hello."

ChatEvents = AsyncGenerator["StageEvent | Output[ChatPiece] | Done[ChatSummary]", None]


# -- the request ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatJob:
    """A checked chat request: the recipe, the thinker's start fields, and the speech job
    (its params are each sentence's, with the sentence as input) when audio is asked for."""

    recipe: Recipe
    messages: tuple[ChatTurn, ...]
    sampling: pb.TokenSamplingParams
    priority: int
    speech: SpeechJob | None
    #: Each `input_audio` part, checked against the listener: (message index, its audio).
    heard: tuple[tuple[int, TranscriptionJob], ...] = ()
    #: Speak the answer's first clause as soon as it is written (a spoken conversation's
    #: turn-taking); otherwise every piece is a sentence.
    first_clause: bool = False


def chat_recipe(core: GatewayCore, model: str) -> Recipe | None:
    """The chat recipe `model` names; None when it names another task's recipe (chat
    completions then draw images, as before) or is empty while an image recipe is served."""
    named = core.recipes.get(model) if model else None
    if named is not None:
        return named if named.task is Task.CHAT else None
    if model:
        return core.mesh.recipe(model, Task.CHAT)  # unknown: the mesh's 400 names the choices
    serves_images = any(r.task is Task.TEXT_TO_IMAGE for r in core.recipes.values())
    return None if serves_images else core.mesh.recipe("", Task.CHAT)


async def prepare_chat(core: GatewayCore, recipe: Recipe, request: ChatRequest) -> ChatJob:
    """Check every field against what the thinker (and the speech stages) publish."""
    facts = await core.catalog.read(core.catalog.thinker, recipe)
    _check_messages(request.messages, facts)
    sampling = _sampling(request, facts)
    speech = None
    if request.audio is not None:
        speech = await _speech_job(core, recipe, request.audio, request.seed)
    heard = await _audio_jobs(core, recipe, request.messages)
    return ChatJob(recipe, request.messages, sampling, request.priority, speech, heard)


async def _audio_jobs(core: GatewayCore, recipe: Recipe, messages: tuple[ChatTurn, ...]
                      ) -> tuple[tuple[int, TranscriptionJob], ...]:
    """Every `input_audio` part decoded and checked against the recipe's listener (its
    `listen:` recipe, or the first speech-to-text one), before any stage runs."""
    parts = [(index, part) for index, turn in enumerate(messages) for part in turn.audio]
    if not parts:
        return ()
    listener = core.mesh.recipe(recipe.listen, Task.SPEECH_TO_TEXT)
    jobs = []
    for index, part in parts:
        audio = await asyncio.to_thread(decode_base64_audio, part.data, part.field)
        jobs.append((index, await prepare_audio(core, listener, audio, part.field)))
    return tuple(jobs)


async def _heard_messages(core: GatewayCore, job: ChatJob,
                          scope: CancelScope) -> tuple[ChatTurn, ...]:
    """The conversation with each spoken part transcribed and appended to its message's text
    (a cascade: listener -> thinker)."""
    texts = [[turn.content] if turn.content else [] for turn in job.messages]
    for index, heard in job.heard:
        texts[index].append((await listen(heard, scope, core)).text)
    return tuple(dataclasses.replace(turn, content=" ".join(texts[i]), audio=())
                 for i, turn in enumerate(job.messages))


def _check_messages(messages: tuple[ChatTurn, ...],
                    facts: pb.DescribeThinkerResponse) -> None:
    if not messages:
        raise InvalidRequest("messages", "messages must be a non-empty list")
    if len(messages) > facts.max_messages:
        raise InvalidRequest("messages", f"{len(messages)} messages, the limit is "
                             f"{facts.max_messages}")
    chars = sum(len(turn.content) for turn in messages)
    if chars > facts.max_input_chars:
        raise InvalidRequest("messages", f"messages have {chars} characters, the limit is "
                             f"{facts.max_input_chars}")


def _sampling(request: ChatRequest, facts: pb.DescribeThinkerResponse) -> pb.TokenSamplingParams:
    sampling = pb.TokenSamplingParams(max_tokens=request.max_tokens or 0)
    if request.max_tokens is not None and not 1 <= request.max_tokens <= facts.max_tokens:
        raise InvalidRequest("max_tokens", f"max_tokens must be in [1, {facts.max_tokens}], "
                             f"got {request.max_tokens}")
    if request.temperature is not None:
        if not 0 <= request.temperature <= facts.max_temperature:
            raise InvalidRequest("temperature", f"temperature must be in "
                                 f"[0, {facts.max_temperature:g}], got {request.temperature}")
        sampling.temperature = request.temperature
    if request.top_p is not None:
        if not 0 < request.top_p <= 1:
            raise InvalidRequest("top_p", f"top_p must be in (0, 1], got {request.top_p}")
        sampling.top_p = request.top_p
    if request.seed is not None:
        if not 0 <= request.seed <= MAX_SEED:
            raise InvalidRequest("seed", f"seed must be in [0, {MAX_SEED}], got {request.seed}")
        sampling.seed = request.seed
    return sampling


async def _speech_job(core: GatewayCore, recipe: Recipe, audio: AudioOutput,
                      seed: int | None) -> SpeechJob:
    """The speech recipe's checked request (voice, format), with a stand-in text."""
    if audio.format is not None and audio.format not in AUDIO_FORMATS:
        raise InvalidRequest("audio.format", f"audio.format must be one of "
                             f"{sorted(AUDIO_FORMATS)}, got {audio.format!r}")
    fmt = AUDIO_FORMATS[audio.format or "wav"]
    speech_model = recipe.speech or (core.mesh.recipe("", Task.TEXT_TO_SPEECH).name)
    try:
        return await prepare_speech(core, SpeechRequest(
            input=_PROBE_TEXT, model=speech_model, voice=audio.voice,
            response_format=fmt.value, seed=seed))
    except InvalidRequest as error:
        field = f"audio.{error.field_name}" if error.field_name == "voice" else error.field_name
        raise InvalidRequest(field, error.message) from None


# -- sentences ------------------------------------------------------------------------------

#: The end of a sentence: . ! ? (closing quotes or brackets may follow) before a space, or a
#: line break. A number's point ("3.5") and a list's "1. " are no ends (see `_is_end`).
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*(?=\s)|\n+")
#: The end of a clause: , ; : (closing quotes or brackets may follow) or a dash, before a space
#: ("1,000" is no end).
_CLAUSE_END = re.compile(r"[,;:]+[\"')\]]*(?=\s)|(?<=\s)(?:-+|\u2013|\u2014)(?=\s)")
#: A word followed by a space: the first piece's cap counts these.
_WORD = re.compile(r"\S+(?=\s)")
#: The space before a break word (one still being written may grow: "is" + "land" only moves
#: the cut, never a word).
_BREAK = re.compile(r"\s+(?=(?:" + "|".join(_BREAK_WORDS) + r")\b)")
#: A sentence mark that ends the text written so far (a first piece need not wait for what
#: follows it).
_END_OF_TEXT = re.compile(r"[.!?]+[\"')\]]*$")


class SentenceSplitter:
    """Text in pieces -> whole sentences, each as soon as its end has been written; with
    `first_clause`, the first one ends sooner, at its first clause (FIRST_CLAUSE_WORDS)."""

    def __init__(self, max_chars: int = MAX_SENTENCE_CHARS, first_clause: bool = False) -> None:
        self.max_chars = max_chars
        self._text = ""
        self._first = first_clause  # the next cut is the first piece's

    def push(self, piece: str) -> list[str]:
        """Add written text; return the sentences it completed, in order."""
        self._text += piece
        sentences: list[str] = []
        while (cut := self._next_cut()) is not None:
            sentence, self._text = self._text[:cut].strip(), self._text[cut:]
            if _speakable(sentence):
                sentences.append(sentence)
                self._first = False
            else:  # "1." or a stray mark: keep it with what follows
                self._text = sentence + " " + self._text.lstrip()
                break
        return sentences

    def flush(self) -> list[str]:
        """The rest of the text, once the answer has ended."""
        rest, self._text = self._text.strip(), ""
        return [rest] if _speakable(rest) else []

    def _next_cut(self) -> int | None:
        cuts = [match.end() for match in _SENTENCE_END.finditer(self._text)
                if _is_end(self._text, match.start())][:1]
        if self._first:
            cuts += [match.end() for match in _CLAUSE_END.finditer(self._text)
                     if len(self._text[:match.start()].split()) >= FIRST_CLAUSE_WORDS][:1]
            cuts += self._break_cut() + self._capped_cut() + self._written_end()
        if cuts:
            return min(cuts)
        if len(self._text) > self.max_chars:
            space = self._text.rfind(" ", 0, self.max_chars)
            return space if space > 0 else self.max_chars
        return None


    def _break_cut(self) -> list[int]:
        """Before the first break word that follows FIRST_CLAUSE_WORDS words, the last of which
        does not lead into it ("the one that | is" would)."""
        for match in _BREAK.finditer(self._text):
            words = self._text[:match.start()].split()
            if (len(words) >= FIRST_CLAUSE_WORDS
                    and words[-1].lower().strip("\"'()[]") not in _LEADING_WORDS):
                return [match.start()]
        return []

    def _written_end(self) -> list[int]:
        """The sentence mark that ends the text so far, unless what follows could continue it:
        a number's point ("3" + ".5") or a one-letter abbreviation ("e." + "g.")."""
        match = _END_OF_TEXT.search(self._text)
        if match is None or not _is_end(self._text, match.start()):
            return []
        words = self._text[:match.start()].split()
        return [match.end()] if words and len(words[-1]) > 1 else []

    def _capped_cut(self) -> list[int]:
        """Where the first piece ends for want of a mark: after FIRST_PIECE_MAX_WORDS words,
        moved back over the words that lead into what follows (never below
        FIRST_CLAUSE_WORDS); none before that many words are written."""
        words = list(_WORD.finditer(self._text))[:FIRST_PIECE_MAX_WORDS]
        if len(words) < FIRST_PIECE_MAX_WORDS:
            return []
        while (len(words) > FIRST_CLAUSE_WORDS
               and words[-1].group().lower().strip("\"'()[],;:") in _LEADING_WORDS):
            words.pop()
        return [words[-1].end()]


def _is_end(text: str, at: int) -> bool:
    """Whether the mark at `at` ends a sentence: not the point of a list number ("1. ")."""
    if text[at] != ".":
        return True
    words = text[:at].split()
    return not (words and words[-1].isdigit())


def _speakable(sentence: str) -> bool:
    return any(c.isalnum() for c in sentence) and not sentence.rstrip(".").isdigit()


# -- running it -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TextPiece:
    """Text the thinker wrote since the previous piece."""

    text: str


@dataclass(frozen=True)
class SpokenText:
    """A piece of the answer (a sentence, or the first clause) going to the talker now; its
    audio follows."""

    text: str


@dataclass(frozen=True)
class SpokenPiece:
    """Audio of the answer, in order; `transcript` is set on a spoken text's first piece."""

    pcm: Samples
    sample_rate: int
    transcript: str = ""


ChatPiece = TextPiece | SpokenText | SpokenPiece


@dataclass(frozen=True)
class ChatSummary:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    sample_rate: int = 0  # 0 = no audio


def thinker_stub(core: GatewayCore, recipe: Recipe) -> ThinkerServiceAsyncStub:
    return thinker_service_pb2_grpc.ThinkerServiceStub(core.mesh.channel(recipe.stage("thinker")))


def _thinker_start(scope: CancelScope, job: ChatJob,
                   messages: tuple[ChatTurn, ...]) -> pb.GenerateTokensRequest:
    return pb.GenerateTokensRequest(start=pb.GenerateTokensStart(
        request_id=scope.stage_request_id, sampling=job.sampling, priority=job.priority,
        messages=[pb.ChatMessage(role=t.role, content=t.content) for t in messages]))


class _Voice:
    """Speaks finished pieces one after another while the thinker writes the next ones."""

    def __init__(self, core: GatewayCore, speech: SpeechJob, scope: CancelScope,
                 emit: Emit[ChatPiece]) -> None:
        self.stubs = core.mesh.speech_stubs(speech.recipe)
        self.params = speech.params
        self.scope = scope
        self.emit = emit
        self.sample_rate = 0
        #: Pieces waiting to be spoken; None: the answer is complete.
        self.sentences: asyncio.Queue[str | None] = asyncio.Queue()

    async def say(self, sentences: list[str]) -> None:
        """Announce each piece, then queue it for the talker (so its text leaves first)."""
        for sentence in sentences:
            await self.emit(Output(SpokenText(sentence)))
            self.sentences.put_nowait(sentence)

    async def speak_all(self) -> None:
        while (sentence := await self.sentences.get()) is not None:
            await self._speak(sentence)

    async def _speak(self, sentence: str) -> None:
        transcript = sentence

        async def emit_audio(item: StageEvent | Output[AudioPiece]) -> None:
            nonlocal transcript
            if isinstance(item, Output):
                piece = item.value
                self.sample_rate = piece.sample_rate
                await self.emit(Output(SpokenPiece(piece.pcm, piece.sample_rate, transcript)))
                transcript = ""

        params = dataclasses.replace(self.params, input=sentence)
        await speak(params, self.scope, self.stubs, emit_audio)


async def run_chat(core: GatewayCore, job: ChatJob, scope: CancelScope,
                   emit: Emit[ChatPiece]) -> ChatSummary:
    """Thinker (and, with audio, the speech stages sentence by sentence) for one answer."""
    voice = _Voice(core, job.speech, scope, emit) if job.speech is not None else None
    splitter = SentenceSplitter(first_clause=job.first_clause)
    written: list[str] = []

    async def on_delta(stage: str, response: pb.GenerateTokensResponse) -> None:
        if response.WhichOneof("event") == "delta" and response.delta.text:
            written.append(response.delta.text)
            await emit(Output(TextPiece(response.delta.text)))
            if voice is not None:
                await voice.say(splitter.push(response.delta.text))

    messages = await _heard_messages(core, job, scope) if job.heard else job.messages

    async def think() -> pb.GenerateTokensResult:
        answered = await call_stage(scope, "thinker", thinker_stub(core, job.recipe).GenerateTokens,
                                    _thinker_start(scope, job, messages), pb.GenerateTokensRequest,
                                    on_event=on_delta)
        if voice is not None:
            await voice.say(splitter.flush())
            voice.sentences.put_nowait(None)
        return answered.result

    async with side_by_side() as group:  # the first failure cancels the other side
        thinking = group.create_task(think())
        if voice is not None:
            group.create_task(voice.speak_all())
    result = thinking.result()
    return ChatSummary(text="".join(written), finish_reason=result.finish_reason,
                       prompt_tokens=result.prompt_tokens,
                       completion_tokens=result.completion_tokens,
                       sample_rate=voice.sample_rate if voice is not None else 0)


async def answer(core: GatewayCore, job: ChatJob, context: RequestContext,
                 emit: Emit[ChatPiece]) -> ChatSummary:
    """run_chat inside the request's CancelScope (failures become GatewayErrors)."""
    async with core.request_scope(job.recipe, context) as scope:
        return await run_chat(core, job, scope, emit)


def chat_events(core: GatewayCore, job: ChatJob, context: RequestContext) -> ChatEvents:
    """answer as a stream: text and audio pieces as they come, then Done with the summary."""

    async def run(emit: Emit[ChatPiece]) -> ChatSummary:
        return await answer(core, job, context, emit)

    return stream_pipeline(run)


# -- the public gRPC API (GatewayService.Chat) ----------------------------------------------


def chat_request_of(request: gateway_pb.ChatRequest) -> ChatRequest:
    """The proto's zero values mean "not given" (0 max_tokens = default, no audio = text)."""
    turns = []
    for index, message in enumerate(request.messages):
        if message.role not in ROLES:
            raise InvalidRequest(f"messages.[{index}].role", f"unknown role {message.role!r}; "
                                 f"known: {sorted(ROLES)}")
        turns.append(ChatTurn(ROLES[message.role], message.content))
    audio = (AudioOutput(voice=request.audio.voice or None, format=request.audio.format or None)
             if request.HasField("audio") else None)
    return ChatRequest(
        messages=tuple(turns), model=request.model, max_tokens=request.max_tokens or None,
        temperature=request.temperature if request.HasField("temperature") else None,
        top_p=request.top_p if request.HasField("top_p") else None,
        seed=request.seed if request.HasField("seed") else None, audio=audio,
        priority=request.priority)


class _NativeResponses:
    """Chat events -> ChatResponse messages; the audio is one stream in the asked format."""

    def __init__(self, request_id: str, fmt: AudioFormat | None) -> None:
        self.request_id = request_id
        self.fmt = fmt
        self.encoder: StreamEncoder | None = None

    def of(self, item: StageEvent | Output[ChatPiece] | Done[ChatSummary]
           ) -> list[gateway_pb.ChatResponse]:
        if isinstance(item, Output) and isinstance(item.value, TextPiece):
            return [gateway_pb.ChatResponse(request_id=self.request_id, text=item.value.text)]
        if isinstance(item, Output) and isinstance(item.value, SpokenPiece):
            piece = item.value
            return [self._audio(self._encoder(piece.sample_rate).chunk(piece.pcm),
                                piece.transcript)]
        if isinstance(item, Done):
            tail = self.encoder.end() if self.encoder is not None else b""
            summary = item.result
            return [*([self._audio(tail)] if tail else []), gateway_pb.ChatResponse(
                request_id=self.request_id, result=gateway_pb.ChatResult(
                    finish_reason=summary.finish_reason, prompt_tokens=summary.prompt_tokens,
                    completion_tokens=summary.completion_tokens))]
        return []

    def _encoder(self, sample_rate: int) -> StreamEncoder:
        if self.encoder is None:
            self.encoder = StreamEncoder(self.fmt or AudioFormat.WAV, sample_rate)
        return self.encoder

    def _audio(self, data: bytes, transcript: str = "") -> gateway_pb.ChatResponse:
        assert self.encoder is not None
        return gateway_pb.ChatResponse(request_id=self.request_id, audio=gateway_pb.ChatAudioChunk(
            data=data, transcript=transcript, sample_rate=self.encoder.sample_rate))


async def native_chat(core: GatewayCore, request: gateway_pb.ChatRequest,
                      context: RequestContext) -> AsyncGenerator[gateway_pb.ChatResponse, None]:
    """GatewayService.Chat: text events as written, audio events sentence by sentence (one
    continuous stream in the requested format), then the result."""
    recipe = core.mesh.recipe(request.model, Task.CHAT)
    job = await prepare_chat(core, recipe, chat_request_of(request))
    context = context.for_request(request.request_id)
    responses = _NativeResponses(
        context.request_id, job.speech.params.response_format if job.speech else None)
    async with contextlib.aclosing(chat_events(core, job, context)) as items:
        async for item in items:
            for response in responses.of(item):
                yield response

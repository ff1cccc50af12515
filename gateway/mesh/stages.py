"""The gateway's view of the stages, in two halves.

Mesh: the recipes, the replicas of every stage address, stage health, and cancel by id across
every replica. A stage address is a gRPC target that may name several replicas (see
`recipes.parse_target`); each distinct address gets one ReplicaSet (balancer.py), which opens
one channel per replica and picks the replica each stage call goes to. `start()` opens them
and `close()` closes them (the gateway's lifespan does both); nothing opens a channel lazily.

StageCatalog: what the stages publish about themselves, read through their Describe RPCs and
cached. Each stage owns its limits and model facts (sizes, steps, voices, sample rates, modes) and
publishes them; the gateway enforces exactly those. Answers are cached per stage address (all
replicas of a stage run with the same options, so any one answers for all) and dropped whenever
a connection to one of its replicas leaves READY or its replicas change (a replica went away,
restarted, or the connection idled), so a stage that comes back with new options is read
again by the next request that needs it. A stage that cannot be read is a 503 (UNAVAILABLE)
naming the stage.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeAlias, TypeVar

import grpc
from grpc_health.v1 import health_pb2

from stagemesh.gateway.errors import InvalidRequest, StageUnavailable
from stagemesh.gateway.mesh.balancer import (
    NoReplica,
    OnBack,
    OnChange,
    Replica,
    ReplicaChannel,
    ReplicaSet,
    ReplicaState,
    cancelling,
    health_status,
)
from stagemesh.gateway.mesh.stubs import (
    ImageStubs,
    SpeechStubs,
    codec_stub,
    dit_stub,
    talker_stub,
    tokenizer_stub,
    transcriber_stub,
    vae_stub,
)
from stagemesh.gateway.recipes import Recipe, StageEndpoint, TargetKind, Task, default_recipe
from stagemesh.shared.errors import parse_rpc_error
from stagemesh.shared.proto.v1 import (
    codec_service_pb2,
    common_pb2,
    control_service_pb2,
    control_service_pb2_grpc,
    dit_service_pb2,
    gateway_service_pb2,
    talker_service_pb2,
    thinker_service_pb2,
    thinker_service_pb2_grpc,
    tokenizer_service_pb2,
    transcriber_service_pb2,
    vae_service_pb2,
)

# A request's LoRA adapters as the DiT takes them (common.LoraAdapter), and the limits the
# recipe's DiT publishes for them.
#: The field a request names its adapters in.
LORA_FIELD = "lora"
#: What a request names when it gives no scale (diffusers' set_adapters default).
DEFAULT_SCALE = 1.0

@dataclass(frozen=True)
class LoraChoice:
    """One adapter a request runs under, at its scale."""

    name: str
    scale: float = DEFAULT_SCALE


def refuse_lora(message: str) -> InvalidRequest:
    return InvalidRequest(LORA_FIELD, f"lora: {message}")


def lora_from_proto(uses: Iterable[common_pb2.LoraAdapter]) -> tuple[LoraChoice, ...]:
    return tuple(
        LoraChoice(use.name, use.scale if use.HasField("scale") else DEFAULT_SCALE) for use in uses
    )


def lora_to_proto(choices: Sequence[LoraChoice]) -> list[common_pb2.LoraAdapter]:
    return [common_pb2.LoraAdapter(name=choice.name, scale=choice.scale) for choice in choices]


@dataclass(frozen=True)
class LoraFacts:
    """What the recipe's DiT publishes about its adapters (none by default)."""

    names: frozenset[str] = frozenset()
    max_per_request: int = 0
    max_scale: float = 0.0

    def check(self, choices: Sequence[LoraChoice]) -> None:
        """Known names, each once, at most max_per_request, |scale| within max_scale."""
        if not choices:
            return
        if not self.names:
            raise refuse_lora("this model serves no LoRA adapters")
        if len(choices) > self.max_per_request:
            raise refuse_lora(
                f"at most {self.max_per_request} adapters per request, got {len(choices)}"
            )
        seen: set[str] = set()
        for choice in choices:
            if choice.name not in self.names:
                raise refuse_lora(
                    f"unknown adapter {choice.name!r}; this model serves {sorted(self.names)}"
                )
            if choice.name in seen:
                raise refuse_lora(f"adapter {choice.name!r} named twice")
            seen.add(choice.name)
            if not (math.isfinite(choice.scale) and abs(choice.scale) <= self.max_scale):
                raise refuse_lora(
                    f"scale of {choice.name!r} must be within ±{self.max_scale:g}, "
                    f"got {choice.scale}"
                )

    @classmethod
    def published(cls, dit: dit_service_pb2.DescribeDitResponse) -> LoraFacts:
        return cls(frozenset(dit.lora_names), dit.max_loras_per_request, dit.max_lora_scale)


#: A DiT that serves no adapters (and what a request's facts default to).
NO_LORAS = LoraFacts()


HEALTH_TIMEOUT_S = 1.0
#: How long a cancel fanned out to the replicas waits for their answers (a replica holding the
#: request answers once its state is freed).
CANCEL_FANOUT_TIMEOUT_S = 12.0


@dataclass(frozen=True)
class StageCancel:
    """One replica's answer to a cancel by id."""

    stage: str
    replica: str
    reply: control_service_pb2.CancelStageRequestResponse


class Mesh:
    """Recipes + the replicas of their stages. Open with `start()`, close with `close()`."""

    def __init__(self, recipes: Mapping[str, Recipe]) -> None:
        self.recipes = dict(recipes)
        self._sets: dict[str, ReplicaSet] = {}
        self._channels: dict[str, ReplicaChannel] = {}
        #: What an empty `model` selects, per task (the recipes are fixed for the mesh's life).
        self._defaults = {task: default_recipe(self.recipes, task) for task in Task}
        #: Each recipe's stubs, built on its first request (a channel is fixed once started).
        self._image_stubs: dict[str, ImageStubs] = {}
        self._speech_stubs: dict[str, SpeechStubs] = {}
        self._on_back: list[OnBack] = []

    async def start(self) -> None:
        for _, endpoint in self.endpoints():
            if endpoint.address not in self._sets:
                replicas = ReplicaSet(endpoint.name, endpoint.address, endpoint.target)
                for callback in self._on_back:
                    replicas.on_back(callback)
                self._sets[endpoint.address] = replicas
                self._channels[endpoint.address] = ReplicaChannel(replicas)
                await replicas.start()

    async def close(self) -> None:
        sets = list(self._sets.values())
        self._sets.clear()
        self._channels.clear()
        self._image_stubs.clear()
        self._speech_stubs.clear()
        await asyncio.gather(*(replicas.close() for replicas in sets))

    def on_change(self, callback: OnChange) -> None:
        """`callback(address)` whenever what answers at a stage address may have changed."""
        for replicas in self._sets.values():
            replicas.on_change(callback)

    def on_back(self, callback: OnBack) -> None:
        """`callback(address, replica)` is awaited before a replica of any stage serves again
        (balancer.ReplicaSet.on_back), whether the mesh is started yet or not."""
        self._on_back.append(callback)
        for replicas in self._sets.values():
            replicas.on_back(callback)

    @property
    def channels(self) -> Mapping[str, grpc.aio.Channel]:
        """A channel per stage address, over its replicas (see balancer.ReplicaChannel)."""
        return self._channels

    def replica_set(self, endpoint: StageEndpoint) -> ReplicaSet:
        try:
            return self._sets[endpoint.address]
        except KeyError:
            raise RuntimeError(f"no replicas open for {endpoint.address}: "
                               "the mesh is not started") from None

    def channel(self, endpoint: StageEndpoint) -> grpc.aio.Channel:
        self.replica_set(endpoint)  # raises when not started
        return self._channels[endpoint.address]

    def recipe(self, model: str | None, task: Task) -> Recipe:
        """The recipe a request's `model` selects (empty = the task's default)."""
        if not model:
            recipe = self._defaults[task]
            if recipe is None:
                raise InvalidRequest("model", f"no recipe serves {task.value}")
            return recipe
        recipe = self.recipes.get(model)
        if recipe is None:
            raise InvalidRequest("model", f"unknown model {model!r}; served: "
                                 f"{sorted(self.recipes)}")
        if recipe.task is not task:
            raise InvalidRequest("model", f"model {model!r} serves {recipe.task.value}, "
                                 f"not {task.value}")
        return recipe

    def image_stubs(self, recipe: Recipe) -> ImageStubs:
        stubs = self._image_stubs.get(recipe.name)
        if stubs is None:
            stubs = ImageStubs(tokenizer=tokenizer_stub(self.channel(recipe.stage("tokenizer"))),
                               dit=dit_stub(self.channel(recipe.stage("dit"))),
                               vae=vae_stub(self.channel(recipe.stage("vae"))))
            self._image_stubs[recipe.name] = stubs
        return stubs

    def speech_stubs(self, recipe: Recipe) -> SpeechStubs:
        stubs = self._speech_stubs.get(recipe.name)
        if stubs is None:
            stubs = SpeechStubs(talker=talker_stub(self.channel(recipe.stage("talker"))),
                                codec=codec_stub(self.channel(recipe.stage("codec"))))
            self._speech_stubs[recipe.name] = stubs
        return stubs

    def endpoints(self) -> list[tuple[Recipe, StageEndpoint]]:
        """Every stage of every recipe, in recipe order."""
        return [(r, e) for r in self.recipes.values() for e in r.stages.values()]

    async def stage_rows(self) -> list[tuple[StageEndpoint, gateway_service_pb2.StageInfo]]:
        """Every replica of every stage with its grpc.health status, beside the endpoint of its
        stage (device and dtype: see GatewayCore); a stage of one replica is one row, as before
        replicas. The rows are taken at one moment: a replica set changing while the health
        checks run (a failed replica replaced) changes nothing here."""
        rows = [(r, e, replica) for r, e in self.endpoints()
                for replica in self.replica_set(e).replicas if not replica.retired]
        healths = await asyncio.gather(*(_health(replica) for _, _, replica in rows))
        return [(e, gateway_service_pb2.StageInfo(
                    name=e.name, recipe=r.name, address=replica.address, health=health,
                    metrics_url=_metrics_url(e, replica)))
                for (r, e, replica), health in zip(rows, healths, strict=True)]

    async def stage_health(self) -> dict[str, str]:
        """`recipe/stage` -> SERVING when any replica of the stage serves, else what its
        first replica reports (a stage is up while one replica is).

        Read from what the balancer last polled (every POLL_INTERVAL_S), never asked of the
        stages here: a stage busy with requests answers its health check late, and /health (a
        liveness probe, 1 s timeout) must not wait on it. Only a replica not polled yet (just
        started) is asked."""
        health = {address: await _set_health(replicas) for address, replicas in self._sets.items()}
        return {f"{r.name}/{e.name}": health.get(e.address, "NO_REPLICA")
                for r, e in self.endpoints()}

    async def cancel_everywhere(self, request_id: str, reason: str,
                                owner: str) -> list[StageCancel]:
        """Send a cancel by id to every replica of every stage (for a request this gateway
        does not run); the replies, in recipe stage order. A replica that cannot be reached
        in time is left out."""
        targets = [(replicas.stage, replica) for replicas in self._sets.values()
                   for replica in replicas.replicas if not replica.retired]
        request = control_service_pb2.CancelStageRequestRequest(
            request_id=request_id, reason=reason, owner=owner)
        replies = await asyncio.gather(
            *(control_service_pb2_grpc.StageControlServiceStub(replica.channel)
              .CancelStageRequest(request, timeout=CANCEL_FANOUT_TIMEOUT_S)
              for _, replica in targets), return_exceptions=True)
        return [StageCancel(stage, replica.address, reply)
                for (stage, replica), reply in zip(targets, replies, strict=True)
                if isinstance(reply, control_service_pb2.CancelStageRequestResponse)]


def _metrics_url(endpoint: StageEndpoint, replica: Replica) -> str:
    """A replica's /metrics: a listed replica's own port; a DNS-resolved one (a pod) serves on
    the stage's metrics port."""
    index = 0 if endpoint.target.kind is TargetKind.DNS else replica.index
    return endpoint.metrics_url_of(replica.address, index)


async def _set_health(replicas: ReplicaSet) -> str:
    states = [await _polled_health(r) for r in replicas.replicas if not r.retired]
    return "SERVING" if "SERVING" in states else next(iter(states), "NO_REPLICA")


async def _polled_health(replica: Replica) -> str:
    """What the balancer's last poll found (ReplicaState's values are grpc.health's names, and
    UNREACHABLE); a replica not polled yet is asked now."""
    if replica.state is ReplicaState.UNKNOWN:
        return await _health(replica)
    return str(replica.state.value)


async def _health(replica: Replica) -> str:
    status = await health_status(replica.channel, HEALTH_TIMEOUT_S)
    if status is None:
        return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


# -- what the stages publish ----------------------------------------------------------------------

log = logging.getLogger(__name__)

#: A Describe call is tiny: a stage that does not answer in this time is unavailable.
DESCRIBE_TIMEOUT_S = 5.0

#: A common_pb2.ExecutionMode value.
ExecutionMode: TypeAlias = common_pb2.ExecutionMode.ValueType
R = TypeVar("R")


@dataclass(frozen=True)
class ImageFacts:
    """What a text-to-image request may ask, as its Tokenizer, DiT and VAE publish it."""

    max_prompt_chars: int
    size_multiple: int  # width and height: multiples of this (DiT and VAE agree)
    max_side: int
    max_pixels: int
    max_steps: int
    max_true_cfg_scale: float
    max_images_per_request: int
    min_steps: int
    execution_modes: tuple[ExecutionMode, ...]  # the first is the default
    #: The DiT's step cache ("off", "first_block", "taylorseer"), its own threshold and the
    #: largest one a request may set (0: the stage runs no cache).
    step_cache: str = "off"
    step_cache_threshold: float = 0.0
    max_step_cache_threshold: float = 0.0
    #: Step previews: the longest side a request may ask (0: none), the default side, and the
    #: fewest steps between two.
    max_preview_size: int = 0
    default_preview_size: int = 0
    min_preview_every: int = 0
    lora: LoraFacts = NO_LORAS  # the DiT's adapters

    @classmethod
    def published(cls, tokenizer: tokenizer_service_pb2.DescribeTokenizerResponse,
                  dit: dit_service_pb2.DescribeDitResponse,
                  vae: vae_service_pb2.DescribeVaeResponse) -> ImageFacts:
        sides = [side for side in (dit.max_side, vae.max_side) if side > 0]
        return cls(max_prompt_chars=tokenizer.max_prompt_chars,
                   size_multiple=math.lcm(max(1, dit.size_multiple), max(1, vae.size_multiple)),
                   max_side=min(sides) if sides else 0, max_pixels=dit.max_pixels,
                   max_steps=dit.max_steps, max_true_cfg_scale=dit.max_true_cfg_scale,
                   max_images_per_request=dit.max_images_per_request,
                   min_steps=max(1, dit.min_steps),
                   execution_modes=tuple(dit.execution_modes),
                   step_cache=dit.step_cache or "off",
                   step_cache_threshold=dit.step_cache_threshold,
                   max_step_cache_threshold=dit.max_step_cache_threshold,
                   max_preview_size=dit.max_preview_size,
                   default_preview_size=dit.default_preview_size,
                   min_preview_every=dit.min_preview_every,
                   lora=LoraFacts.published(dit))


@dataclass(frozen=True)
class EditFacts:
    """What an image-edit request may ask: the image facts, and the input images' limits."""

    image: ImageFacts
    max_images: int  # input images per request: what both Tokenizer and DiT take
    max_image_pixels: int  # one input image's height x width (the Tokenizer's limit)
    can_encode: bool  # the VAE has EncodeImage
    task: str  # what the DiT's model does ("image-edit" for an edit model)
    #: The VAE's limits on the size an input image is encoded at (the output's are `image`'s).
    encode_size_multiple: int
    encode_max_side: int
    #: The area the VAE encodes an input image at (a folder's own `condition_area`);
    #: 0: it did not say, the stock pipeline's (images/edit_protocol.CONDITION_AREA).
    condition_area: int = 0

    @classmethod
    def published(cls, tokenizer: tokenizer_service_pb2.DescribeTokenizerResponse,
                  dit: dit_service_pb2.DescribeDitResponse,
                  vae: vae_service_pb2.DescribeVaeResponse) -> EditFacts:
        return cls(image=ImageFacts.published(tokenizer, dit, vae),
                   max_images=min(tokenizer.max_images, dit.max_condition_images),
                   max_image_pixels=tokenizer.max_image_pixels, can_encode=vae.can_encode,
                   task=dit.task, encode_size_multiple=max(1, vae.size_multiple),
                   encode_max_side=vae.max_side, condition_area=vae.condition_area)


@dataclass(frozen=True)
class VideoFacts:
    """What a video request may ask: the image facts (prompt, frame size, steps, guidance via
    `image.max_true_cfg_scale`) and the video ones."""

    image: ImageFacts
    max_frames: int  # what both DiT and VAE take
    frame_multiple: int  # frames = frame_multiple * k + 1 (Wan: 4)
    max_condition_images: int  # 0: text-to-video; image-to-video takes exactly one
    has_second_transformer: bool  # guidance_scale_2 and boundary_ratio apply
    accepts_flow_shift: bool
    can_encode: bool  # the VAE has EncodeImage (image-to-video)
    task: str  # what the DiT's model does ("text-to-video", "image-to-video")
    max_video_pixels: int = 0  # frames x height x width the DiT takes (0: no such limit)
    #: latent frames per transformer token: a clip's latent frames are a multiple of it
    frame_patch: int = 1

    @classmethod
    def published(cls, tokenizer: tokenizer_service_pb2.DescribeTokenizerResponse,
                  dit: dit_service_pb2.DescribeDitResponse,
                  vae: vae_service_pb2.DescribeVaeResponse) -> VideoFacts:
        frames = [count for count in (dit.max_frames, vae.max_frames) if count > 0]
        return cls(image=ImageFacts.published(tokenizer, dit, vae),
                   max_frames=min(frames) if len(frames) == 2 else 0,
                   frame_multiple=dit.frame_multiple,
                   max_condition_images=dit.max_condition_images,
                   has_second_transformer=dit.has_second_transformer,
                   accepts_flow_shift=dit.accepts_flow_shift, can_encode=vae.can_encode,
                   task=dit.task, max_video_pixels=dit.max_video_pixels,
                   frame_patch=max(1, dit.frame_patch))


@dataclass(frozen=True)
class SpeechFacts:
    """What a text-to-speech request may ask, as its Talker and Codec publish it."""

    voices: tuple[str, ...]
    default_voice: str
    supports_voice_clone: bool
    max_input_chars: int
    max_reference_text_chars: int
    max_new_frames: int
    default_max_new_frames: int
    max_temperature: float
    max_top_k: int
    max_reference_seconds: float
    reference_sample_rates: tuple[int, ...]

    @classmethod
    def published(cls, talker: talker_service_pb2.DescribeTalkerResponse,
                  codec: codec_service_pb2.DescribeCodecResponse) -> SpeechFacts:
        return cls(voices=tuple(talker.voices), default_voice=talker.default_voice,
                   supports_voice_clone=talker.supports_voice_clone,
                   max_input_chars=talker.max_input_chars,
                   max_reference_text_chars=talker.max_reference_text_chars,
                   max_new_frames=talker.max_new_frames,
                   default_max_new_frames=talker.default_max_new_frames,
                   max_temperature=talker.max_temperature, max_top_k=talker.max_top_k,
                   max_reference_seconds=codec.max_reference_seconds,
                   reference_sample_rates=tuple(codec.reference_sample_rates))


#: A stage's Describe answer, whatever its role.
StageAnswer: TypeAlias = (
    tokenizer_service_pb2.DescribeTokenizerResponse | dit_service_pb2.DescribeDitResponse
    | vae_service_pb2.DescribeVaeResponse | talker_service_pb2.DescribeTalkerResponse
    | codec_service_pb2.DescribeCodecResponse | thinker_service_pb2.DescribeThinkerResponse
    | transcriber_service_pb2.DescribeTranscriberResponse
)


def publish_into(info: gateway_service_pb2.StageInfo, answer: StageAnswer) -> None:
    """What a stage's /v1/stages row shows of its Describe: where and in what dtype it
    computes, and the quantization and compilation in force where the stage has those options
    (the tokenizer: quantization; the DiT: both, and its parallel group's degrees and
    devices); the others leave them empty."""
    info.device, info.dtype = answer.stage.device, answer.stage.dtype
    if isinstance(answer, dit_service_pb2.DescribeDitResponse):
        info.quantization, info.compile = answer.quantization, answer.compile
        info.parallel_cfg, info.parallel_ulysses = answer.parallel_cfg, answer.parallel_ulysses
        info.group_devices[:] = answer.group_devices
    elif isinstance(answer, tokenizer_service_pb2.DescribeTokenizerResponse):
        info.quantization = answer.quantization


class DescribeCache(Generic[R]):
    """One stage kind's Describe answers by address, each kept until `drop(address)`."""

    def __init__(self, stage: str, describe: Callable[[grpc.aio.Channel], Awaitable[R]]) -> None:
        self.stage = stage
        self._describe = describe
        self._answers: dict[str, R] = {}
        self._generation: dict[str, int] = {}  # bumped by drop(): late answers are not kept

    async def get(self, address: str, channel: grpc.aio.Channel) -> R:
        """The cached answer, or a fresh one (raises grpc.aio.AioRpcError if unreachable)."""
        if address in self._answers:
            return self._answers[address]
        generation = self._generation.get(address, 0)
        answer = await self._describe(channel)
        if self._generation.get(address, 0) == generation:
            self._answers[address] = answer
        return answer

    def drop(self, address: str) -> None:
        self._answers.pop(address, None)
        self._generation[address] = self._generation.get(address, 0) + 1


class StageCatalog:
    """The published facts of every stage of the mesh. `start()` watches the channels;
    `close()` stops watching (before the channels close)."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.tokenizer = DescribeCache("tokenizer", lambda channel: tokenizer_stub(
            channel).DescribeTokenizer(tokenizer_service_pb2.DescribeTokenizerRequest(),
                                       timeout=DESCRIBE_TIMEOUT_S))
        self.dit = DescribeCache("dit", lambda channel: dit_stub(channel).DescribeDit(
            dit_service_pb2.DescribeDitRequest(), timeout=DESCRIBE_TIMEOUT_S))
        self.vae = DescribeCache("vae", lambda channel: vae_stub(channel).DescribeVae(
            vae_service_pb2.DescribeVaeRequest(), timeout=DESCRIBE_TIMEOUT_S))
        self.talker = DescribeCache("talker", lambda channel: talker_stub(channel).DescribeTalker(
            talker_service_pb2.DescribeTalkerRequest(), timeout=DESCRIBE_TIMEOUT_S))
        self.codec = DescribeCache("codec", lambda channel: codec_stub(channel).DescribeCodec(
            codec_service_pb2.DescribeCodecRequest(), timeout=DESCRIBE_TIMEOUT_S))
        self.thinker = DescribeCache(
            "thinker", lambda channel: thinker_service_pb2_grpc.ThinkerServiceStub(
                channel).DescribeThinker(thinker_service_pb2.DescribeThinkerRequest(),
                                         timeout=DESCRIBE_TIMEOUT_S))
        self.transcriber = DescribeCache(
            "transcriber", lambda channel: transcriber_stub(channel).DescribeTranscriber(
                transcriber_service_pb2.DescribeTranscriberRequest(), timeout=DESCRIBE_TIMEOUT_S))
        self._watching = False

    def start(self) -> None:
        """Drop a stage's facts whenever a connection to one of its replicas leaves READY, or
        its replicas change: what answers after that may be a different process, with
        different options."""
        if not self._watching:
            self.mesh.on_change(self._changed)
            self._watching = True

    async def close(self) -> None:
        self._watching = False

    def _changed(self, address: str) -> None:
        if self._watching:
            log.info("stage %s changed: its facts will be read again", address)
            self.drop(address)

    def drop(self, address: str) -> None:
        """Forget what the stage at `address` published (it is read again when needed)."""
        for cache in (self.tokenizer, self.dit, self.vae, self.talker, self.codec,
                      self.thinker, self.transcriber):
            cache.drop(address)

    async def description(self, endpoint: StageEndpoint) -> common_pb2.StageDescription | None:
        """What the stage at `endpoint` says about itself (role, model, capacity, device,
        dtype), from the cached Describe; None while it cannot be read."""
        answer = await self.answer(endpoint)
        return None if answer is None else answer.stage

    async def answer(self, endpoint: StageEndpoint) -> StageAnswer | None:
        """The whole cached Describe answer of the stage at `endpoint`; None while it cannot
        be read."""
        channel = self.mesh.channel(endpoint)
        try:
            match endpoint.name:
                case "tokenizer":
                    return await self.tokenizer.get(endpoint.address, channel)
                case "dit":
                    return await self.dit.get(endpoint.address, channel)
                case "vae":
                    return await self.vae.get(endpoint.address, channel)
                case "talker":
                    return await self.talker.get(endpoint.address, channel)
                case "codec":
                    return await self.codec.get(endpoint.address, channel)
                case "thinker":
                    return await self.thinker.get(endpoint.address, channel)
                case "transcriber":
                    return await self.transcriber.get(endpoint.address, channel)
        except (grpc.aio.AioRpcError, NoReplica):
            return None
        except asyncio.CancelledError:
            if cancelling():
                raise  # the caller itself was cancelled
            return None  # its replica's channel closed under the call (see `read`)
        return None

    async def read(self, cache: DescribeCache[R], recipe: Recipe) -> R:
        """One stage's facts for a recipe; StageUnavailable (503) naming the stage if it
        cannot be read."""
        endpoint = recipe.stages[cache.stage]
        try:
            return await cache.get(endpoint.address, self.mesh.channel(endpoint))
        except grpc.aio.AioRpcError as failed:
            error = parse_rpc_error(failed)
            raise StageUnavailable(
                f"{cache.stage} stage at {endpoint.address} is unavailable: could not read "
                f"its limits ({error.code.name}: {error.message})") from None
        except NoReplica as none:
            raise StageUnavailable(str(none)) from None
        except asyncio.CancelledError:
            if cancelling():
                raise  # the request itself was cancelled
            # the call was cancelled under it: its replica's channel was closed (a replica
            # that went away gets a fresh channel, see balancer.ReplicaSet)
            raise StageUnavailable(
                f"{cache.stage} stage at {endpoint.address} is unavailable: its connection "
                "closed while its limits were read") from None

    async def _image_stages(self, recipe: Recipe) -> tuple[
            tokenizer_service_pb2.DescribeTokenizerResponse, dit_service_pb2.DescribeDitResponse,
            vae_service_pb2.DescribeVaeResponse]:
        """The Describe answers of a Tokenizer/DiT/VAE recipe's stages, read side by side."""
        tokenizer, dit, vae = await asyncio.gather(
            self.read(self.tokenizer, recipe), self.read(self.dit, recipe),
            self.read(self.vae, recipe))
        return tokenizer, dit, vae

    async def image_facts(self, recipe: Recipe) -> ImageFacts:
        return ImageFacts.published(*await self._image_stages(recipe))

    async def edit_facts(self, recipe: Recipe) -> EditFacts:
        return EditFacts.published(*await self._image_stages(recipe))

    async def video_facts(self, recipe: Recipe) -> VideoFacts:
        return VideoFacts.published(*await self._image_stages(recipe))

    async def speech_facts(self, recipe: Recipe) -> SpeechFacts:
        talker, codec = await asyncio.gather(self.read(self.talker, recipe),
                                             self.read(self.codec, recipe))
        return SpeechFacts.published(talker, codec)

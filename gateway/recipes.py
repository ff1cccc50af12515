"""Recipes: which stages serve a model, where they run, their options, and request defaults.

A recipe file is YAML with a list of recipes; the request's `model` field picks one by name.
See gateway/recipes/default.yaml for the embedded default. Limits are not a recipe's business:
each stage owns its limits (its `options`, never looser than its model allows) and publishes
the effective values through its Describe RPC, which is what the gateway enforces.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

DEFAULT_RECIPES = Path(__file__).parent / "recipes" / "default.yaml"

#: A stage option's value (options are passed to the stage process as JSON).
OptionValue = bool | int | float | str


class RecipeError(ValueError):
    """A recipe file is malformed; the message names the recipe and key."""


class TargetKind(enum.Enum):
    """How a stage address names its replicas."""

    STATIC = "static"  # a fixed list: `host:port` or `ipv4:h1:p1,h2:p2` (`ipv6:[a]:p,...`)
    DNS = "dns"  # `dns:///name:port`: every address the name resolves to (re-resolved)


@dataclass(frozen=True)
class StageTarget:
    """A stage address as a gRPC target: the replicas the gateway routes between."""

    kind: TargetKind
    replicas: tuple[str, ...] = ()  # STATIC: each replica's `host:port`
    dns_name: str = ""  # DNS: the name to resolve
    dns_port: int = 0  # DNS: the port every resolved address serves on


def _host_port(text: str, where: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port); RecipeError naming `where` otherwise."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RecipeError(f"{where}: {text!r} is not host:port")
    return host, int(port)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_target(address: str, where: str = "address") -> StageTarget:
    """A stage address -> its replicas. Accepts what gRPC accepts for these schemes:
    `host:port`, `ipv4:a:p[,b:p...]`, `ipv6:[a]:p[,...]`, `dns:///name:port` (also
    `dns:name:port`; a DNS authority `dns://server/...` is not supported)."""
    address = address.strip()
    scheme, sep, rest = address.partition(":")
    if sep and scheme in ("ipv4", "ipv6"):
        replicas: list[str] = []
        for item in rest.split(","):
            host, port = _host_port(item.strip(), where)
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise RecipeError(f"{where}: {scheme}: takes IP addresses, got {host!r}") from None
            replicas.append(_join(host, port))
        if len(set(replicas)) != len(replicas):
            raise RecipeError(f"{where}: {address!r} lists a replica twice")
        return StageTarget(TargetKind.STATIC, tuple(replicas))
    if sep and scheme == "dns":
        if rest.startswith("//") and not rest.startswith("///"):
            raise RecipeError(f"{where}: {address!r}: a DNS authority is not supported; "
                              "write dns:///name:port")
        name, port = _host_port(rest.lstrip("/"), where)
        return StageTarget(TargetKind.DNS, dns_name=name, dns_port=port)
    host, port = _host_port(address, where)
    return StageTarget(TargetKind.STATIC, (_join(host, port),))


def split_host_port(replica: str) -> tuple[str, int]:
    """A replica address `host:port` (or `[v6]:port`) -> (host, port)."""
    return _host_port(replica, "replica")


class Task(enum.StrEnum):
    TEXT_TO_IMAGE = "text-to-image"
    TEXT_TO_SPEECH = "text-to-speech"
    CHAT = "chat"
    IMAGE_EDIT = "image-edit"
    TEXT_TO_VIDEO = "text-to-video"
    IMAGE_TO_VIDEO = "image-to-video"
    SPEECH_TO_TEXT = "speech-to-text"


#: Stages each task needs, in the order a request travels through them.
TASK_STAGES: dict[Task, tuple[str, ...]] = {
    Task.TEXT_TO_IMAGE: ("tokenizer", "dit", "vae"),
    Task.TEXT_TO_SPEECH: ("talker", "codec"),
    Task.CHAT: ("thinker",),
    Task.IMAGE_EDIT: ("tokenizer", "dit", "vae"),
    Task.TEXT_TO_VIDEO: ("tokenizer", "dit", "vae"),
    Task.IMAGE_TO_VIDEO: ("tokenizer", "dit", "vae"),
    Task.SPEECH_TO_TEXT: ("transcriber",),
}

#: Tasks whose requests take ImageDefaults (the rest of the Tokenizer/DiT/VAE tasks take
#: VideoDefaults).
IMAGE_TASKS = frozenset({Task.TEXT_TO_IMAGE, Task.IMAGE_EDIT})
VIDEO_TASKS = frozenset({Task.TEXT_TO_VIDEO, Task.IMAGE_TO_VIDEO})

#: Where each key of the old `limits:` block went (None: the stage reads it from its model).
MOVED_LIMITS: dict[str, str | None] = {
    "max_prompt_chars": "stages.tokenizer.options.max_prompt_chars",
    "max_steps": "stages.dit.options.max_steps",
    "max_n": "stages.dit.options.max_images_per_request",
    "max_pixels": "stages.dit.options.max_pixels",
    "size_multiple": None,
    "max_input_chars": "stages.talker.options.max_input_chars",
    "max_new_frames": "stages.talker.options.max_new_frames",
    "max_ref_audio_bytes": None,
}

_RECIPE_KEYS = frozenset({"name", "task", "model", "stages", "defaults", "speech", "listen"})
_ENDPOINT_KEYS = frozenset({"address", "metrics_port", "options"})


@dataclass(frozen=True)
class StageEndpoint:
    """One stage service of a recipe: one replica or several (see `target`)."""

    name: str  # "tokenizer", "dit", ...
    #: Its gRPC target: `host:port`, a replica list `ipv4:h:p1,h:p2`, or `dns:///name:port`.
    address: str
    #: Where its (first) replica serves /metrics over HTTP; replica i serves on
    #: `metrics_port + i` unless `replica_metrics_ports` lists each one's port.
    metrics_port: int | None = None
    #: The stage's options (operator policy, e.g. step_execution, max_steps): handed to the
    #: stage process by `stagemesh serve`; the stage validates them and publishes the result.
    options: dict[str, OptionValue] = field(default_factory=dict)
    replica_metrics_ports: tuple[int, ...] = ()  # one per replica, when given as a list

    @property
    def target(self) -> StageTarget:
        return parse_target(self.address, f"stage {self.name}")

    @property
    def replicas(self) -> tuple[str, ...]:
        """Each replica's `host:port` (empty for a DNS target: the gateway resolves it)."""
        return self.target.replicas

    @property
    def host(self) -> str:
        """The host of its first replica (a DNS target: the name)."""
        target = self.target
        return target.dns_name if target.kind is TargetKind.DNS else split_host_port(
            target.replicas[0])[0]

    @property
    def port(self) -> int:
        """The port of its first replica."""
        target = self.target
        return target.dns_port if target.kind is TargetKind.DNS else split_host_port(
            target.replicas[0])[1]

    def metrics_port_of(self, index: int) -> int | None:
        """Replica `index`'s metrics port (see `metrics_port`)."""
        if self.replica_metrics_ports:
            return self.replica_metrics_ports[index]
        return None if self.metrics_port is None else self.metrics_port + index

    def metrics_url_of(self, replica: str, index: int) -> str:
        port = self.metrics_port_of(index)
        return f"http://{split_host_port(replica)[0]}:{port}/metrics" if port else ""

    @property
    def metrics_url(self) -> str:
        """The first replica's /metrics ("" without a metrics port)."""
        return f"http://{self.host}:{self.metrics_port}/metrics" if self.metrics_port else ""


@dataclass(frozen=True)
class ImageDefaults:
    """What an image request (text-to-image, image-edit) gets for each field it leaves out.

    An image-edit recipe's width and height are 0 unless its file sets them: its output then
    takes the size the model derives from the input image (as the stock pipeline does)."""

    width: int = 64
    height: int = 64
    num_inference_steps: int = 10
    true_cfg_scale: float = 4.0
    negative_prompt: str | None = ""  # "" (not None) turns guidance on, as in diffusers


#: An image-edit recipe's base defaults: 0 x 0 = the size derived from the input image.
EDIT_DEFAULTS = ImageDefaults(width=0, height=0)


@dataclass(frozen=True)
class VideoDefaults:
    """What a video request (text-to-video, image-to-video) gets for each field it leaves out."""

    width: int = 64
    height: int = 64
    num_frames: int = 9  # the model's rule (Wan: 4k+1)
    fps: int = 8  # frames per second of the MP4 (and, with `seconds`, the frame count)
    num_inference_steps: int = 10
    guidance_scale: float = 5.0
    negative_prompt: str = ""  # Wan encodes "" when none is given, so "" is its default too
    flow_shift: float | None = None  # None = the model's scheduler's own shift


@dataclass(frozen=True)
class Recipe:
    name: str
    task: Task
    model: str  # model folder, or "builtin:<name>" for an embedded default
    stages: dict[str, StageEndpoint]
    #: text-to-image and image-edit recipes (see EDIT_DEFAULTS).
    image_defaults: ImageDefaults = ImageDefaults()
    #: text-to-video and image-to-video recipes.
    video_defaults: VideoDefaults = VideoDefaults()
    #: chat: the text-to-speech recipe that speaks its answers ("" = the default one).
    speech: str = ""
    #: chat: the speech-to-text recipe that hears `input_audio` parts ("" = the default one).
    listen: str = ""

    def stage(self, name: str) -> StageEndpoint:
        return self.stages[name]


def _moved_limits_message(where: str, limits: object) -> str:
    keys = list(limits) if isinstance(limits, Mapping) else []
    moves = [f"{key} -> {MOVED_LIMITS[key] or 'remove it (the stages publish it from the model)'}"
             for key in keys if key in MOVED_LIMITS]
    return (f"{where}: `limits:` is gone; each limit is now an option of the stage it limits"
            + (f" ({'; '.join(moves)})" if moves else ""))


def _check_keys(entry: Mapping[str, object], where: str) -> None:
    """Refuse keys this file format does not have, saying where the old ones moved."""
    if "limits" in entry:
        raise RecipeError(_moved_limits_message(where, entry["limits"]))
    if "default_voice" in entry:
        raise RecipeError(f"{where}: `default_voice:` moved to "
                          "stages.talker.options.default_voice")
    unknown = sorted(set(entry) - _RECIPE_KEYS)
    if unknown:
        raise RecipeError(f"{where}: unknown keys {unknown}; expected {sorted(_RECIPE_KEYS)}")


def _options(raw: object, where: str) -> dict[str, OptionValue]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{where}.options must be a mapping of option names to values")
    options: dict[str, OptionValue] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not isinstance(value, bool | int | float | str):
            raise RecipeError(f"{where}.options.{key}: expected a number, string or boolean, "
                              f"got {value!r}")
        options[key] = value
    return options


def _endpoint(stage: str, raw: object, where: str) -> StageEndpoint:
    where = f"{where}.stages.{stage}"
    if not isinstance(raw, Mapping) or "address" not in raw:
        raise RecipeError(f"{where}: expected a mapping with an `address`")
    unknown = sorted(set(raw) - _ENDPOINT_KEYS)
    if unknown:
        raise RecipeError(f"{where}: unknown keys {unknown}; expected {sorted(_ENDPOINT_KEYS)}")
    target = parse_target(str(raw["address"]), f"{where}.address")
    metrics_port, replica_ports = _metrics_ports(raw.get("metrics_port"), target, where)
    return StageEndpoint(name=stage, address=str(raw["address"]), metrics_port=metrics_port,
                         options=_options(raw.get("options"), where),
                         replica_metrics_ports=replica_ports)


def _is_port(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def _metrics_ports(raw: object, target: StageTarget, where: str
                   ) -> tuple[int | None, tuple[int, ...]]:
    """`metrics_port`: one port (replica i serves on port + i), or a list, one per replica."""
    if raw is None or _is_port(raw):
        return (raw if isinstance(raw, int) else None), ()
    if isinstance(raw, list) and raw and all(_is_port(port) for port in raw):
        if target.kind is TargetKind.STATIC and len(raw) != len(target.replicas):
            raise RecipeError(f"{where}.metrics_port lists {len(raw)} ports for "
                              f"{len(target.replicas)} replicas")
        return int(raw[0]), tuple(int(port) for port in raw)
    raise RecipeError(f"{where}.metrics_port must be a port number or a list of them (one per "
                      f"replica), got {raw!r}")


_Defaults = ImageDefaults | VideoDefaults


class _DefaultsReader:
    """Typed reads of a `defaults:` mapping: a missing key keeps the base's value."""

    def __init__(self, raw: Mapping[str, object], where: str, base: _Defaults) -> None:
        self.raw, self.where, self.base = raw, f"{where}.defaults", base

    def integer(self, name: str) -> int:
        value = self.raw.get(name, getattr(self.base, name))
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{self.where}.{name}: expected an integer, got {value!r}")
        return value

    def number(self, name: str) -> float:
        value = self.optional_number(name)
        if value is None:
            raise RecipeError(f"{self.where}.{name}: expected a number, got None")
        return value

    def optional_number(self, name: str) -> float | None:
        value = self.raw.get(name, getattr(self.base, name))
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise RecipeError(f"{self.where}.{name}: expected a number, got {value!r}")
        return None if value is None else float(value)

    def text(self, name: str) -> str | None:
        value = self.raw.get(name, getattr(self.base, name))
        if value is not None and not isinstance(value, str):
            raise RecipeError(f"{self.where}.{name}: expected a string or null, got {value!r}")
        return value


def _defaults_reader(raw: object, base: _Defaults, where: str) -> _DefaultsReader:
    """A reader of `defaults:`, refusing keys `base`'s type does not have."""
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{where}.defaults must be a mapping")
    known = sorted(f.name for f in fields(base))
    unknown = sorted(str(key) for key in set(raw) - set(known))
    if unknown:
        raise RecipeError(f"{where}.defaults: unknown keys {unknown}; expected {known}")
    return _DefaultsReader(raw, where, base)


def _image_defaults(raw: object, task: Task, where: str) -> ImageDefaults:
    base = EDIT_DEFAULTS if task is Task.IMAGE_EDIT else ImageDefaults()
    if raw is None or task not in IMAGE_TASKS:
        return base
    read = _defaults_reader(raw, base, where)
    defaults = ImageDefaults(width=read.integer("width"), height=read.integer("height"),
                             num_inference_steps=read.integer("num_inference_steps"),
                             true_cfg_scale=read.number("true_cfg_scale"),
                             negative_prompt=read.text("negative_prompt"))
    if task is Task.IMAGE_EDIT and (defaults.width == 0) != (defaults.height == 0):
        raise RecipeError(f"{where}.defaults: an image-edit recipe sets both width and height "
                          "or neither (neither: the size derived from the input image)")
    return defaults


def _video_defaults(raw: object, task: Task, where: str) -> VideoDefaults:
    if raw is None or task not in VIDEO_TASKS:
        return VideoDefaults()
    read = _defaults_reader(raw, VideoDefaults(), where)
    return VideoDefaults(width=read.integer("width"), height=read.integer("height"),
                         num_frames=read.integer("num_frames"), fps=read.integer("fps"),
                         num_inference_steps=read.integer("num_inference_steps"),
                         guidance_scale=read.number("guidance_scale"),
                         negative_prompt=read.text("negative_prompt") or "",
                         flow_shift=read.optional_number("flow_shift"))


def _check_defaults_task(raw: object, task: Task, where: str) -> None:
    if raw is not None and task not in IMAGE_TASKS | VIDEO_TASKS:
        raise RecipeError(f"{where}: `defaults:` are request defaults of image-edit, "
                          "text-to-video, image-to-video and text-to-image recipes")


def _build(entry: object, where: str) -> Recipe:
    if not isinstance(entry, Mapping):
        raise RecipeError(f"{where}: expected a mapping")
    try:
        name = str(entry["name"])
        task = Task(entry["task"])
        model = str(entry["model"])
        raw_stages = entry["stages"]
    except KeyError as missing:
        raise RecipeError(f"{where}: missing key {missing}") from None
    except ValueError:
        raise RecipeError(f"{where}: unknown task {entry.get('task')!r}; "
                          f"expected one of {[t.value for t in Task]}") from None
    where = f"{where} ({name!r})"
    _check_keys(entry, where)
    if not isinstance(raw_stages, Mapping):
        raise RecipeError(f"{where}.stages must be a mapping of stage names")
    needed = TASK_STAGES[task]
    absent = [s for s in needed if s not in raw_stages]
    if absent:
        raise RecipeError(f"recipe {name!r}: task {task.value} needs stages {absent}")
    extra = sorted(set(raw_stages) - set(needed))
    if extra:
        raise RecipeError(f"{where}: task {task.value} has no stages {extra}")
    stages = {stage: _endpoint(stage, raw_stages[stage], where) for stage in needed}
    _check_defaults_task(entry.get("defaults"), task, where)
    return Recipe(name=name, task=task, model=model, stages=stages,
                  image_defaults=_image_defaults(entry.get("defaults"), task, where),
                  video_defaults=_video_defaults(entry.get("defaults"), task, where),
                  speech=_chat_companion(entry.get("speech"), "speech", task, where),
                  listen=_chat_companion(entry.get("listen"), "listen", task, where))


#: A chat recipe's companion keys -> the task of the recipe each one names.
COMPANION_TASKS = {"speech": Task.TEXT_TO_SPEECH, "listen": Task.SPEECH_TO_TEXT}


def _chat_companion(raw: object, key: str, task: Task, where: str) -> str:
    """A chat recipe's `speech:` or `listen:`, the name of another recipe (checked once all
    are loaded, by `_check_companions`)."""
    if raw is None:
        return ""
    if task is not Task.CHAT or not isinstance(raw, str):
        raise RecipeError(f"{where}.{key}: a chat recipe's {key} recipe name, got {raw!r} "
                          f"(it names a {COMPANION_TASKS[key].value} recipe)")
    return raw


def _check_companions(recipes: Mapping[str, Recipe], path: Path | str) -> None:
    for recipe in recipes.values():
        for key, task in COMPANION_TASKS.items():
            name: str = getattr(recipe, key)
            named = recipes.get(name) if name else None
            if name and (named is None or named.task is not task):
                raise RecipeError(f"{path}: recipe {recipe.name!r}: {key} {name!r} is not "
                                  f"a {task.value} recipe of this file")


def load_recipes(path: Path | str = DEFAULT_RECIPES) -> dict[str, Recipe]:
    """Load and validate a recipe file; names must be unique."""
    document = yaml.safe_load(Path(path).read_text())
    entries = document.get("recipes") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise RecipeError(f"{path}: expected a non-empty `recipes:` list")
    recipes: dict[str, Recipe] = {}
    for index, entry in enumerate(entries):
        recipe = _build(entry, f"{path}: recipes[{index}]")
        if recipe.name in recipes:
            raise RecipeError(f"{path}: recipe name {recipe.name!r} appears twice")
        recipes[recipe.name] = recipe
    _check_companions(recipes, path)
    return recipes


def default_recipe(recipes: Mapping[str, Recipe], task: Task) -> Recipe | None:
    """The first recipe of a task: what an empty `model` field selects."""
    return next((r for r in recipes.values() if r.task is task), None)

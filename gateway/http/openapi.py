"""The gateway's OpenAPI 3.1 document, served at GET /openapi.json.

Two sources, each written once:
- the native routes: walked from GatewayService's google.api.http annotations
  (`transcoding.http_bindings`, the same walk that builds the routes), their bodies, path and
  query parameters typed from the proto fields (proto3 JSON mapping, proto field names);
- the OpenAI-compatible routes: their JSON is OpenAI's, not the proto's, so their schemas are
  written out here (`OPENAI_PATHS`).

Every error answers the one error body of gateway/errors.py (`param` names the bad field). The
document is what the fuzz suite (tests/integration/test_fuzz_gateway.py) generates requests
from, and what a client generator or an API gateway in front of stagemesh can read.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from starlette.requests import Request
from starlette.responses import JSONResponse

from stagemesh.gateway.chat.protocol import ROLES
from stagemesh.gateway.grpc.transcoding import SERVICE, HttpBinding, http_bindings
from stagemesh.gateway.images.edit_forms import EDIT_FIELDS
from stagemesh.gateway.loras.protocol import LOAD_FIELDS, UNLOAD_FIELDS
from stagemesh.gateway.transcriptions.protocol import TRANSCRIPTION_FIELDS, ResponseFormat
from stagemesh.gateway.wire.auth import LOAD_LORA_PATH, UNLOAD_LORA_PATH

Schema = dict[str, object]

VERSION = "v1"
_REF = "#/components/schemas/"
ERROR_SCHEMA: Schema = {"$ref": f"{_REF}Error"}
_INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
_UINT32 = {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}
_INT64 = {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
_UINT64 = {"type": "integer", "minimum": 0, "maximum": 2**64 - 1}
#: proto3 JSON mapping of each scalar field type.
_SCALARS: dict[int, Schema] = {
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "contentEncoding": "base64"},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_FLOAT: {"type": "number"},
    FieldDescriptor.TYPE_DOUBLE: {"type": "number"},
    **{kind: _INT32 for kind in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32,
                                 FieldDescriptor.TYPE_SFIXED32)},
    **{kind: _UINT32 for kind in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32)},
    **{kind: _INT64 for kind in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64,
                                 FieldDescriptor.TYPE_SFIXED64)},
    **{kind: _UINT64 for kind in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64)},
}

#: A request that works on the smallest mesh, per RPC and OpenAI route (documentation, and the
#: first request the fuzz suite sends to each).
NATIVE_EXAMPLES: dict[str, Schema] = {
    "GenerateImage": {"prompt": "a red circle", "width": 32, "height": 32,
                      "num_inference_steps": 2},
    "SynthesizeSpeech": {"input": "Hello.", "seed": 1},
    "Chat": {"messages": [{"role": "user", "content": "Hello."}]},
    "CreateVideo": {"prompt": "a red circle moving right", "width": 32, "height": 32,
                    "num_frames": 5, "num_inference_steps": 2},
}
OPENAI_EXAMPLES: dict[str, Schema] = {
    "openai.images": {"prompt": "a red circle", "size": "32x32", "num_inference_steps": 2},
    "openai.speech": {"input": "Hello.", "seed": 1},
    "openai.chat": {"messages": [{"role": "user", "content": "a red circle"}],
                    "size": "32x32"},
    "openai.videos.create": {"prompt": "a red circle moving right", "size": "32x32",
                             "num_frames": 5, "num_inference_steps": 2},
    "openai.videos.sync": {"prompt": "a red circle moving right", "size": "32x32",
                           "num_frames": 5, "num_inference_steps": 2},
}

# -- proto messages -> JSON schemas -----------------------------------------------------------


def _field_schema(field: FieldDescriptor) -> Schema:
    """One field's value: a scalar, an enum (its value names), or a reference to a message."""
    if field.message_type is not None:
        if field.message_type.GetOptions().map_entry:
            value = field.message_type.fields_by_name["value"]
            return {"type": "object", "additionalProperties": _field_schema(value)}
        item: Schema = {"$ref": _REF + field.message_type.full_name}
    elif field.enum_type is not None:
        item = {"type": "string", "enum": [value.name for value in field.enum_type.values]}
    else:
        item = dict(_SCALARS[field.type])
    if field.is_repeated:
        return {"type": "array", "items": item}
    return item


def message_schema(message: Descriptor) -> Schema:
    """A message as a JSON object: proto field names, no other properties (the native routes
    parse strictly: an unknown field is a 400 naming it)."""
    return {"type": "object", "additionalProperties": False,
            "properties": {field.name: _field_schema(field) for field in message.fields}}


def _messages(roots: Iterable[Descriptor]) -> dict[str, Descriptor]:
    """Every message reachable from `roots`, by full name (maps' entries are inlined)."""
    found: dict[str, Descriptor] = {}
    pending = list(roots)
    while pending:
        message = pending.pop()
        if message.full_name in found:
            continue
        found[message.full_name] = message
        for field in message.fields:
            nested = field.message_type
            if nested is not None and nested.GetOptions().map_entry:
                nested = nested.fields_by_name["value"].message_type
            if nested is not None:
                pending.append(nested)
    return found


def _responses(ok: Schema, media_type: str = "application/json") -> Schema:
    """200 with `ok`, and the one error body for every 4xx/5xx."""
    error = {"description": "error", "content": {"application/json": {"schema": ERROR_SCHEMA}}}
    return {"200": {"description": "OK", "content": {media_type: {"schema": ok}}},
            "4XX": error, "5XX": error}


def _native_operation(binding: HttpBinding) -> Schema:
    method = SERVICE.methods_by_name[binding.rpc]
    request, reply = method.input_type, method.output_type
    path_fields = [field for field in request.fields if f"{{{field.name}}}" in binding.path]
    operation: Schema = {"operationId": f"native.{binding.rpc}", "tags": ["native"]}
    parameters: list[Schema] = [
        {"name": field.name, "in": "path", "required": True, "schema": _field_schema(field)}
        for field in path_fields]
    if binding.body == "*":
        body: Schema = {"schema": {"$ref": _REF + request.full_name}}
        if binding.rpc in NATIVE_EXAMPLES:
            body["example"] = NATIVE_EXAMPLES[binding.rpc]
        operation["requestBody"] = {"required": False, "content": {"application/json": body}}
    else:
        parameters += [{"name": field.name, "in": "query", "required": False,
                        "schema": _field_schema(field)}
                       for field in request.fields
                       if field not in path_fields and field.message_type is None
                       and not field.is_repeated]
    if parameters:
        operation["parameters"] = parameters
    streaming = method.server_streaming  # NDJSON: one reply message a line
    operation["responses"] = _responses({"$ref": _REF + reply.full_name},
                                        "application/x-ndjson" if streaming else
                                        "application/json")
    return operation


# -- the OpenAI-compatible routes (OpenAI's JSON, written once here) -------------------------

_STRING: Schema = {"type": "string"}
_INTEGER: Schema = {"type": "integer"}
_NUMBER: Schema = {"type": "number"}
_BOOLEAN: Schema = {"type": "boolean"}
#: A field the gateway adds to every OpenAI body: the request's deadline (seconds).
_TIMEOUT: Schema = {"timeout": _NUMBER}


def _body(operation_id: str, properties: Schema, required: list[str]) -> Schema:
    """An OpenAI request body; extra fields are allowed (SDKs send more), the gateway refuses
    those it cannot honour with a 400 naming them. tests/unit/test_openapi.py checks that the
    properties are exactly the fields the route's parsers read."""
    return {"required": True, "content": {"application/json": {
        "schema": {"type": "object", "properties": {**properties, **_TIMEOUT},
                   "required": required},
        "example": OPENAI_EXAMPLES[operation_id]}}}


#: `lora`: the DiT's adapters (GET the DiT's Describe lora_names) and their scales (default 1).
_LORA: Schema = {"type": "array", "items": {
    "type": "object", "required": ["name"],
    "properties": {"name": _STRING, "scale": _NUMBER}}}
#: In a multipart form, `lora` is that array as one JSON text field.
_LORA_TEXT: Schema = {"type": "string",
                      "description": 'a JSON array: [{"name": ..., "scale": ...}]'}
_PREVIEW: Schema = {"type": "object", "properties": {"every": _INTEGER, "size": _INTEGER}}
_IMAGE_FIELDS: Schema = {
    "prompt": _STRING, "model": _STRING, "negative_prompt": _STRING, "n": _INTEGER,
    "size": _STRING, "width": _INTEGER, "height": _INTEGER, "num_inference_steps": _INTEGER,
    "true_cfg_scale": _NUMBER, "guidance_scale": _NUMBER, "seed": _INTEGER,
    "execution_mode": {"type": "string", "enum": ["step", "request"]},
    "response_format": {"type": "string", "enum": ["b64_json"]}, "stream": _BOOLEAN,
    "priority": _INTEGER,
    "step_cache_threshold": {"type": "number", "minimum": 0, "description":
                             "the DiT's step cache for this request: 0 = off; unset = the "
                             "stage's setting; at most what the stage publishes"},
    "preview": {**_PREVIEW, "description": "step previews on SSE progress events (`preview`: "
                "a PNG data URL) every `every` steps, `size` px on the long side"},
    "lora": _LORA,
}
_SPEECH_FIELDS: Schema = {
    "input": _STRING, "model": _STRING, "voice": _STRING,
    "response_format": {"type": "string", "enum": ["wav", "pcm", "flac"]}, "speed": _NUMBER,
    "stream": _BOOLEAN, "stream_format": {"type": "string", "enum": ["audio"]},
    "task_type": _STRING, "language": _STRING, "instructions": _STRING,
    "ref_audio": {"type": "string", "description": "a data URL or base64 of a WAV file"},
    "ref_text": _STRING, "seed": _INTEGER, "max_new_tokens": _INTEGER,
    "temperature": _NUMBER, "top_p": _NUMBER, "top_k": _INTEGER,
}
#: A chat message: the roles chat/protocol.py takes; content parts of text, and `image_url`
#: (a data URL: the image to edit, with an image-edit model).
_CHAT_MESSAGE: Schema = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"type": "string", "enum": list(ROLES)},
    "content": {"oneOf": [_STRING, {"type": "array", "items": {"type": "object", "properties": {
        "type": {"type": "string", "enum": ["text", "image_url"]}, "text": _STRING,
        "image_url": {"type": "object", "properties": {"url": {
            "type": "string", "description": "a data URL (data:image/png;base64,...)"}}}}}}]}}}
_CHAT_FIELDS: Schema = {
    "model": _STRING, "messages": {"type": "array", "items": _CHAT_MESSAGE},
    "stream": _BOOLEAN, "stream_options": {"type": "object", "properties": {
        "include_usage": _BOOLEAN}},
    "modalities": {"type": "array", "items": {"type": "string", "enum": ["text", "audio"]}},
    "audio": {"type": "object", "properties": {"voice": _STRING, "format": _STRING}},
    "max_tokens": _INTEGER, "max_completion_tokens": _INTEGER, "temperature": _NUMBER,
    "top_p": _NUMBER, "seed": _INTEGER, "n": _INTEGER, "priority": _INTEGER,
    # with an image model: the image's fields (the prompt is the last user message's text)
    **{name: schema for name, schema in _IMAGE_FIELDS.items()
       if name not in ("prompt", "stream", "response_format")},
}
_OBJECT: Schema = {"type": "object"}
#: POST /v1/videos and /v1/videos/sync: a multipart form (what the openai SDK sends; form
#: values are text, so numbers may come as strings) or the same fields as a JSON object.
_VIDEO_FIELDS: Schema = {
    "prompt": _STRING, "model": _STRING, "negative_prompt": _STRING,
    "size": {"type": "string", "description": "WxH, e.g. 832x480"},
    "seconds": {"type": ["string", "number"]}, "fps": _INTEGER,
    "num_frames": {"type": "integer", "description": "the model's rule: 4k+1 for Wan"},
    "num_inference_steps": _INTEGER, "guidance_scale": _NUMBER,
    "guidance_scale_2": _NUMBER, "boundary_ratio": _NUMBER, "flow_shift": _NUMBER,
    "seed": _INTEGER, "step_cache_threshold": _IMAGE_FIELDS["step_cache_threshold"],
    "lora": {"oneOf": [_LORA, _LORA_TEXT]},
    "image_reference": {"type": "object", "properties": {"image_url": {
        "type": "string", "description": "a data URL (data:image/png;base64,...)"}}},
    "preview": {**_PREVIEW, "description": "step previews of the middle frame "
                "on GET /v1/videoJobs/{id}:watch every `every` steps, `size` px on the long "
                "side (a form: preview_every, preview_size)"},
    "preview_every": _INTEGER, "preview_size": _INTEGER,
}
_VIDEO_FILE: Schema = {"input_reference": {"type": "string", "contentEncoding": "binary",
                                           "description": "the first frame (PNG, JPEG, WebP)"}}
_MP4: Schema = {"type": "string", "contentEncoding": "binary"}
_IMAGE_FILE: Schema = {"type": "string", "contentEncoding": "binary",
                       "description": "a PNG, JPEG or WebP image"}
#: POST /v1/images/edits: OpenAI's multipart form; its fields are edit_forms.EDIT_FIELDS (a
#: field not typed here is text). Form values are text: numbers come as their digits.
_EDIT_TYPES: Schema = {
    "image": {"type": "array", "items": _IMAGE_FILE,
              "description": "the image(s) to edit (also sent as image[])"},
    "mask": {**_IMAGE_FILE, "description": "not supported (a 400 naming mask)"},
    **dict.fromkeys(("n", "width", "height", "num_inference_steps", "seed", "priority",
                     "preview_every", "preview_size"), _INTEGER),
    **dict.fromkeys(("true_cfg_scale", "guidance_scale", "timeout", "step_cache_threshold"),
                    _NUMBER),
    "size": {"type": "string", "description": "WxH, or auto (the recipe's or the input's)"},
    "stream": _BOOLEAN, "execution_mode": _IMAGE_FIELDS["execution_mode"],
    "response_format": _IMAGE_FIELDS["response_format"],
    "output_format": {"type": "string", "enum": ["png"]}, "lora": _LORA_TEXT,
}
_JOB_ID: list[Schema] = [{"name": "id", "in": "path", "required": True, "schema": _STRING}]
_LIST_QUERY: list[Schema] = [
    {"name": "limit", "in": "query", "required": False,
     "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
    {"name": "after", "in": "query", "required": False, "schema": _STRING},
    {"name": "order", "in": "query", "required": False,
     "schema": {"type": "string", "enum": ["asc", "desc"]}}]


def _video_body(operation_id: str) -> Schema:
    schema: Schema = {"type": "object", "properties": _VIDEO_FIELDS, "required": ["prompt"]}
    form: Schema = {"type": "object", "properties": {**_VIDEO_FIELDS, **_VIDEO_FILE},
                    "required": ["prompt"]}
    return {"required": True, "content": {
        "multipart/form-data": {"schema": form},
        "application/json": {"schema": schema, "example": OPENAI_EXAMPLES[operation_id]}}}


def _edit_path() -> Schema:
    """POST /v1/images/edits: answers as POST /v1/images/generations."""
    form: Schema = {"type": "object", "required": ["image", "prompt"], "properties": {
        name: _EDIT_TYPES.get(name, _STRING) for name in sorted(EDIT_FIELDS)}}
    return {"post": {"operationId": "openai.images.edits", "tags": ["openai"],
                     "requestBody": {"required": True,
                                     "content": {"multipart/form-data": {"schema": form}}},
                     "responses": _responses(_OBJECT)}}


#: POST /v1/audio/transcriptions: OpenAI's multipart form (transcriptions/protocol.py).
_TRANSCRIPTION_TYPES: Schema = {
    "file": {"type": "string", "contentEncoding": "binary",
             "description": "a WAV, MP3, FLAC or OGG file"},
    "response_format": {"type": "string", "enum": [f.value for f in ResponseFormat]},
    "stream": _BOOLEAN, **dict.fromkeys(("temperature", "timeout"), _NUMBER),
    **{name: {"type": "string", "enum": ["segment"], "description": "word: a 400"}
       for name in ("timestamp_granularities", "timestamp_granularities[]")},
}


def _transcription_path() -> Schema:
    form: Schema = {"type": "object", "required": ["file"], "properties": {
        name: _TRANSCRIPTION_TYPES.get(name, _STRING) for name in sorted(TRANSCRIPTION_FIELDS)}}
    return {"post": {"operationId": "openai.audio.transcriptions", "tags": ["openai"],
                     "requestBody": {"required": True,
                                     "content": {"multipart/form-data": {"schema": form}}},
                     "responses": _responses(_OBJECT)}}


def _video_paths() -> dict[str, Schema]:
    """OpenAI's video jobs and the seed's sync route."""
    def operation(operation_id: str, ok: Schema, media_type: str = "application/json",
                  parameters: list[Schema] | None = None) -> Schema:
        found: Schema = {"operationId": operation_id, "tags": ["openai"],
                         "responses": _responses(ok, media_type)}
        if parameters:
            found["parameters"] = parameters
        if operation_id in OPENAI_EXAMPLES:
            found["requestBody"] = _video_body(operation_id)
        return found

    return {
        "/v1/videos": {"post": operation("openai.videos.create", _OBJECT),
                       "get": operation("openai.videos.list", _OBJECT, parameters=_LIST_QUERY)},
        "/v1/videos/sync": {"post": operation("openai.videos.sync", _MP4, "video/mp4")},
        "/v1/videos/{id}": {"get": operation("openai.videos.get", _OBJECT, parameters=_JOB_ID),
                            "delete": operation("openai.videos.delete", _OBJECT,
                                                parameters=_JOB_ID)},
        "/v1/videos/{id}/content": {"get": operation(
            "openai.videos.content", _MP4, "video/mp4", parameters=[*_JOB_ID, {
                "name": "variant", "in": "query", "required": False,
                "schema": {"type": "string", "enum": ["video"]}}])},
    }


#: The LoRA admin routes (vLLM's bodies, plus the recipe): admin keys only (403 otherwise).
_LORA_ADMIN_TYPES: Schema = {
    "lora_name": {"type": "string", "description": "the name requests use in `lora`"},
    "lora_path": {"type": "string", "description": "an adapter directory or .safetensors file "
                  "inside the DiT's lora_dir (relative paths are read from it)"},
    "model": {"type": "string", "description": "the recipe whose DiT changes; unset: every "
              "DiT that loads adapters at run time"},
}


def _lora_paths() -> dict[str, Schema]:
    def admin(operation_id: str, fields: frozenset[str], example: Schema) -> Schema:
        schema: Schema = {"type": "object", "additionalProperties": False,
                          "properties": {name: _LORA_ADMIN_TYPES[name] for name in sorted(fields)},
                          "required": sorted(fields - {"model"})}
        return {"post": {"operationId": operation_id, "tags": ["admin"],
                         "requestBody": {"required": True, "content": {"application/json": {
                             "schema": schema, "example": example}}},
                         "responses": _responses(_OBJECT)}}

    return {
        LOAD_LORA_PATH: admin("admin.load_lora_adapter", LOAD_FIELDS,
                              {"lora_name": "ink", "lora_path": "ink"}),
        UNLOAD_LORA_PATH: admin("admin.unload_lora_adapter", UNLOAD_FIELDS,
                                {"lora_name": "ink"}),
        "/v1/loras": {"get": {"operationId": "loras", "tags": ["admin"],
                              "responses": _responses(_OBJECT)}},
    }


def _openai_paths() -> dict[str, Schema]:
    def post(operation_id: str, fields: Schema, required: str, ok: Schema,
             media_type: str = "application/json") -> Schema:
        return {"post": {"operationId": operation_id, "tags": ["openai"],
                         "requestBody": _body(operation_id, fields, [required]),
                         "responses": _responses(ok, media_type)}}

    def get(operation_id: str) -> Schema:
        return {"get": {"operationId": operation_id, "tags": ["openai"],
                        "responses": _responses(_OBJECT)}}

    return {
        "/v1/images/generations": post("openai.images", _IMAGE_FIELDS, "prompt", _OBJECT),
        "/v1/images/edits": _edit_path(),
        "/v1/chat/completions": post("openai.chat", _CHAT_FIELDS, "messages", _OBJECT),
        "/v1/audio/speech": post("openai.speech", _SPEECH_FIELDS, "input",
                                 {"type": "string", "contentEncoding": "binary"}, "audio/wav"),
        "/v1/audio/voices": get("openai.voices"),
        "/v1/audio/transcriptions": _transcription_path(),
        "/v1/models": get("openai.models"),
        "/health": get("health"),
        **_video_paths(),
        **_lora_paths(),
    }


_ERROR: Schema = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": _STRING, "type": _STRING, "code": _STRING,
        "param": {"type": ["string", "null"], "description": "the request field at fault"}}}}}


@functools.cache
def openapi_document() -> Schema:
    """The whole document (built once: it depends only on the protos and this module)."""
    bindings = http_bindings()
    paths: dict[str, Schema] = _openai_paths()
    for binding in bindings:
        paths.setdefault(binding.path, {})[binding.verb.lower()] = _native_operation(binding)
    roots = [SERVICE.methods_by_name[b.rpc].input_type for b in bindings]
    roots += [SERVICE.methods_by_name[b.rpc].output_type for b in bindings]
    schemas: dict[str, Schema] = {name: message_schema(message)
                                  for name, message in sorted(_messages(roots).items())}
    schemas["Error"] = _ERROR
    return {"openapi": "3.1.0",
            "info": {"title": "stagemesh gateway", "version": VERSION,
                     "description": "OpenAI-compatible routes and the native routes of "
                                    "stagemesh.v1.GatewayService (google.api.http)."},
            "paths": paths, "components": {"schemas": schemas}}


async def openapi_endpoint(request: Request) -> JSONResponse:
    """GET /openapi.json."""
    return JSONResponse(openapi_document())

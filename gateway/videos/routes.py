"""OpenAI's video API: jobs (`/v1/videos`: create, list, get, content, delete) and the seed's
blocking `POST /v1/videos/sync`.

Create and sync take a multipart form (what the openai SDK's `videos.create` sends; an
urlencoded form or a JSON object is taken too: protocol.py reads each). A job's JSON is
OpenAI's video object (`object: "video"`, `status` queued / in_progress / completed / failed;
a job stopped by a cancel by id is `failed` with error code `cancelled`), with stagemesh's
extra facts (`num_frames`, `fps`, `seed`). Every error is the usual JSON body naming its field.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.videos.jobs import new_video_id, page, video_jobs
from stagemesh.gateway.videos.pipeline import prepare_video, video_bytes
from stagemesh.gateway.videos.protocol import (
    LARGE_FIELDS,
    VIDEO_BODY_BYTES,
    form_from_json,
    video_request,
)
from stagemesh.gateway.videos.store import JobRecord, JobStatus
from stagemesh.gateway.wire.forms import Form, parse_integer, read_form
from stagemesh.gateway.wire.requests import (
    REQUEST_ID_HEADER,
    owner,
    read_json_object,
    rest_context,
    until_disconnect,
)

#: The id of a sync video whose client gave none starts with this (as the seed's).
SYNC_ID_PREFIX = "video_sync-"
MODEL_HEADER = "x-model"
INFERENCE_TIME_HEADER = "x-inference-time-s"
MP4 = "video/mp4"
POLL_AFTER_HEADER = "openai-poll-after-ms"
#: How soon a client should poll a live job again (a tiny video takes about a second).
POLL_AFTER_MS = 500
LIST_QUERY = {"limit", "after", "order"}


def parse_int(name: str, text: str | None) -> int | None:
    """A query value as an integer (None when absent or blank); else a 400."""
    return None if text is None or not text.strip() else parse_integer(name, text)


async def read_video_form(request: Request) -> Form:
    """The create/sync body: a multipart or urlencoded form, or a JSON object."""
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type == "application/json":
        return form_from_json(await read_json_object(request, VIDEO_BODY_BYTES))
    return await read_form(request, large_fields=LARGE_FIELDS, max_files=1, urlencoded=True)


def openai_status(status: JobStatus) -> str:
    """OpenAI's four statuses: a cancelled job is `failed` (its error's code is `cancelled`);
    the SDK's poll loop knows no other end."""
    return JobStatus.FAILED.value if status is JobStatus.CANCELLED else status.value


def video_object(record: JobRecord, max_age_s: float) -> dict[str, object]:
    """OpenAI's video object for a job, with stagemesh's extra facts."""
    completed = int(record.completed_at) if record.completed_at else None
    return {
        "id": record.id, "object": "video", "model": record.model,
        "status": openai_status(record.status), "progress": round(record.progress * 100),
        "created_at": int(record.created_at), "completed_at": completed,
        "expires_at": completed + int(max_age_s) if completed else None,
        "seconds": f"{record.seconds:g}", "size": f"{record.width}x{record.height}",
        "prompt": record.prompt, "remixed_from_video_id": None,
        "error": ({"code": record.error_code or "error", "message": record.error}
                  if record.error else None),
        "num_frames": record.num_frames, "fps": record.fps, "seed": record.seed,
    }


def _client_id(request: Request) -> str:
    """The client's own x-request-id ("" when it sent none; RequestIdMiddleware checked it)."""
    return request.headers.get(REQUEST_ID_HEADER, "")


class VideoRoutes:
    """The video routes, bound to the gateway core."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core
        self.videos = video_jobs(core)

    def _json(self, record: JobRecord) -> JSONResponse:
        """The video object; a live job also says when to poll again (the openai SDK's poll
        helper reads `openai-poll-after-ms`)."""
        headers = {POLL_AFTER_HEADER: str(POLL_AFTER_MS)} if record.status.live else {}
        return JSONResponse(video_object(record, self.videos.store.limits.max_age_s),
                            headers=headers)

    async def create(self, request: Request) -> Response:
        """The job, queued (200, OpenAI's video object); its id is the client's x-request-id
        when it sent one, else `video_<hex>`."""
        spec = await prepare_video(self.core, video_request(await read_video_form(request)))
        job_id = _client_id(request) or new_video_id()
        record = await self.videos.create(spec, job_id, owner(request))
        request.scope["state"]["request_id"] = job_id
        return self._json(record)

    async def sync(self, request: Request) -> Response:
        """Blocks until the MP4 is made; nothing is stored. x-request-id (`video_sync-...`
        unless the client chose one), x-model and x-inference-time-s say what ran."""
        started = time.monotonic()
        spec = await prepare_video(self.core, video_request(await read_video_form(request)))
        request_id = _client_id(request) or f"{SYNC_ID_PREFIX}{uuid.uuid4().hex}"
        request.scope["state"]["request_id"] = request_id
        timed = rest_context(request)
        context = RequestContext(request_id, timed.timeout, timed.owner)
        video = await until_disconnect(request, video_bytes(self.core, spec, context))
        return Response(video, media_type=MP4, headers={
            MODEL_HEADER: spec.recipe.name,
            INFERENCE_TIME_HEADER: f"{time.monotonic() - started:.3f}"})

    async def list(self, request: Request) -> Response:
        """`limit` (1-100, default 20), `after` (a job id), `order` (desc = newest first,
        the default; or asc)."""
        query = request.query_params
        for name in query:
            if name not in LIST_QUERY:
                raise InvalidRequest(name, f"unknown query parameter {name!r}")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequest("order", f"order must be 'asc' or 'desc', got {order!r}")
        limit = parse_int("limit", query.get("limit"))
        records = await self.videos.owned(owner(request))
        if order == "asc":
            records.reverse()
        jobs, more = page(records, limit, query.get("after", ""), "limit", "after")
        max_age = self.videos.store.limits.max_age_s
        return JSONResponse({"object": "list", "data": [video_object(r, max_age) for r in jobs],
                             "first_id": jobs[0].id if jobs else None,
                             "last_id": jobs[-1].id if jobs else None, "has_more": more})

    async def get(self, request: Request) -> Response:
        return self._json(await self.videos.get(owner(request), request.path_params["id"]))

    async def delete(self, request: Request) -> Response:
        """OpenAI's deletion object; a running job stops at its next step first."""
        job_id = request.path_params["id"]
        await self.videos.delete(owner(request), job_id)
        return JSONResponse({"id": job_id, "object": "video.deleted", "deleted": True})

    async def content(self, request: Request) -> Response:
        """The MP4 of a completed job (`variant=video`, the only one), streamed from the
        store; 400 while the job is not completed."""
        job_id = request.path_params["id"]
        variant = request.query_params.get("variant", "video")
        if variant != "video":
            raise InvalidRequest("variant", f"only variant 'video' is available, got {variant!r}")
        record = await self.videos.content(owner(request), job_id)
        chunks = self.videos.chunks(owner(request), job_id)
        first = await anext(chunks, b"")
        return StreamingResponse(_rest(first, chunks), media_type=MP4, headers={
            "content-length": str(record.size_bytes),
            "content-disposition": f'attachment; filename="{job_id}.mp4"'})


async def _rest(first: bytes, chunks: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    try:
        yield first
        async for chunk in chunks:
            yield chunk
    finally:
        await chunks.aclose()

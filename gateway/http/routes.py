"""Every REST route of the gateway, in one list."""

from __future__ import annotations

from starlette.routing import Route

from stagemesh.gateway.chat.routes import ChatRoutes
from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.grpc.native import NativeApi
from stagemesh.gateway.grpc.transcoding import annotated_routes
from stagemesh.gateway.http.metrics import metrics_endpoint
from stagemesh.gateway.http.models import ModelRoutes
from stagemesh.gateway.http.openapi import openapi_endpoint
from stagemesh.gateway.images.routes import ImageRoutes
from stagemesh.gateway.loras.routes import LoraRoutes
from stagemesh.gateway.playground.routes import playground_routes
from stagemesh.gateway.speech.routes import AudioRoutes
from stagemesh.gateway.transcriptions.routes import TranscriptionRoutes
from stagemesh.gateway.videos.routes import VideoRoutes
from stagemesh.gateway.wire.auth import LOAD_LORA_PATH, UNLOAD_LORA_PATH


def rest_routes(core: GatewayCore) -> list[Route]:
    """OpenAI routes (written out: their JSON is OpenAI's), the native routes (derived from
    GatewayService's google.api.http annotations), the gateway's own metrics and the OpenAPI
    document of all of them (gateway/openapi.py)."""
    images, chat = ImageRoutes(core), ChatRoutes(core)
    audio, models = AudioRoutes(core), ModelRoutes(core)
    videos, listening = VideoRoutes(core), TranscriptionRoutes(core)
    loras = LoraRoutes(core)
    return [
        Route("/v1/images/generations", images.generations, methods=["POST"]),
        Route("/v1/images/edits", images.edits, methods=["POST"]),
        Route("/v1/chat/completions", chat.completions, methods=["POST"]),
        Route("/v1/audio/speech", audio.speech, methods=["POST"]),
        Route("/v1/audio/voices", audio.voices, methods=["GET"]),
        Route("/v1/audio/transcriptions", listening.transcriptions, methods=["POST"]),
        Route("/v1/videos", videos.create, methods=["POST"]),
        Route("/v1/videos", videos.list, methods=["GET"]),
        Route("/v1/videos/sync", videos.sync, methods=["POST"]),
        Route("/v1/videos/{id}", videos.get, methods=["GET"]),
        Route("/v1/videos/{id}", videos.delete, methods=["DELETE"]),
        Route("/v1/videos/{id}/content", videos.content, methods=["GET"]),
        Route("/v1/models", models.models, methods=["GET"]),
        Route("/v1/loras", loras.list, methods=["GET"]),
        Route(LOAD_LORA_PATH, loras.load, methods=["POST"]),  # admin keys only
        Route(UNLOAD_LORA_PATH, loras.unload, methods=["POST"]),
        Route("/health", models.health, methods=["GET"]),
        *annotated_routes(NativeApi(core)),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/openapi.json", openapi_endpoint, methods=["GET"]),
        *playground_routes(),  # the page at / and /playground (gateway/playground/)
    ]

# One image for every stagemesh component: `stagemesh stage <name> ...` for a stage,
# `stagemesh gateway ...` for the gateway (see k8s/). CPU build.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HOME=/tmp/huggingface \
    STAGEMESH_CACHE=/tmp/stagemesh-cache

# torch first, from PyTorch's CPU wheel index: the default index would pull the multi-GB CUDA
# build. The pin must match pyproject.toml.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0

WORKDIR /src
COPY . .
# The repository root is the `stagemesh` package (setup.py lists every package folder); the
# shipped tiny-shapes weights (assets/) are package data, installed next to the code where
# stagemesh.models.registry looks for them. Bench charts and training progress bars
# (`stagemesh[bench,train]`) are not needed to serve; built-in models are built into
# $STAGEMESH_CACHE. The GPL extras are installed as `make serve` installs them: `voice-gpl`
# (piper-tts: espeak-ng, GPL-3.0-or-later), the default voice's phonemizer, and `video-gpl`
# (PyAV: FFmpeg linked with libx264), the MP4 encoder. `--build-arg EXTRAS=` builds an image
# without them (the Piper talker then refuses to start, the video routes answer 503; both say why).
ARG EXTRAS=voice-gpl,video-gpl
RUN pip install ".${EXTRAS:+[$EXTRAS]}" && cd / && rm -rf /src

RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin stagemesh
USER 10001:10001
WORKDIR /tmp

# 50051 gateway gRPC, 8000 gateway HTTP, 50061 stage gRPC, 9100 stage metrics (k8s/ defaults).
EXPOSE 8000 50051 50061 9100
ENTRYPOINT ["stagemesh"]
CMD ["--help"]

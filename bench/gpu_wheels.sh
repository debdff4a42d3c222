#!/usr/bin/env bash
# Prepare bench/wheels/ for bench/gpu_check.sh on a GPU machine without network.
# Run on a machine WITH network (PyPI), then copy bench/wheels/ to the GPU box
# next to the repository (it is gitignored; it is large: vllm + its CUDA deps,
# several GB, torch included when the GPU box's torch does not match vllm's pin).
#
#   PYV=3.11 bash bench/gpu_wheels.sh
#
# PYV is the GPU machine's Python minor version (its `python3 -V`). The wheels
# are for manylinux x86_64. The SmolLM2 tokenizer files are copied to
# bench/wheels/tokenizer/ (the dummy-weight model uses them).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
PYV="${PYV:-3.11}"
PY="${PYTHON:-python3}"
mkdir -p "$HERE/wheels/tokenizer"
# the project's runtime deps + its `gpu` extra (pyproject.toml is the source of truth)
"$PY" - "$ROOT/pyproject.toml" > "$HERE/wheels/requirements.txt" <<'PYEOF'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
for d in p["dependencies"] + p["optional-dependencies"]["gpu"]:
    print(d)
PYEOF
echo "requirements:"; sed 's/^/  /' "$HERE/wheels/requirements.txt"
"$PY" -m pip download -d "$HERE/wheels" --only-binary=:all: --python-version "$PYV" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform linux_x86_64 -r "$HERE/wheels/requirements.txt"
TOK="${TOKENIZER_DIR:-$HOME/.cache/npu-gateway/SmolLM2-135M-Instruct-bf16-v1}"
for f in tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json generation_config.json; do
  [[ -f "$TOK/$f" ]] && cp "$TOK/$f" "$HERE/wheels/tokenizer/"
done
ls "$HERE/wheels/tokenizer"
du -sh "$HERE/wheels"

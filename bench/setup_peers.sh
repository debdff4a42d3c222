#!/usr/bin/env bash
# Install what the benchmarks need besides the project's own venv:
# - bench/.venv-peers: LiteLLM proxy, vllm-router, matplotlib, py-spy, pyinstrument
#   (never in /work/main/.venv: LiteLLM pins its own fastapi/pydantic/httpx);
# - wrk (Debian package) for the non-stream load.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3.11}"
if [[ ! -x "$HERE/.venv-peers/bin/python" ]]; then
  "$PY" -m venv "$HERE/.venv-peers"
fi
"$HERE/.venv-peers/bin/pip" install -q --upgrade pip
"$HERE/.venv-peers/bin/pip" install -q "litellm[proxy]==1.108.7" "vllm-router==0.1.17" "matplotlib==3.11.2" \
  "py-spy==0.4.3" "pyinstrument==5.1.3" "psutil==7.2.2" "aiohttp==3.14.5" "orjson==3.13.0" "uvloop==0.23.0"
if ! command -v wrk >/dev/null; then
  apt-get update -q && apt-get install -y -q wrk
fi
"$HERE/.venv-peers/bin/python" -c "import importlib.metadata as m; print({p: m.version(p) for p in ('litellm','vllm-router','matplotlib','py-spy','pyinstrument')})"
wrk --version | head -1 || true

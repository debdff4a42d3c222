"""`npu-gateway` with extra vLLM engine arguments (benchmarks only).

The gateway exposes no flag for engine arguments such as `load_format`; the
GPU check needs `load_format=dummy`. This shim merges the JSON object in
$BENCH_VLLM_EXTRA into the engine kwargs, then runs the normal CLI.

    BENCH_VLLM_EXTRA='{"load_format": "dummy"}' python bench/gw_shim.py serve --model DIR ...
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_adapter.backends import vllm as _vb

_EXTRA = json.loads(os.environ.get("BENCH_VLLM_EXTRA") or "{}")
_orig = _vb.VllmConfig.engine_kwargs


def _engine_kwargs(self: _vb.VllmConfig, *args: object, **kwargs: object) -> dict[str, object]:
    kw = _orig(self, *args, **kwargs)  # (device) or (device, index): the signature has changed before
    kw.update(_EXTRA)
    return kw


_vb.VllmConfig.engine_kwargs = _engine_kwargs  # type: ignore[method-assign]

if __name__ == "__main__":
    from server.cli import main

    main()

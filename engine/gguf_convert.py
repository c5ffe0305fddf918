"""Convert a GGUF checkpoint to a Hugging Face folder (config.json, safetensors, tokenizer).

Weights are dequantized with the ``gguf`` package; the tokenizer and chat template are rebuilt
by ``transformers``' GGUF tokenizer converter. The folder is written once to a cache keyed by
the file's identity, so the second load reads plain safetensors in seconds.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.errors import ModelNotFoundError, UnsupportedModelError

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")


def default_cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "models"


def cache_dir_for(gguf_path: Path, cache_root: Path | None = None) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    return (cache_root or default_cache_root()) / f"{gguf_path.stem}-{key[:12]}"


def convert_gguf(
    gguf_path: str | Path, cache_root: Path | None = None, progress: bool = True
) -> Path:
    """Return a Hugging Face folder for ``gguf_path``, converting it on first use."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {gguf_path}")
    out = cache_dir_for(gguf_path, cache_root)
    if (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _converting(out):  # one process converts; the others wait, then read its folder
        if (out / "model.safetensors").is_file():
            return out
        return _convert_into(gguf_path, out, progress)


# How long a process waits for another that converts the same file, before converting too
# (the rename below settles which folder stays): a holder that dies releases its lock at once.
CONVERT_WAIT_S = 3600.0


class _converting:
    """An advisory lock per cache folder (``<folder>.lock``, flock: released by the kernel when
    its holder exits, however it exits), held while converting."""

    def __init__(self, out: Path):
        self._path = out.parent / (out.name + ".lock")

    def __enter__(self):
        self._file = open(self._path, "a+b")  # closed (and unlocked) in __exit__
        deadline = time.monotonic() + CONVERT_WAIT_S
        while True:
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return self  # convert beside it; the rename decides
                time.sleep(0.2)

    def __exit__(self, *exc):
        self._file.close()  # releases the lock


def _convert_into(gguf_path: Path, out: Path, progress: bool) -> Path:
    # Write into a temp folder and rename: a crash mid-way never leaves a half cache behind.
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        config = _write_weights(gguf_path, tmp, progress)
        _write_tokenizer(gguf_path, tmp, config)
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        # Another process converting the same file renamed its folder in first (past the
        # lock's wait, or on a file system where flock does not lock): a directory renamed
        # onto a non-empty one fails with ENOTEMPTY (or EEXIST); theirs is complete, use it.
        finished = (out / "model.safetensors").is_file()
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not finished:
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_hf_config(gguf_path: Path) -> dict:
    """The Hugging Face ``config.json`` dict of a GGUF file, from its header (no conversion)."""
    import gguf

    return _hf_config(gguf.GGUFReader(str(gguf_path)))


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _hf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported: {_SUPPORTED_ARCHS}"
        )
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    num_heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    return {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": "qwen2" if arch == "qwen2" else "llama",
        "vocab_size": int(embd.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": _field(reader, f"{arch}.rope.dimension_count", hidden // num_heads),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _field(reader, f"{arch}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }


def _hf_name(gguf_name: str) -> str:
    base, _, kind = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    return f"{_GLOBAL_NAMES[base]}.{kind}"


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (it interleaves the two RoPE halves per head)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _write_weights(gguf_path: Path, out: Path, progress: bool) -> dict:
    import gguf
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    reader = gguf.GGUFReader(str(gguf_path))
    config = _hf_config(reader)
    tensors = {}
    bar = tqdm(
        reader.tensors, desc=f"Converting {gguf_path.name}", disable=not progress, unit="tensor"
    )
    for t in bar:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if config["model_type"] == "llama" and t.name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = (
                config["num_attention_heads"]
                if "attn_q" in t.name
                else config["num_key_value_heads"]
            )
            w = _unpermute_qk(w, heads)
        tensors[_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return config


def _write_tokenizer(gguf_path: Path, out: Path, config: dict) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))
    meta = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    (out / "pdserve_tokenizer.json").write_text(json.dumps(meta))

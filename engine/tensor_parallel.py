"""Tensor parallelism's sharding (Megatron-style): which query heads, KV heads and MLP columns
rank r of TP=k holds, and the shard of each weight.

q/k/v and gate/up are column-parallel (a rank computes its heads' and its columns' outputs);
o_proj and down are row-parallel (a rank multiplies its slice of the input and the ranks' partial
sums are added by one all-reduce after each: engine/tp_ranks.py). The embedding, the norms and
the LM head are replicated: every rank holds the whole hidden state after each all-reduce, so
rank 0 computes the logits alone and nothing is gathered. A rank's model is an ordinary
``LlamaModel`` of its local shape (``TPShard.local_config``): its KV cache holds only its KV
heads. Where k exceeds the model's KV heads, each KV head is replicated over k / num_kv_heads
ranks, as vLLM does: rank r holds KV head r * num_kv_heads // k. Torch-free at import.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # engine.config imports this module
    from engine.config import ModelConfig

# Hugging Face weight names (suffixes) -> (dim, which range): the rows or columns a rank keeps.
_HF_CUTS = {
    "self_attn.q_proj.weight": (0, "q"),
    "self_attn.q_proj.bias": (0, "q"),
    "self_attn.k_proj.weight": (0, "kv"),
    "self_attn.k_proj.bias": (0, "kv"),
    "self_attn.v_proj.weight": (0, "kv"),
    "self_attn.v_proj.bias": (0, "kv"),
    "self_attn.o_proj.weight": (1, "q"),
    "mlp.gate_proj.weight": (0, "ffn"),
    "mlp.up_proj.weight": (0, "ffn"),
    "mlp.down_proj.weight": (1, "ffn"),
}


def check_tensor_parallel(cfg: ModelConfig, size: int) -> int:
    """``size`` if a model of ``cfg``'s shape splits over that many ranks, else ValueError
    naming tensor_parallel_size and the dimension that does not divide."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size {size!r}: expected a positive integer")
    if size == 1:
        return size
    kv = cfg.num_kv_heads
    if cfg.num_heads % size:
        raise ValueError(
            f"tensor_parallel_size {size}: must divide the model's {cfg.num_heads} attention heads"
        )
    if kv % size and size % kv:
        raise ValueError(
            f"tensor_parallel_size {size}: must divide the model's {kv} KV heads or be a "
            "multiple of them (each KV head then replicated)"
        )
    if cfg.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size {size}: must divide the MLP's {cfg.intermediate_size} columns"
        )
    return size


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``size``: the slices it holds of a model of a given shape."""

    rank: int = 0
    size: int = 1

    def q_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        n = cfg.num_heads // self.size
        return self.rank * n, (self.rank + 1) * n

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        kv = cfg.num_kv_heads
        if self.size <= kv:
            n = kv // self.size
            return self.rank * n, (self.rank + 1) * n
        head = self.rank * kv // self.size  # replicated: k / kv ranks share each KV head
        return head, head + 1

    def ffn(self, cfg: ModelConfig) -> tuple[int, int]:
        n = cfg.intermediate_size // self.size
        return self.rank * n, (self.rank + 1) * n

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shape of this rank's model (the hidden size, vocabulary and norms are whole)."""
        check_tensor_parallel(cfg, self.size)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank}: expected 0..{self.size - 1}")
        q0, q1 = self.q_heads(cfg)
        k0, k1 = self.kv_heads(cfg)
        f0, f1 = self.ffn(cfg)
        return replace(cfg, num_heads=q1 - q0, num_kv_heads=k1 - k0, intermediate_size=f1 - f0)

    def _range(self, cfg: ModelConfig, which: str) -> tuple[int, int]:
        d = cfg.head_dim
        if which == "ffn":
            return self.ffn(cfg)
        lo, hi = self.q_heads(cfg) if which == "q" else self.kv_heads(cfg)
        return lo * d, hi * d

    def hf_cut(self, name: str, cfg: ModelConfig) -> tuple[int, int, int] | None:
        """(dim, start, stop) of a Hugging Face weight this rank keeps a slice of; None: whole."""
        for suffix, (dim, which) in _HF_CUTS.items():
            if name.endswith(suffix):
                return (dim, *self._range(cfg, which))
        return None

    def shard_fused(self, name: str, t, cfg: ModelConfig):
        """This rank's slice of ``t``, a parameter of the whole model by our (fused) names."""
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            q, k, v = t.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=0)
            parts = [(q, "q"), (k, "kv"), (v, "kv")]
            return _cat([p[slice(*self._range(cfg, w))] for p, w in parts])
        if name.endswith("gate_up_proj.weight"):
            gate, up = t.split([cfg.intermediate_size] * 2, dim=0)
            f = slice(*self.ffn(cfg))
            return _cat([gate[f], up[f]])
        if name.endswith("o_proj.weight"):
            return t[:, slice(*self._range(cfg, "q"))]
        if name.endswith("down_proj.weight"):
            return t[:, slice(*self.ffn(cfg))]
        return t


def _cat(parts):
    import torch

    return torch.cat(parts, dim=0)


def read_hf_shard(files, cfg: ModelConfig, shard: TPShard) -> dict:
    """The Hugging Face tensors of ``files`` (safetensors) as this rank holds them: the sharded
    ones read as slices (only their bytes are read), the rest whole."""
    from safetensors import safe_open

    out = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                cut = shard.hf_cut(name, cfg)
                if cut is None:
                    out[name] = f.get_tensor(name)
                    continue
                dim, start, stop = cut
                view = f.get_slice(name)
                out[name] = view[start:stop] if dim == 0 else view[:, start:stop]
    return out

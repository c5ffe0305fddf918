"""What one serving engine is made of, in every process that hosts one (workers, the local
harness, Ray actors): the engine's serving defaults live here, once, and a checkpoint loaded
once. ``engine.llm_engine.build_engine`` turns them into an ``LLMEngine`` (it lives beside the
class, so this module imports nothing of it). Torch-free at import: the router and the config
read the defaults without loading a model."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import CacheConfig, EngineConfig, SchedulerConfig


@dataclass(frozen=True)
class EngineSettings:
    model: str = "embedded"  # HF folder, .gguf file, or "embedded"
    block_size: int = CacheConfig.block_size
    num_blocks: int = 2048  # a serving worker's KV pool (a bare LLMEngine's CacheConfig: 1024)
    max_model_len: int = EngineConfig.max_model_len
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    prefill_chunk_size: int = SchedulerConfig.prefill_chunk_size
    device: str = "auto"  # cpu, cuda[:N], or auto: cuda where a GPU is visible
    threads: int = 0  # torch threads of the process that builds it; 0: torch's default
    dtype: str = "auto"  # the model's float dtype: engine.config.DTYPES (auto: bf16 on CUDA)
    weights: str = EngineConfig.weights  # how weights are stored: engine.config.WEIGHT_FORMATS
    weight_group: int = EngineConfig.weight_group  # q4: weights per scale
    kv_dtype: str = EngineConfig.kv_dtype  # the KV cache: engine.config.KV_DTYPES
    prefill_gemm: str = EngineConfig.prefill_gemm  # engine.config.PREFILL_GEMMS
    activations: str = EngineConfig.activations  # engine.config.ACTIVATIONS
    load_format: str = "auto"  # auto | dummy: random weights of config.json's shape
    # Ranks of one engine (engine/tp_ranks.py); > 1 spawns the followers, each with
    # ``threads`` torch threads (0: the cores split evenly), on 127.0.0.1 unless ``tp_host``.
    tensor_parallel_size: int = EngineConfig.tensor_parallel_size
    tp_host: str = "127.0.0.1"

    @property
    def cache(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, num_blocks=self.num_blocks)

    @property
    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            prefill_chunk_size=self.prefill_chunk_size,
        )


@dataclass(frozen=True)
class LoadedModel:
    """A checkpoint loaded once: engines built on it share its weights, which inference only
    reads (in-process workers of the local harness)."""

    config: object  # engine.config.ModelConfig
    weights: object  # engine.model.LlamaModel
    tokenizer: object | None  # engine.tokenizer.Tokenizer, when the folder has one


def load_model_once(s: EngineSettings, progress: bool = False, shard=None) -> LoadedModel:
    """``shard`` (engine.tensor_parallel.TPShard): one tensor-parallel rank's slices only;
    ``config`` stays the whole model's."""
    from engine.loader import load_config, load_model
    from engine.model_files import resolve_model_dir
    from engine.tokenizer import Tokenizer

    model_dir = resolve_model_dir(s.model, progress=progress)
    cfg = load_config(model_dir)
    weights = load_model(
        model_dir,
        cfg,
        context_length(s, cfg),
        s.device,
        s.weights,
        s.weight_group,
        prefill_gemm=s.prefill_gemm,
        activations=s.activations,
        load_format=s.load_format,
        shard=shard,
        dtype=s.dtype,
    )
    has_tokenizer = (model_dir / "tokenizer.json").is_file()
    return LoadedModel(cfg, weights, Tokenizer(model_dir) if has_tokenizer else None)


def shared_weights(s: EngineSettings, loaded: LoadedModel | None) -> LoadedModel | None:
    """``loaded`` where the engine can run on weights loaded whole (one rank); a
    tensor-parallel engine's ranks each load their own shard (engine/tp_ranks.py)."""
    return loaded if s.tensor_parallel_size == 1 else None


def context_length(s: EngineSettings, model_cfg) -> int:
    # A context past the checkpoint's positions would index RoPE tables that do not exist.
    return min(s.max_model_len, model_cfg.max_position_embeddings)

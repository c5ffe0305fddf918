"""Greedy output on the embedded SmolLM2 equals transformers' generate, token for token.

Eight chat prompts x 48 new tokens run as one mixed batch, prefilled whole and in chunks of
16 tokens. The reference model is loaded by transformers' own GGUF loader, so it also checks
our GGUF dequantization and Q/K un-permutation.
"""

from __future__ import annotations

import pytest
import torch

from engine.loader import EMBEDDED_GGUF, embedded_gguf_path
from engine.request import SamplingParams
from tests.conftest import needs_embedded
from tests.greedy import assert_same_greedy, hf_greedy

pytestmark = [pytest.mark.slow, needs_embedded]

NEW_TOKENS = 48
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three primary colors.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a short motivational quote.",
    "What is 17 times 23? Show your work, step by step, and then give the final answer.",
]


@pytest.fixture(scope="module")
def hf_reference():
    from transformers import AutoModelForCausalLM

    gguf = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=EMBEDDED_GGUF, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def reference_outputs(hf_reference, chat_prompt_ids):
    return [hf_greedy(hf_reference, p, NEW_TOKENS) for p in chat_prompt_ids]


@pytest.fixture(scope="module")
def chat_prompt_ids():
    from engine.loader import resolve_model_dir
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_dir("embedded", progress=False))
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


def test_tokenizer_matches_transformers(chat_prompt_ids):
    from transformers import AutoTokenizer

    gguf = embedded_gguf_path()
    hf_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=EMBEDDED_GGUF)
    for q, ours in zip(QUESTIONS, chat_prompt_ids):
        ref = hf_tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
        assert ours == list(ref)


@pytest.mark.parametrize("chunk", [0, 16], ids=["whole", "chunk16"])
def test_smollm2_greedy_batch_matches_transformers(
    make_engine, chat_prompt_ids, reference_outputs, hf_reference, chunk
):
    engine = make_engine("embedded", block_size=16, num_blocks=512, prefill_chunk_size=chunk)
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = engine.generate(chat_prompt_ids, params)
    exact = [
        assert_same_greedy(hf_reference, p, r.output_token_ids, ref)
        for p, r, ref in zip(chat_prompt_ids, outs, reference_outputs)
    ]
    # Ties are allowed by the rule above, but most sequences must match outright.
    assert sum(exact) >= 6, f"only {sum(exact)} of 8 sequences matched exactly"


def test_stop_string_truncates_text_and_finishes(make_engine, chat_prompt_ids):
    engine = make_engine("embedded", block_size=16, num_blocks=128)
    [free] = engine.generate([chat_prompt_ids[0]], SamplingParams(max_tokens=24))
    assert "Paris" in free.output_text
    [stopped] = engine.generate(
        [chat_prompt_ids[0]], SamplingParams(max_tokens=24, stop=("Paris",))
    )
    assert stopped.output_text == free.output_text.split("Paris")[0]
    assert stopped.status.finish_reason == "stop"
    [kept] = engine.generate(
        [chat_prompt_ids[0]],
        SamplingParams(max_tokens=24, stop=("Paris",), include_stop_str_in_output=True),
    )
    assert kept.output_text == stopped.output_text + "Paris"


def test_cli_generate_prints_a_completion(capsys):
    from pdserve.cli import main

    assert main(["generate", "What is the capital of France?", "--max-tokens", "16"]) == 0
    assert "Paris" in capsys.readouterr().out

"""Incremental detokenization streams exactly the text a one-shot decode gives."""

from __future__ import annotations

import pytest

from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.conftest import needs_embedded, write_word_tokenizer

TEXTS = [
    "Héllo wörld, 日本語のテキスト 🎉 and   spaces\n\nnew lines",
    "The capital of France is Paris.",
]


def _streamed(tok: Tokenizer, ids: list[int]) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    return "".join(deltas), deltas


@needs_embedded
@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_bpe_stream_equals_one_shot_decode(text):
    from engine.model_files import resolve_model_dir

    tok = Tokenizer(resolve_model_dir("embedded", progress=False))
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    streamed, deltas = _streamed(tok, ids)
    assert streamed == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas), "half a character was streamed"


def test_word_level_stream_equals_one_shot_decode(tmp_path):
    write_word_tokenizer(tmp_path, 128)
    tok = Tokenizer(tmp_path)
    ids = [5, 6, 2, 100, 7]
    streamed, _ = _streamed(tok, ids)
    assert streamed == tok.decode(ids) == "w5 w6 w100 w7"


def test_token_bytes_hold_partial_characters(tmp_path):
    """A byte-level BPE token may be half a character: its bytes (chat logprobs' ``bytes``)
    come from the token itself, and they concatenate to the text's UTF-8."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from engine.tokenizer import Tokenizer

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    hf.train_from_iterator(["héllo wörld " * 3, "naïve café"], trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    text = "café ñ"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # a split character


TOOLS_TEMPLATE = (
    "{% if tools %}tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
)


def test_a_template_renders_the_tools_as_transformers_does(tmp_path):
    """A chat's tools reach templates that show the model what it may call, rendered as
    transformers' apply_chat_template renders them (vLLM passes them the same way)."""
    import json

    from transformers import AutoTokenizer

    write_word_tokenizer(tmp_path, 16)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tools = [{"type": "function", "function": {"name": "w5", "parameters": {}}}]
    messages = [{"role": "user", "content": "w6"}]
    ours = Tokenizer(tmp_path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    for given in (tools, None):
        text = ours.apply_chat_template(messages, tools=given)
        assert text == theirs.apply_chat_template(messages, tools=given, tokenize=False)
    assert ours.apply_chat_template(messages, tools=tools).startswith("tools: w5 ")
    want = ours.encode("tools: w5 user: w6", add_special_tokens=False)
    assert ours.encode_chat(messages, tools=tools) == want

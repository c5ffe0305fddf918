"""Incremental detokenization streams exactly the text a one-shot decode gives."""

from __future__ import annotations

import pytest

from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.conftest import needs_embedded, write_word_tokenizer

TEXTS = ["Héllo wörld, 日本語のテキスト 🎉 and   spaces\n\nnew lines", "The capital of France is Paris."]


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

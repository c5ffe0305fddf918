"""Benchmark workloads: shapes, document lengths, and prompts that never repeat across runs."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.loadgen.workloads import (
    CHAT_MAX_TOKENS,
    DOC_MAX_TOKENS,
    get_workload,
    make_workload,
    warmup_requests,
)


def doc_words(content: str) -> int:
    """Words of the document alone: without the nonce line and the closing question."""
    paragraphs = content.split("\n\n")
    return sum(len(p.split()) for p in paragraphs[1:-1])


def test_mixed_workload_is_a_fifth_long_documents_of_700_to_1000_words():
    w = make_workload("mixed", 50, seed=3, nonce="n1")
    docs = [r for r in w.requests if r.kind == "longdoc"]
    chats = [r for r in w.requests if r.kind == "chat"]
    assert len(docs) == 10 and len(chats) == 40
    for r in docs:
        assert 700 <= doc_words(r.messages[0]["content"]) == r.words <= 1000
        assert DOC_MAX_TOKENS[0] <= r.max_tokens <= DOC_MAX_TOKENS[1]
        assert r.messages[0]["content"].rstrip().endswith((".", "?"))
    for r in chats:
        assert r.words < 30 and CHAT_MAX_TOKENS[0] <= r.max_tokens <= CHAT_MAX_TOKENS[1]


def test_documents_read_like_sentences_of_words():
    r = make_workload("longdoc", 1, seed=0, nonce="x").requests[0]
    doc = "\n\n".join(r.messages[0]["content"].split("\n\n")[1:-1])
    sentences = [s for s in doc.replace("\n\n", " ").split(". ") if s]
    assert len(sentences) > 30
    assert all(s[0].isupper() for s in sentences)
    assert all(word.isalpha() for word in doc.replace(".", "").split())


def test_prompts_never_repeat_within_a_run_or_across_nonces():
    a = make_workload("mixed", 40, seed=0, nonce="run-a")
    b = make_workload("mixed", 40, seed=0, nonce="run-b")
    prompts_a = [r.text() for r in a.requests]
    prompts_b = [r.text() for r in b.requests]
    assert len(set(prompts_a)) == 40
    assert not set(prompts_a) & set(prompts_b)
    # nor does any prompt of one run share its first line (the prefix) with the other run
    first = {p.split(".")[0] for p in prompts_a}
    assert not first & {p.split(".")[0] for p in prompts_b}
    warm = {r.text() for r in warmup_requests(3, "run-a")}
    assert not warm & set(prompts_a)


def test_same_seed_same_shape_and_same_seed_and_nonce_same_prompts():
    a = make_workload("mixed", 30, seed=5, nonce="k")
    b = make_workload("mixed", 30, seed=5, nonce="k")
    c = make_workload("mixed", 30, seed=5)  # a fresh nonce
    assert [r.text() for r in a.requests] == [r.text() for r in b.requests]
    assert [(r.kind, r.max_tokens, r.words) for r in a.requests] == [
        (r.kind, r.max_tokens, r.words) for r in c.requests
    ]
    assert c.nonce != "k"


def test_jsonl_file_workload_cycles_to_num_requests(tmp_path):
    path = tmp_path / "w.jsonl"
    rows = [
        {"prompt": "Hello", "max_tokens": 5},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    w = get_workload(str(path), 5)
    assert [r.max_tokens for r in w.requests] == [5, 7, 5, 7, 5]
    assert w.requests[0].as_messages() == [{"role": "user", "content": "Hello"}]
    assert w.requests[1].text() == "Hi"
    path.write_text(json.dumps({"max_tokens": 3}) + "\n")
    with pytest.raises(ValueError, match="exactly one of"):
        get_workload(str(path), 1)
    with pytest.raises(ValueError, match="unknown workload"):
        get_workload("no-such-workload", 1)

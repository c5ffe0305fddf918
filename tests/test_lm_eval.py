"""lm-eval's ``local-completions`` pointed at pdserve scores a small multiple-choice task
(tests/data/tiny_mc.jsonl) by loglikelihood (echo + logprobs): every choice's loglikelihood
equals lm-eval's ``hf`` backend on the same model within 1e-3, and so does the accuracy.

The client tokenizes through the server (/tokenizer_info, /tokenize), as lm-eval does with
any server that has them."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir

lm_eval = pytest.importorskip("lm_eval")

DATA = Path(__file__).parent / "data" / "tiny_mc.jsonl"


def task_config() -> dict:
    return {
        "task": "pdserve_tiny_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(DATA)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "metric_list": [{"metric": "acc"}],
    }


def per_choice_loglikelihoods(results) -> list[list[float]]:
    samples = sorted(results["samples"]["pdserve_tiny_mc"], key=lambda s: s["doc_id"])
    return [[float(r[0]) for r in s["filtered_resps"]] for s in samples]


def evaluate(model: str, model_args: dict, batch_size: int = 1):
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task_config()],
        batch_size=batch_size,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def test_local_completions_loglikelihoods_equal_the_hf_backend(tmp_path):
    path, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2, seed=9)
    spec = ClusterSpec(model=str(path), num_blocks=256, max_model_len=128, http_port=0)
    with LocalCluster(spec) as cluster:
        served = evaluate(
            "local-completions",
            {
                "base_url": f"http://{cluster.http_address}/v1/completions",
                "model": cluster.router.cfg.model_name,
                "num_concurrent": 1,
                "max_retries": 1,
                "tokenized_requests": True,
                "max_length": 128,
            },
            batch_size=4,  # four prompts per request: a batched completions call
        )
        assert_all_blocks_free(cluster)
    reference = evaluate("hf", {"pretrained": str(path), "device": "cpu", "dtype": "float32"})
    ours, ref = per_choice_loglikelihoods(served), per_choice_loglikelihoods(reference)
    assert len(ours) == 12 and all(len(c) == 4 for c in ours)
    for a, b in zip(ours, ref):
        assert a == pytest.approx(b, abs=1e-3)
    acc = served["results"]["pdserve_tiny_mc"]["acc,none"]
    assert acc == reference["results"]["pdserve_tiny_mc"]["acc,none"]

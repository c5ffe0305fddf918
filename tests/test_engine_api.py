"""Engine behaviour beyond greedy equality: errors, stops, sampling, aborts, the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import ModelConfig
from engine.errors import InvalidRequestError, ModelNotFoundError, UnsupportedModelError
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus, SamplingParams
from pdserve.cli import main as cli_main
from tests.conftest import tiny_llama_dir


@pytest.fixture
def tiny(tmp_path):
    path, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2)
    return path


def test_missing_model_path_is_a_clear_error():
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        LLMEngine.from_model_path("/no/such/model")


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        LLMEngine.from_model_path(tmp_path)


def test_unsupported_rope_scaling_is_rejected():
    cfg = {"model_type": "llama", "rope_scaling": {"rope_type": "yarn"}}
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_hf_dict(cfg)


def test_cli_reports_errors_without_traceback(capsys):
    assert cli_main(["generate", "hi", "--model", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err


def test_cli_generate_reports_an_engine_error_and_fails(tiny, capsys, monkeypatch):
    """A request the engine fails (finish_reason "error") is an error on stderr and exit
    status 1, not an empty answer that looks normal."""
    from engine.sampler import Sampler

    def broken(self, logits, requests):
        raise IndexError("the sampler broke")

    monkeypatch.setattr(Sampler, "_apply_min_tokens", broken)
    argv = ["generate", "hi", "--model", str(tiny), "--max-tokens", "3", "--raw"]
    assert cli_main(argv) == 1
    err = capsys.readouterr().err
    assert "error: engine error: IndexError: the sampler broke" in err and "Traceback" not in err


def test_prompt_longer_than_context_is_rejected(make_engine, tiny):
    engine = make_engine(tiny)
    with pytest.raises(InvalidRequestError, match="prompt") as e:
        engine.add_request([5] * engine.config.max_model_len)
    assert e.value.param == "prompt"


def test_empty_prompt_is_rejected(make_engine, tiny):
    engine = make_engine(tiny)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request([])


def test_out_of_vocab_token_is_rejected(make_engine, tiny):
    engine = make_engine(tiny)
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request([1, 10_000])


@pytest.mark.parametrize(
    "field,value",
    [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("min_tokens", -1)],
)
def test_bad_sampling_params_name_the_parameter(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_stop_token_ids_and_max_tokens(make_engine, tiny):
    engine = make_engine(tiny)
    [free_run] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(free_run.output_token_ids) == 10
    assert free_run.status == RequestStatus.FINISHED_LENGTH
    stop_at = free_run.output_token_ids[3]
    [stopped] = engine.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=10, stop_token_ids=(stop_at,))
    )
    first = free_run.output_token_ids.index(stop_at)
    assert stopped.output_token_ids == free_run.output_token_ids[: first + 1]
    assert stopped.status == RequestStatus.FINISHED_STOPPED


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(make_engine, tiny):
    engine = make_engine(tiny)
    hot = SamplingParams(max_tokens=16, temperature=5.0, seed=1234, ignore_eos=True)
    a, b = engine.generate([[5, 6, 7], [5, 6, 7]], hot)
    assert a.output_token_ids == b.output_token_ids
    [greedy] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=16, ignore_eos=True))
    assert a.output_token_ids != greedy.output_token_ids


def test_top_k_one_is_greedy(make_engine, tiny):
    engine = make_engine(tiny)
    [g] = engine.generate([[9, 8, 7]], SamplingParams(max_tokens=12, ignore_eos=True))
    [k1] = engine.generate(
        [[9, 8, 7]], SamplingParams(max_tokens=12, temperature=1.0, top_k=1, ignore_eos=True)
    )
    assert g.output_token_ids == k1.output_token_ids


def test_min_tokens_suppresses_eos(make_engine, tiny):
    engine = make_engine(tiny)
    eos = engine.config.model.eos_token_ids[0]
    params = SamplingParams(max_tokens=8, min_tokens=8, stop_token_ids=(eos,))
    [r] = engine.generate([[3, 4]], params)
    assert len(r.output_token_ids) == 8 and eos not in r.output_token_ids


def test_abort_returns_blocks(make_engine, tiny):
    engine = make_engine(tiny, block_size=4)
    rid = engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.blocks.num_free < engine.blocks.num_total
    engine.abort(rid)
    assert engine.blocks.num_free == engine.blocks.num_total


def test_prefix_cache_hits_for_a_shared_prefix(make_engine, tiny):
    engine = make_engine(tiny, block_size=4)
    system = list(range(10, 30))
    [a] = engine.generate([system + [3]], SamplingParams(max_tokens=4))
    [b] = engine.generate([system + [4]], SamplingParams(max_tokens=4))
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 20
    assert engine.blocks.prefix_hit_tokens >= 20


def test_device_auto_follows_cuda_and_bad_names_are_refused():
    from engine.loader import resolve_device

    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device 'gpu': expected cpu, cuda, cuda:N or auto"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda': no CUDA device is visible"):
            resolve_device("cuda")


def test_worker_cli_refuses_an_unknown_device_by_name():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "prefill_worker", "--device", "tpu"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "argument --device: device 'tpu'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_generate_cli_refuses_an_unknown_device_by_name(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "hi", "--device", "tpu"])
    assert e.value.code == 2
    assert "argument --device: device 'tpu'" in capsys.readouterr().err

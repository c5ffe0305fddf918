"""The colocated engine: add requests, step, collect outputs. The step is engine/step.py's
schedule, run, update, the same one the workers run. ``build_engine`` makes one from
engine/settings.py's serving settings (workers, the local harness, Ray actors)."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.block_manager import BlockManager
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.errors import EngineError, InvalidRequestError
from engine.guided import GuidedDecoding
from engine.model import LlamaModel
from engine.model_runner import ModelRunner
from engine.request import Request, RequestStatus, SamplingParams, check_token_ids
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from engine.settings import EngineSettings, LoadedModel, context_length, load_model_once
from engine.step import ModelExecutor, StepHooks, StepLoop
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    # "stop" | "length" | "abort" | "error"; with "error" the request failed inside a step
    # (alone: the others went on) and ``error`` says why: "engine error: <cause>", or
    # "worker error: <cause>" when the step failed for every request in it.
    finish_reason: str | None
    error: str | None = None


class LLMEngine(StepHooks):
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel,
        tokenizer: Tokenizer | None = None,
        runner: ModelRunner | None = None,
    ):
        """``runner``: one already built on ``model`` (a tensor-parallel rank 0's,
        engine/tp_ranks.py); else a single-device one."""
        self.config = config
        self.tokenizer = tokenizer
        cache = config.cache
        self.blocks = BlockManager(cache.num_blocks, cache.block_size)
        self.scheduler = Scheduler(config.scheduler, self.blocks, config.max_model_len)
        self.runner = runner or ModelRunner(
            model, cache.num_blocks, cache.block_size, config.kv_dtype
        )
        eos = set(config.model.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        guided = None
        if tokenizer is not None:
            guided = GuidedDecoding(tokenizer, config.model.vocab_size, self.eos_token_ids)
        self.sampler = Sampler(guided)
        self.executor = ModelExecutor(self.runner, self.sampler)
        self.step_loop = StepLoop(self.scheduler, self.executor, self)
        self._step_outputs: list[RequestOutput] = []
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()

    @classmethod
    def from_model_path(
        cls,
        model: str | Path = "embedded",
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        max_model_len: int = EngineConfig.max_model_len,
        progress: bool = True,
        device: str = "cpu",
        dtype: str = "auto",
    ) -> LLMEngine:
        """Load a checkpoint; ``device`` "cuda" runs the forward on the GPU, attention through
        the Triton kernels; ``dtype`` (engine.config.DTYPES): auto is bf16 there, fp32 on the
        CPU. The same engine ``build_engine`` builds for a worker from these settings."""
        cache, scheduler = cache or CacheConfig(), scheduler or SchedulerConfig()
        settings = EngineSettings(
            str(model),
            **asdict(cache),
            **asdict(scheduler),
            max_model_len=max_model_len,
            device=device,
            dtype=dtype,
        )
        return build_engine(settings, load_model_once(settings, progress))

    # ---- requests ----------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        ids = self._encode(prompt)
        sampling = sampling or SamplingParams()
        check_token_ids(self.config.model.vocab_size, ids, sampling)  # refused alone, not mid-batch
        request_id = request_id or f"req-{next(self._ids)}"
        req = Request(request_id, ids, sampling, eos_token_ids=self.eos_token_ids)
        self.scheduler.add(req)
        self.requests[request_id] = req
        if self.tokenizer is not None:
            skip = sampling.skip_special_tokens
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, skip)
        return request_id

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            self._forget(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def close(self) -> None:
        """Release what outlives the object: a tensor-parallel engine's follower ranks."""
        self.runner.close()

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step's outputs: a token for each request that got one, and a finished output
        (finish_reason "error", no token) for each request that failed in it."""
        self._step_outputs = []
        self.step_loop.step()
        return self._step_outputs

    def on_updated(self, updated: list[Request]) -> None:
        self._step_outputs += [self._output(req) for req in updated]

    def on_failed(self, req: Request, error: EngineError) -> None:
        self._forget(req.request_id)
        self._step_outputs.append(
            RequestOutput(req.request_id, [], "", True, req.status.finish_reason, str(error))
        )

    def generate(self, prompts: list[str | list[int]], sampling: SamplingParams | None = None):
        """Run prompts to completion as one continuous batch; returns finished ``Request``s (one
        that failed has status FINISHED_ERROR and the cause in ``Request.error``)."""
        ids = [self.add_request(p, sampling) for p in prompts]
        while self.has_unfinished():
            self.step()
        return [self.requests.pop(i) for i in ids]

    # ---- internals ---------------------------------------------------------------------
    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "text prompts need a tokenizer")
            prompt = self.tokenizer.encode(prompt)
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        vocab = self.config.model.vocab_size
        if any(not (0 <= t < vocab) for t in prompt):
            raise InvalidRequestError("prompt", f"token ids must be in [0, {vocab})")
        return list(prompt)

    def _output(self, req: Request) -> RequestOutput:
        token = req.output_token_ids[-1]
        text = ""
        detok = self._detok.get(req.request_id)
        if detok is not None:
            text = detok.push(token)
            req.output_text = detok.text
            text = self._apply_stop_strings(req, text)
        if req.is_finished:
            self._forget(req.request_id)
        return RequestOutput(
            req.request_id, [token], text, req.is_finished, req.status.finish_reason
        )

    def _apply_stop_strings(self, req: Request, delta: str) -> str:
        for stop in req.sampling.stop:
            idx = req.output_text.find(stop)
            if idx >= 0:
                idx += len(stop) if req.sampling.include_stop_str_in_output else 0
                cut = len(req.output_text) - idx
                req.output_text = req.output_text[:idx]
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                return delta[: max(0, len(delta) - cut)]
        return delta

    def _forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self.sampler.release(request_id)


def build_engine(s: EngineSettings, loaded: LoadedModel | None = None) -> LLMEngine:
    """The engine ``s`` describes, on ``loaded``'s weights when given (else loaded now)."""
    if s.tensor_parallel_size > 1:  # rank 0 here, the followers spawned (engine/tp_ranks.py)
        from engine.tp_ranks import start_tensor_parallel

        if loaded is not None:  # a shared whole model is no rank's shard
            raise ValueError("tensor_parallel_size > 1: each rank loads its own shard")
        loaded, runner = start_tensor_parallel(s)
        config = engine_config(s, loaded.config)
        return LLMEngine(config, loaded.weights, loaded.tokenizer, runner)
    if s.threads:
        torch.set_num_threads(s.threads)
    loaded = loaded or load_model_once(s)
    return LLMEngine(engine_config(s, loaded.config), loaded.weights, loaded.tokenizer)


def engine_config(s: EngineSettings, model_cfg) -> EngineConfig:
    """The ``EngineConfig`` of ``s`` for a model of ``model_cfg``'s (whole) shape."""
    return EngineConfig(
        model_cfg,
        s.cache,
        s.scheduler,
        context_length(s, model_cfg),
        weights=s.weights,
        weight_group=s.weight_group,
        kv_dtype=s.kv_dtype,
        prefill_gemm=s.prefill_gemm,
        activations=s.activations,
        tensor_parallel_size=s.tensor_parallel_size,
    )

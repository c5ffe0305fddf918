"""Turns a scheduler plan into one batched forward over the paged cache, and logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.cuda_graphs import BATCH_BUCKETS, DecodeGraphs, graphs_enabled
from engine.model import KVCache, LayerCallback, LlamaModel
from engine.sampler import logprob_entries
from engine.scheduler import ScheduledSequence
from kernels.metadata import AttentionMetadata

PROMPT_LOGPROB_ROWS = 512  # prompt positions per LM-head call when prompt logprobs are asked


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kv_dtype: str = "fp32"):
        self.model = model
        self.block_size = block_size
        self.kv_dtype = kv_dtype  # fp32 | int8 (a scale per token and head)
        self.device = model.embed_tokens.weight.device
        self.kv_caches: KVCache = model.allocate_kv_cache(num_blocks, block_size, kv_dtype=kv_dtype)
        self.graphs: DecodeGraphs | None = None  # decode steps under CUDA graphs (opt-in)
        if graphs_enabled(self.device):
            max_len = model.rope.cos.shape[0]  # the positions this engine serves
            self.graphs = DecodeGraphs(model, self.kv_caches, max_len, block_size, BATCH_BUCKETS)

    def prepare(self, batch: Sequence[ScheduledSequence]):
        """Input ids, positions and attention metadata for a mixed prefill/decode batch."""
        return self.inputs(*plan_lists(batch))

    def inputs(self, ids: list[int], query_lens, seq_lens, tables):
        """``prepare``'s tensors from ``plan_lists``' host lists (a tensor-parallel follower
        gets those lists from rank 0: engine/tp_ranks.py)."""
        positions = torch.cat([torch.arange(e - q, e) for q, e in zip(query_lens, seq_lens)])
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return input_ids, positions.to(self.device), meta

    @torch.inference_mode()
    def execute(
        self, batch: Sequence[ScheduledSequence], layer_callback: LayerCallback | None = None
    ) -> torch.Tensor:
        """Run the forward; return fp32 logits [num sampling sequences, vocab]."""
        input_ids, positions, meta = self.prepare(batch)
        if self._graph_step(batch, meta, layer_callback):
            return self.graphs.run(input_ids, positions, meta)
        hidden = self.model(input_ids, positions, meta, self.kv_caches, layer_callback)
        self._record_prompt_logprobs(batch, hidden)
        last = meta.query_start_loc[1:].long() - 1
        rows = [i for i, s in enumerate(batch) if s.samples]
        if not rows:
            return hidden.new_empty((0, self.model.cfg.vocab_size))
        # Logits for the last token of sampling sequences only: the LM head is the largest
        # matmul of a decode step, and prefill positions before the last need none.
        return self.model.compute_logits(hidden[last[rows]]).float()

    def _graph_step(self, batch, meta, layer_callback) -> bool:
        """A decode step every row of which samples, no prompt logprobs: a captured graph's."""
        return (
            self.graphs is not None
            and self.graphs.can_run(meta, layer_callback)
            and all(s.samples and s.request.sampling.prompt_logprobs is None for s in batch)
        )

    def close(self) -> None:
        """Nothing to release on one device (a tensor-parallel runner stops its ranks)."""

    def rank_caches(self) -> list[tuple[tuple[int, int], list]]:
        """Each rank's (the model's KV heads [lo, hi) it holds, its KV cache): one rank of
        every head here (a tensor-parallel runner has one per rank: engine/tp_ranks.py)."""
        return [((0, self.model.cfg.num_kv_heads), self.kv_caches)]

    def tensor_parallel_status(self) -> dict:
        return {"size": 1, "ranks": []}

    def problem(self) -> str | None:
        """Why this runner cannot step again (None: it can; a TP runner's rank may be lost)."""
        return None

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's KV in every layer (a forked sequence's own partial block)."""
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst].copy_(k_cache[src])
            v_cache[dst].copy_(v_cache[src])

    def _record_prompt_logprobs(self, batch: Sequence[ScheduledSequence], hidden) -> None:
        """Each prompt token's logprob given the tokens before it, for requests that asked
        (echo): their chunk's positions go through the LM head too; others pay nothing."""
        row = 0
        for s in batch:
            req, first_row = s.request, row
            row += s.num_new_tokens
            k = req.sampling.prompt_logprobs
            if k is None:
                continue
            start = req.num_computed_tokens
            if start == 0 or req.prompt_logprobs is None:  # a recompute starts over
                req.prompt_logprobs = []
            # One entry per position before ``start``: a chunk run again (a failed forward's
            # isolation, engine/step_isolation.py) replaces its entries instead of adding more.
            del req.prompt_logprobs[start:]
            # Position p predicts token p + 1; the last prompt position is sampled instead.
            stop = min(start + s.num_new_tokens, req.num_prompt_tokens - 1)
            for lo in range(start, stop, PROMPT_LOGPROB_ROWS):  # bounded logits memory
                hi = min(stop, lo + PROMPT_LOGPROB_ROWS)
                rows = hidden[first_row + lo - start : first_row + hi - start]
                logits = self.model.compute_logits(rows).float()
                n = hi - lo
                req.prompt_logprobs += logprob_entries(
                    logits,
                    [req.sampling.temperature] * n,
                    req.prompt_token_ids[lo + 1 : hi + 1],
                    [k] * n,
                )


def plan_lists(batch: Sequence[ScheduledSequence]):
    """The host lists a forward is built from: input ids, query lengths, sequence lengths
    (cached + new) and block tables."""
    ids: list[int] = []
    query_lens, seq_lens, tables = [], [], []
    for s in batch:
        req = s.request
        start = req.num_computed_tokens
        end = start + s.num_new_tokens
        ids.extend(_token_slice(req, start, end))
        query_lens.append(s.num_new_tokens)
        seq_lens.append(end)
        tables.append(req.block_table)
    return ids, query_lens, seq_lens, tables


def _token_slice(req, start: int, end: int) -> list[int]:
    """Tokens start..end-1 without concatenating prompt and outputs (a decode step needs only
    the last output token; building the whole sequence per step is O(prompt) on the hot path)."""
    n_prompt = req.num_prompt_tokens
    if end <= n_prompt:
        return req.prompt_token_ids[start:end]
    if start >= n_prompt:
        return req.output_token_ids[start - n_prompt : end - n_prompt]
    return req.prompt_token_ids[start:] + req.output_token_ids[: end - n_prompt]

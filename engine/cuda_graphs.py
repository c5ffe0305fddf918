"""The decode step under CUDA graphs: one graph per batch-size bucket, so that a batch-1 step
replays a few hundred kernel launches as one (launch-bound otherwise: ~10 us per launch,
several per layer).

A graph replays fixed kernels on fixed addresses, so each bucket owns static inputs (token
ids, positions, slots, context lengths, block tables) that a step copies its batch into, and
static outputs (the logits) it reads back. A batch smaller than its bucket is padded with rows
that write no KV (slot -1) and attend to one token of block 0; their logits are dropped.

What the kernels decide on the host is fixed at capture: the attention metadata's host lists
say every row holds ``max_model_len`` tokens, so the split-K decode kernel
(kernels/triton_decode_splitk.py) is captured with the split count and split length of the
longest context; a shorter context leaves its later splits empty (they write max -inf, which
the reduction weights 0): correct, with fewer splits at work than an eager step would use.

Only where the Triton kernels serve the step (float and fp8 caches): the torch path masks by
the host lists, which a graph would fix at capture. Gated on CUDA; ``ModelRunner`` uses it where ``PDSERVE_CUDA_GRAPHS=1`` (off by default until
a GPU run has checked it: tests/test_cuda_graphs.py, ``-m gpu``).
"""

from __future__ import annotations

import os

import torch

from kernels import kv_int8, ops
from kernels.metadata import AttentionMetadata

# Batch sizes a graph is captured for (vLLM's are 1, 2, 4, then multiples of 8): a batch runs
# in the smallest bucket that holds it, so padding costs at most 2x rows at small batches
# (cheap: a decode step reads the weights once whatever its rows) and 12.5% past 64.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def graphs_enabled(device: torch.device | str) -> bool:
    """Whether a runner on ``device`` captures decode graphs: CUDA, and opted in."""
    return torch.device(device).type == "cuda" and os.environ.get("PDSERVE_CUDA_GRAPHS") == "1"


def buckets_for(max_num_seqs: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> list[int]:
    """The buckets to capture for a scheduler of ``max_num_seqs``: every bucket up to the first
    that holds ``max_num_seqs`` (a batch never needs a larger one)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs {max_num_seqs}: must be at least 1")
    chosen = []
    for size in sorted(buckets):
        chosen.append(size)
        if size >= max_num_seqs:
            break
    return chosen


def bucket_for(batch: int, buckets: list[int]) -> int | None:
    """The smallest captured bucket that holds ``batch`` rows; None (run eagerly) past them."""
    if batch < 1:
        raise ValueError(f"batch {batch}: a decode step has at least one sequence")
    return next((size for size in sorted(buckets) if size >= batch), None)


class _Bucket:
    """One bucket's static inputs, its metadata over them, its graph and its logits."""

    def __init__(self, size: int, max_model_len: int, block_size: int, device):
        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.size = size
        self.input_ids = zeros(size, dtype=torch.int64)
        self.positions = zeros(size, dtype=torch.int64)
        width = -(-max_model_len // block_size)
        self.meta = AttentionMetadata(
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            seq_lens=zeros(size),
            block_tables=zeros(size, width),
            slot_mapping=zeros(size, dtype=torch.int64),
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[max_model_len] * size,  # kernels size their launches for the longest
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def load(self, input_ids, positions, meta: AttentionMetadata) -> None:
        """Copy a batch of ``len(input_ids)`` decode rows in; pad the rest."""
        n, width = len(input_ids), meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.meta.seq_lens[:n].copy_(meta.seq_lens)
        self.meta.slot_mapping[:n].copy_(meta.slot_mapping)
        self.meta.block_tables[:n, :width].copy_(meta.block_tables)
        if n < self.size:  # padding rows: no KV written, one token of block 0 read
            self.input_ids[n:].zero_()
            self.positions[n:].zero_()
            self.meta.seq_lens[n:].fill_(1)
            self.meta.slot_mapping[n:].fill_(-1)
            self.meta.block_tables[n:].zero_()


class DecodeGraphs:
    """Captured decode steps of ``model`` over ``kv_caches``, one per bucket in ``buckets``."""

    def __init__(self, model, kv_caches, max_model_len: int, block_size: int, buckets: list[int]):
        self.model, self.kv_caches = model, kv_caches
        device = model.embed_tokens.weight.device
        self.buckets = {
            size: _Bucket(size, max_model_len, block_size, device) for size in sorted(buckets)
        }
        self.max_model_len = max_model_len
        self.table_width = -(-max_model_len // block_size)
        # The Triton kernels take context lengths from the device tensors; the torch path
        # (int8 caches, no Triton) masks by the host lists, which a graph fixes at capture.
        self.supported = ops.TRITON_AVAILABLE and not kv_int8.is_int8(kv_caches[0][0])
        self._pool = None  # one memory pool for every bucket's graph (never replayed at once)

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        hidden = self.model(bucket.input_ids, bucket.positions, bucket.meta, self.kv_caches)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self, sizes: list[int] | None = None) -> None:
        """Capture ``sizes`` (default: every bucket not captured yet), largest first so smaller
        ones reuse its memory; ``run`` captures a bucket on its first batch otherwise. Each
        runs eagerly first: Triton compiles on a first call, which a capture must not see."""
        todo = sizes if sizes is not None else list(self.buckets)
        for size in sorted(todo, reverse=True):
            bucket = self.buckets[size]
            if bucket.graph is not None:
                continue
            bucket.meta.slot_mapping.fill_(-1)  # warm-up and capture write no KV
            bucket.meta.seq_lens.fill_(1)
            self._forward(bucket)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                bucket.logits = self._forward(bucket)
            self._pool = graph.pool()
            bucket.graph = graph

    def can_run(self, meta: AttentionMetadata, layer_callback=None) -> bool:
        """A decode-only batch within the largest bucket and the captured context length."""
        return (
            self.supported
            and layer_callback is None
            and meta.is_decode_only
            and bucket_for(meta.num_seqs, list(self.buckets)) is not None
            and meta.max_seq_len <= self.max_model_len
            and meta.block_tables.shape[1] <= self.table_width
        )

    @torch.inference_mode()
    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """fp32 logits [batch, vocab] of one decode step, by replaying its bucket's graph."""
        bucket = self.buckets[bucket_for(meta.num_seqs, list(self.buckets))]
        if bucket.graph is None:
            self.capture([bucket.size])
        bucket.load(input_ids, positions, meta)
        bucket.graph.replay()
        # A copy: the next replay overwrites the static logits while these may still be read.
        return bucket.logits[: meta.num_seqs].clone()

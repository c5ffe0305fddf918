"""Attention metadata: what the paged-attention ops need to know about one batched forward.

A batch holds B sequences laid out back to back in one token dimension T (no padding).
Sequence i contributes the tokens ``query_start_loc[i]:query_start_loc[i+1]``; those tokens
sit at absolute positions ``seq_lens[i] - query_len_i ... seq_lens[i] - 1`` of the sequence,
so a prefill chunk attends causally to its own tokens *and* to every earlier token that is
already in the paged cache. A decode step is the special case query_len == 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # [B + 1] int32: cumulative query lengths; query tokens of seq i are q[qsl[i]:qsl[i+1]].
    query_start_loc: torch.Tensor
    # [B] int32: context length of seq i *after* this step (cached tokens + new tokens).
    seq_lens: torch.Tensor
    # [B, max_blocks_per_seq] int32: physical block ids of each sequence, padded with 0.
    block_tables: torch.Tensor
    # [T] int64: flat cache slot (block_id * block_size + offset) of each new token; -1 skips.
    slot_mapping: torch.Tensor
    # Host-side copies, so CPU paths and launch grids never synchronise with the device.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata from host lists (the engine's scheduler output)."""
        qsl = [0]
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            qsl.append(qsl[-1] + q_len)
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=0) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        return AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(
                len(block_tables), width
            ),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )

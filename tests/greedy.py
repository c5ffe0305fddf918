"""Greedy reference from transformers, and the comparison rule used by the equality tests."""

from __future__ import annotations

import torch

# A divergence is accepted only where transformers itself sees a near tie: the two candidate
# tokens' logits differ by less than this at the first differing step. Nothing else is loosened.
TIE_TOLERANCE = 1e-4


@torch.inference_mode()
def hf_greedy(hf_model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """``generate(do_sample=False)``; EOS suppressed (min_new_tokens) so lengths are fixed."""
    ids = torch.tensor([prompt_ids])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        pad_token_id=hf_model.config.eos_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.inference_mode()
def assert_same_greedy(hf_model, prompt_ids: list[int], ours: list[int], ref: list[int]) -> bool:
    """Assert equality token for token, allowing a divergence only at a logit near-tie.

    Returns True when the sequences are identical.
    """
    assert len(ours) == len(ref), f"length {len(ours)} != {len(ref)}"
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            continue
        logits = hf_model(torch.tensor([prompt_ids + ref[:i]])).logits[0, -1].float()
        gap = abs(float(logits[a] - logits[b]))
        assert gap < TIE_TOLERANCE, (
            f"diverged at step {i}: ours {a} vs transformers {b}, logit gap {gap:.3g} is no tie"
        )
        return False
    return True

"""Where a fast path's answer gap comes from, per item.

For the first answer token, with `a` the full recompute's greedy token:
- *margin* of a logit vector: logit[a] - max other logit (full's margin is its top-2 margin; an
  arm flips its first token exactly when its margin drops below 0);
- *KL over the answer set*: KL(p_full || p_arm) with both softmaxes restricted to the first tokens
  of every answer the set can have;
- *answer log-prob change*: log p_arm(a) - log p_full(a) over the full vocabulary.

The arm's margin change splits exactly into two parts through the block-masked oracle
(mmkv/request/oracle.py: the same chunks isolated, at the model's native positions, no cache surgery):
  rotation  = margin(arm) - margin(oracle)   how far the spliced KV is from exact re-positioning,
  isolation = margin(oracle) - margin(full)  what composing isolated chunks costs by itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmkv.engine import Engine
from mmkv.request.oracle import block_masked_logits


def answer_token_ids(engine: Engine, answers: Sequence[str]) -> list[int]:
    """First token of every possible answer (the answer set the KL runs over)."""
    tok = engine.adapter.tokenizer
    return sorted({tok(a, add_special_tokens=False)["input_ids"][0] for a in answers if a})


def margin(logits: torch.Tensor, token: int) -> float:
    """logit[token] - the largest other logit."""
    x = logits.double()
    others = torch.cat([x[:token], x[token + 1:]])
    return float(x[token] - others.max())


def answer_set_kl(ref: torch.Tensor, got: torch.Tensor, answer_ids: list[int]) -> float:
    p = torch.log_softmax(ref.double()[answer_ids], dim=0)
    q = torch.log_softmax(got.double()[answer_ids], dim=0)
    return float((p.exp() * (p - q)).sum())


def oracle_logits(engine: Engine, messages, seam_tokens: int, tenant: str = "") -> torch.Tensor:
    """Block-masked oracle at the model's native positions (a perfect re-rotation), [V]."""
    plan = engine.splice_plan(messages, rope_policy="native", tenant=tenant)
    return block_masked_logits(engine.adapter, plan.input_ids, plan.positions, plan.placements, seam_tokens,
                               engine.anchor_ids)[0].float().cpu()


def decompose(full: torch.Tensor, arm: torch.Tensor, oracle: torch.Tensor | None, answer_ids: list[int]) -> dict:
    """The per-item error record of one arm against `full` (and the oracle, for splice arms)."""
    a = int(full.argmax())
    m_full, m_arm = margin(full, a), margin(arm, a)
    out = {
        "full_margin": m_full,
        "margin_change": m_arm - m_full,
        "kl_answer_set": answer_set_kl(full, arm, answer_ids),
        "answer_logprob_change": float(torch.log_softmax(arm.double(), 0)[a] - torch.log_softmax(full.double(), 0)[a]),
        "first_token_flip": int(arm.argmax()) != a,
    }
    if oracle is not None:
        m_oracle = margin(oracle, a)
        out.update(rotation=m_arm - m_oracle, isolation=m_oracle - m_full,
                   rotation_max_abs=float((arm - oracle).abs().max()),
                   isolation_max_abs=float((oracle - full).abs().max()))
    return out

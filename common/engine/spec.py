"""Speculative decoding: the verification rule (pure tensor maths, no model, no cache).

For one sequence the draft proposed ``k`` tokens ``d[0..k-1]``; the target scored the k+1 positions
``[last, d0, …, d(k-1)]`` in one forward, giving ``p[0..k]`` (target probabilities after the
request's temperature/top-k/top-p/min-p) and the draft gave ``q[0..k-1]`` for its own proposals.

Greedy (temperature 0): accept ``d[i]`` while it equals ``argmax p[i]``; the first mismatch is
replaced by ``argmax p[i]``; if all ``k`` match, ``argmax p[k]`` is the bonus token. The output is
exactly plain greedy decoding.

Sampled: accept ``d[i]`` with probability ``min(1, p[i][d]/q[i][d])``; on the first rejection draw
from ``normalize(max(0, p[i] - q[i]))``; if all are accepted draw the bonus from ``p[k]``. This is
the standard rule (Leviathan et al. 2023; Chen et al. 2023) and leaves the output distributed as
the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Verdict:
    """``num_accepted`` draft tokens were kept, then ``next_token`` (correction or bonus) follows."""

    num_accepted: int
    next_token: int

    def tokens(self, draft_tokens: list[int]) -> list[int]:
        return list(draft_tokens[: self.num_accepted]) + [self.next_token]


def verify_greedy(target_logits: torch.Tensor, draft_tokens: list[int]) -> Verdict:
    """target_logits: [k+1, V]; draft_tokens: k ids."""
    return verify_greedy_ids(target_logits.argmax(dim=-1).tolist(), draft_tokens)


def verify_greedy_ids(best: list[int], draft_tokens: list[int]) -> Verdict:
    """best: the target's argmax at each of the k+1 positions; draft_tokens: k ids."""
    for i, token in enumerate(draft_tokens):
        if best[i] != token:
            return Verdict(i, best[i])
    return Verdict(len(draft_tokens), best[len(draft_tokens)])


def verify_sampled(p: torch.Tensor, q: torch.Tensor, draft_tokens: list[int],
                   generator: torch.Generator | None) -> Verdict:
    """p: [k+1, V] target probabilities; q: [k, V] draft probabilities the proposals were drawn from."""
    k = len(draft_tokens)
    if k:
        idx = torch.arange(k, device=p.device)
        tok = torch.tensor(draft_tokens, device=p.device)
        p_d = p[idx, tok]
        q_d = q[idx, tok]
        # u < p/q  ⇔  u*q < p, which avoids dividing by a zero draft probability.
        u = torch.rand(k, generator=generator, device=p.device, dtype=p.dtype)
        accepted = (u * q_d < p_d).tolist()
        for i in range(k):
            if not accepted[i]:
                residual = torch.clamp(p[i] - q[i], min=0.0)
                total = residual.sum()
                # p == q on the support makes the residual empty; then p itself is the right law.
                dist = residual / total if total > 0 else p[i]
                token = int(torch.multinomial(dist, 1, generator=generator).item())
                return Verdict(i, token)
    token = int(torch.multinomial(p[k], 1, generator=generator).item())
    return Verdict(k, token)

"""A decode step's greedy picks in one launch: each row's argmax and its logprob.

``sampler.greedy_picks`` in torch is ``argmax``, ``log_softmax`` (which writes a [B, V] fp32 tensor
only to read B values back) and ``gather``; the decode graph's head then casts both to float64 and
stacks them for one copy to the host: about six launches a step. Here one program per row reads its
logits twice (the second time mostly from L2): the maximum and its first index, then the sum of
``exp(x - max)``; the logprob of token i is ``(x[i] - max) - log(sum)``, as ``log_softmax`` computes it
(another summation order and exp: a few fp32 ulps from torch's). With ``token_ids`` given (a step
that sampled some rows) it is the logprob of those tokens, the same expression, so a greedy row
gets the same value whichever way its step was picked.

The reference is torch's ``argmax`` / ``log_softmax`` (``tests/gpu/test_triton_sample.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvferry.common.kernels.pdl import enter as pdl_enter, kw as pdl_kw

BLOCK_V = 2048  # logits a program reads a step


@triton.jit
def _pick_kernel(logits, ids, tokens, logprobs, pairs, V, stride, GIVEN: tl.constexpr, PAIRS: tl.constexpr,
                 BLOCK_V: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    offs = tl.arange(0, BLOCK_V)
    lane_max = tl.full((BLOCK_V,), -float("inf"), tl.float32)
    lane_at = tl.zeros((BLOCK_V,), dtype=tl.int64)
    for v0 in range(0, V, BLOCK_V):  # each lane's maximum and its first index
        at = v0 + offs
        x = tl.load(base + at, mask=at < V, other=-float("inf"))
        lane_at = tl.where(x > lane_max, at.to(tl.int64), lane_at)
        lane_max = tl.maximum(lane_max, x)
    top = tl.max(lane_max, 0)
    first = tl.min(tl.where(lane_max == top, lane_at, V), 0)  # the lowest index of the maximum, as argmax
    total = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        at = v0 + offs
        x = tl.load(base + at, mask=at < V, other=-float("inf"))
        total += tl.exp(x - top)
    log_sum = tl.log(tl.sum(total, 0))
    if GIVEN:
        token = tl.load(ids + row)
        logprob = (tl.load(base + token) - top) - log_sum
    else:
        token = first
        logprob = (top - top) - log_sum
        tl.store(tokens + row, token)
    tl.store(logprobs + row, logprob)
    if PAIRS:
        tl.store(pairs + 2 * row, token.to(tl.float64))
        tl.store(pairs + 2 * row + 1, logprob.to(tl.float64))


def picks(logits: torch.Tensor, token_ids: torch.Tensor | None = None,
          pairs: bool = False) -> tuple[torch.Tensor, ...]:
    """fp32 logits [B, V] (unit stride along V) -> (token ids [B] int64: the argmax, or ``token_ids``
    when given; their logprobs [B] fp32), plus with ``pairs`` a [B, 2] float64 (token id, logprob)."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"picks: fp32 logits [B, V] with unit stride, got {tuple(logits.shape)} {logits.dtype} "
                         f"strides {logits.stride()}")
    num_rows, vocab = logits.shape
    given = token_ids is not None
    tokens = token_ids if given else torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if given and (tokens.shape != (num_rows,) or tokens.dtype != torch.int64):
        raise ValueError(f"picks: token_ids [{num_rows}] int64, got {tuple(tokens.shape)} {tokens.dtype}")
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    out = torch.empty(num_rows, 2, dtype=torch.float64, device=logits.device) if pairs else logprobs
    if num_rows:
        _pick_kernel[(num_rows,)](logits, tokens.contiguous() if given else tokens, tokens, logprobs, out, vocab,
                                  logits.stride(0), GIVEN=given, PAIRS=pairs,
                                  BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)), num_warps=8, **pdl_kw())
    return (tokens, logprobs, out) if pairs else (tokens, logprobs)

"""Top logprobs: the most likely alternatives of a token, for the requests that ask for them.

A request asks for ``num`` alternatives (0 to ``MAX_TOP_LOGPROBS``) per generated token (chat
``top_logprobs``, completions ``logprobs``, SGLang ``top_logprobs_num``) and, on SGLang's
``/generate`` with ``logprob_start_len``, per prompt token. Values are ``log_softmax`` of the raw
logits (temperature-free, like the chosen token's logprob in ``Sampler.sample``), ordered from the
most likely down (``torch.topk``'s order).

``top_logprobs`` works on the device over only the rows that ask, and leaves the result there;
``with_tops`` brings a step's tokens, their logprobs and every asked row's alternatives to the host
in one copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvferry.common.kernels.h2d import to_device

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs and completions logprobs

# One token's alternatives: (token_id, logprob) pairs, most likely first.
TopList = list[tuple[int, float]]


@dataclass(frozen=True, slots=True)
class TopK:
    """The alternatives of some rows of a batch, on the logits' device.

    ``rows[i]`` is the batch row of ``ids[i]`` / ``logprobs[i]``; ``nums[i]`` how many of its
    ``k`` columns that row asked for. ids: [R, k] long; logprobs: [R, k] fp32."""

    rows: list[int]
    nums: list[int]
    ids: torch.Tensor
    logprobs: torch.Tensor


def top_logprobs(logits: torch.Tensor, nums: Sequence[int]) -> TopK | None:
    """The ``nums[b]`` most likely tokens of each row ``b`` of ``logits`` [B, V] that asks for
    some (``nums[b] > 0``), or None when no row does. No host copy."""
    if logits.shape[0] != len(nums):
        raise ValueError(f"logits has {logits.shape[0]} rows but {len(nums)} counts were given")
    rows = [b for b, n in enumerate(nums) if n > 0]
    if not rows:
        return None
    k = min(max(nums[b] for b in rows), logits.shape[-1])
    picked = logits[to_device(rows, logits.device)] if len(rows) < logits.shape[0] else logits
    logp = torch.log_softmax(picked.float(), dim=-1)
    values, ids = logp.topk(k, dim=-1)
    return TopK(rows, [min(nums[b], k) for b in rows], ids, values)


def with_tops(tokens: torch.Tensor, logprobs: torch.Tensor, tops: TopK | None) -> list[tuple]:
    """Per row ``(token, logprob)``, or ``(token, logprob, alternatives)`` for the rows in
    ``tops``; everything comes to the host in one device-to-host copy (ids < 2**53 are exact in
    float64)."""
    num_rows = tokens.shape[0]
    parts = [tokens.double(), logprobs.double()]
    if tops is not None:
        parts += [tops.ids.double().flatten(), tops.logprobs.double().flatten()]
    flat = torch.cat(parts).tolist()
    out: list[tuple] = [(int(flat[b]), flat[num_rows + b]) for b in range(num_rows)]
    if tops is None:
        return out
    k = tops.ids.shape[1]
    base_ids, base_lps = 2 * num_rows, 2 * num_rows + len(tops.rows) * k
    for i, (b, n) in enumerate(zip(tops.rows, tops.nums)):
        at = i * k
        alts = [(int(flat[base_ids + at + j]), flat[base_lps + at + j]) for j in range(n)]
        out[b] = (*out[b], alts)
    return out


def prompt_tops(logits: torch.Tensor, num: int) -> list[TopList]:
    """The ``num`` alternatives of every row of ``logits`` [n, V] (prompt positions), in one copy."""
    if num <= 0 or logits.shape[0] == 0:
        return [[] for _ in range(logits.shape[0])]
    tops = top_logprobs(logits, [num] * logits.shape[0])
    ids, lps = tops.ids[:, :num].tolist(), tops.logprobs[:, :num].double().tolist()
    return [list(zip(i, lp)) for i, lp in zip(ids, lps)]


def to_host(tops: TopK | None, *, non_blocking: bool = False) -> TopK | None:
    """``tops`` with its tensors copied into pinned host memory (on CUDA, queued behind the work that
    computes them, so an event recorded after this call covers the copy); as is on the CPU."""
    if tops is None or not tops.ids.is_cuda:
        return tops
    ids = torch.empty(tops.ids.shape, dtype=tops.ids.dtype, pin_memory=True)
    lps = torch.empty(tops.logprobs.shape, dtype=tops.logprobs.dtype, pin_memory=True)
    ids.copy_(tops.ids, non_blocking=non_blocking)
    lps.copy_(tops.logprobs, non_blocking=non_blocking)
    return TopK(tops.rows, tops.nums, ids, lps)


def attach(pairs: list[tuple], tops: TopK | None) -> list[tuple]:
    """``pairs`` (one (token, logprob) per row) with each asking row's alternatives appended; ``tops``
    must already be on the host (``to_host``)."""
    if tops is None:
        return pairs
    out = list(pairs)
    for row, n, ids, lps in zip(tops.rows, tops.nums, tops.ids.tolist(), tops.logprobs.double().tolist()):
        out[row] = (*out[row], list(zip(ids[:n], lps[:n])))
    return out


def spec_tops(logits: torch.Tensor, num: int) -> list[TopList]:
    """The ``num`` alternatives of each verified position of a speculative step, ``logits``
    [num_accepted + 1, V]; none without ``num``."""
    return prompt_tops(logits, num) if num > 0 else []

"""Penalties, logit bias and min_tokens: the changes a request asks for on the raw logits, before
its sampling transform. vLLM's definitions, in vLLM's order, per row of a batch:

1. min_tokens (`min_new_tokens`): while fewer tokens than that were generated, every stop token id
   (`stop_token_ids`, and the EOS ids unless `ignore_eos`) is -inf.
2. logit_bias: `logits[t] += bias[t]` for each listed token id.
3. repetition_penalty r: a token seen in the prompt or the output so far has its logit divided by
   r when positive, multiplied by r otherwise.
4. frequency_penalty f and presence_penalty p: `logits -= f * count + p * (count > 0)`, where
   count is how often the token occurs in the output so far (the prompt does not count).

Then `kvferry.common.sampling.sampler.probs` (temperature, top-k, top-p, min-p), or argmax for a greedy
row. The reported logprob of the chosen token stays log_softmax of the raw logits.

State: `TokenHistory` keeps on the device one row per sequence whose penalties need its tokens:
output counts [V] int32 and prompt presence [V] bool. A row is filled once from host ids, then
updated on the device from the sampled token tensor (`LogitAdjust.record`), so no step needs the
host to know the previous step's token. `LogitAdjust` is one step's inputs for the rows that ask
(device tensors, uploaded without a host sync); a batch in which no row asks builds none and the
sampler takes its plain path.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvferry.common.kernels.h2d import to_device
from kvferry.common.sampling.sampler import SamplingParams


MAX_CACHED_BIASES = 4096


def needs_history(p: SamplingParams) -> bool:
    """Whether the row's maths reads its token counts (any non-neutral penalty)."""
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def has_adjustments(p: SamplingParams) -> bool:
    """Whether the request changes its logits before sampling at all."""
    return needs_history(p) or bool(p.logit_bias) or p.min_new_tokens > 0


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> torch.Tensor:
    """Repetition, then frequency and presence penalties; neutral values leave a row exactly as
    it was. logits [R, V] fp32, counts [R, V] int (output occurrences), in_prompt [R, V] bool,
    repetition / frequency / presence [R] fp32 → a new [R, V] fp32."""
    seen = counts > 0
    penalty = torch.where(seen | in_prompt, repetition[:, None], 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    return logits - frequency[:, None] * counts - presence[:, None] * seen


class TokenHistory:
    """Device-side token history, one row per sequence that uses penalties: `counts` [rows, V]
    int32 (output tokens) and `in_prompt` [rows, V] bool. Grows by doubling; a released row is
    reused. `acquire` runs on the model thread, `release` may run on another (hence the lock).
    `eos_token_ids`: what min_tokens masks besides `stop_token_ids` (the tokenizer's EOS ids, the
    ones `kvferry.common.sampling.stops.StopChecker` stops on)."""

    def __init__(self, vocab_size: int, device: torch.device | str,
                 eos_token_ids: Collection[int] = ()) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.eos_token_ids = tuple(eos_token_ids)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self._free: list[int] = []
        self._lock = threading.Lock()
        # logit_bias tuple -> (ids, biases) arrays, by identity: a request's bias (up to 300
        # entries) is converted once, not at every step; the entry holds the tuple, so its id
        # cannot be reused while cached
        self._bias: OrderedDict[int, tuple[tuple, tuple[np.ndarray, np.ndarray]]] = OrderedDict()

    @property
    def num_rows(self) -> int:
        return self.counts.shape[0]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> int:
        """A row holding `prompt_ids`' presence and `output_ids`' counts."""
        with self._lock:
            if not self._free:
                self._grow()
            row = self._free.pop()
        self.counts[row].zero_()
        if output_ids:
            ids = to_device(list(output_ids), self.device, torch.long)
            self.counts[row].index_put_((ids,), _ones(len(output_ids), self.device), accumulate=True)
        self.in_prompt[row].zero_()
        if prompt_ids:
            self.in_prompt[row].index_fill_(0, to_device(list(prompt_ids), self.device, torch.long), True)
        return row

    def release(self, row: int) -> None:
        with self._lock:
            self._free.append(row)

    def record(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count `token_ids[i]` once more in row `rows[i]` (device tensors, [N] long)."""
        self.counts.index_put_((rows, token_ids), _ones(rows.shape[0], self.device), accumulate=True)

    def record_ids(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """`record` from host lists (speculative steps, whose accepted tokens the host has)."""
        if rows:
            self.record(to_device(list(rows), self.device, torch.long),
                        to_device(list(token_ids), self.device, torch.long))

    def bias_arrays(self, logit_bias: tuple[tuple[int, float], ...]) -> tuple[np.ndarray, np.ndarray]:
        """`logit_bias` as (ids int64, biases float32); model thread only."""
        hit = self._bias.get(id(logit_bias))
        if hit is not None and hit[0] is logit_bias:
            self._bias.move_to_end(id(logit_bias))
            return hit[1]
        ids, values = zip(*logit_bias)
        arrays = np.asarray(ids, dtype=np.int64), np.asarray(values, dtype=np.float32)
        self._bias[id(logit_bias)] = (logit_bias, arrays)
        if len(self._bias) > MAX_CACHED_BIASES:
            self._bias.popitem(last=False)
        return arrays

    def _grow(self) -> None:
        old = self.num_rows
        new = max(8, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old], in_prompt[:old] = self.counts, self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self._free.extend(range(new - 1, old - 1, -1))


def _ones(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, dtype=torch.int32, device=device)


@dataclass(frozen=True, slots=True)
class RowRequest:
    """What one batch row asks, in host values. `num_generated`: output tokens before the one this
    row picks. Token history comes from `slot` (a `TokenHistory` row) plus `extra_ids` (output
    tokens on top of it: a verify step's earlier proposals), or, without a slot, from
    `prompt_ids` alone (a prompt's first token: no output yet). `is_recorded`: count the picked
    token into `slot` (`LogitAdjust.record`)."""

    row: int
    params: SamplingParams
    num_generated: int
    slot: int | None = None
    prompt_ids: Sequence[int] = ()
    extra_ids: Sequence[int] = ()
    is_recorded: bool = False


def _stop_ids(p: SamplingParams, eos_token_ids: Collection[int]) -> list[int]:
    ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
    return sorted(ids)


@dataclass(frozen=True, slots=True)
class _Pairs:
    """(row, token) pairs of a batch, with a value each (bias) or none (mask)."""

    rows: torch.Tensor
    ids: torch.Tensor
    values: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class _Penalties:
    rows: torch.Tensor  # [P] batch rows
    counts: torch.Tensor  # [P, V] int32
    in_prompt: torch.Tensor  # [P, V] bool
    repetition: torch.Tensor  # [P] fp32
    frequency: torch.Tensor
    presence: torch.Tensor


@dataclass(frozen=True, slots=True)
class LogitAdjust:
    """One step's logit changes for the rows of a batch that ask for any (device tensors)."""

    mask: _Pairs | None
    bias: _Pairs | None
    penalties: _Penalties | None
    history: TokenHistory | None = None
    record_rows: torch.Tensor | None = None  # batch rows whose picked token is counted
    record_slots: torch.Tensor | None = None  # their TokenHistory rows

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] → a new fp32 [B, V] with the changes; `logits` itself is left as is."""
        out = logits.float().clone()
        if self.mask is not None:
            minus_inf = torch.full(self.mask.rows.shape, -math.inf, device=out.device)
            out.index_put_((self.mask.rows, self.mask.ids), minus_inf)
        if self.bias is not None:
            out.index_put_((self.bias.rows, self.bias.ids), self.bias.values, accumulate=True)
        pen = self.penalties
        if pen is not None:
            rows = apply_penalties(out.index_select(0, pen.rows), pen.counts, pen.in_prompt,
                                   pen.repetition, pen.frequency, pen.presence)
            out.index_copy_(0, pen.rows, rows)
        return out

    def record(self, token_ids: torch.Tensor) -> None:
        """Count each recorded row's picked token ([B] long, on the device) into its history."""
        if self.history is not None and self.record_rows is not None:
            self.history.record(self.record_slots, token_ids.index_select(0, self.record_rows))


def build_adjust(requests: Sequence[RowRequest], history: TokenHistory) -> LogitAdjust | None:
    """The device inputs of one step for `requests` (rows that ask for nothing may be left out),
    on `history`'s device; None when no row asks for anything."""
    device = history.device
    mask = [(r.row, t) for r in requests if r.num_generated < r.params.min_new_tokens
            for t in _stop_ids(r.params, history.eos_token_ids)]
    biased = [r for r in requests if r.params.logit_bias]
    penalized = [r for r in requests if needs_history(r.params)]
    recorded = [r for r in penalized if r.is_recorded and r.slot is not None]
    if not (mask or biased or penalized):
        return None
    return LogitAdjust(
        mask=_pairs(mask, device) if mask else None,
        bias=_bias_pairs(biased, history) if biased else None,
        penalties=_penalties(penalized, history, device) if penalized else None,
        history=history if recorded else None,
        record_rows=to_device([r.row for r in recorded], device, torch.long) if recorded else None,
        record_slots=to_device([r.slot for r in recorded], device, torch.long) if recorded else None)


def _bias_pairs(rows: list[RowRequest], history: TokenHistory) -> _Pairs:
    device = history.device
    arrays = [history.bias_arrays(r.params.logit_bias) for r in rows]
    batch_rows = np.repeat(np.asarray([r.row for r in rows], dtype=np.int64), [len(ids) for ids, _ in arrays])
    return _Pairs(to_device(batch_rows, device), to_device(np.concatenate([ids for ids, _ in arrays]), device),
                  to_device(np.concatenate([values for _, values in arrays]), device))


def _pairs(entries: list[tuple], device: torch.device) -> _Pairs:
    columns = list(zip(*entries))
    values = to_device(list(columns[2]), device, torch.float32) if len(columns) > 2 else None
    return _Pairs(to_device(list(columns[0]), device, torch.long),
                  to_device(list(columns[1]), device, torch.long), values)


def _penalties(rows: list[RowRequest], history: TokenHistory, device: torch.device) -> _Penalties:
    num, vocab = len(rows), history.vocab_size
    with_slot = [i for i, r in enumerate(rows) if r.slot is not None]
    slots = to_device([rows[i].slot for i in with_slot], device, torch.long) if with_slot else None
    if len(with_slot) == num:  # decode and verify: every row has its history (gathered copies)
        counts, in_prompt = history.counts.index_select(0, slots), history.in_prompt.index_select(0, slots)
    else:
        counts = torch.zeros(num, vocab, dtype=torch.int32, device=device)
        in_prompt = torch.zeros(num, vocab, dtype=torch.bool, device=device)
        if with_slot:
            at = to_device(with_slot, device, torch.long)
            counts.index_copy_(0, at, history.counts.index_select(0, slots))
            in_prompt.index_copy_(0, at, history.in_prompt.index_select(0, slots))
    extra = [(i, t) for i, r in enumerate(rows) for t in r.extra_ids]
    if extra:
        pairs = _pairs(extra, device)
        counts.index_put_((pairs.rows, pairs.ids), _ones(len(extra), device), accumulate=True)
    prompt = [(i, t) for i, r in enumerate(rows) if r.slot is None for t in r.prompt_ids]
    if prompt:
        pairs = _pairs(prompt, device)
        in_prompt.index_put_((pairs.rows, pairs.ids), torch.ones(len(prompt), dtype=torch.bool, device=device))
    params = [r.params for r in rows]
    return _Penalties(
        rows=to_device([r.row for r in rows], device, torch.long), counts=counts, in_prompt=in_prompt,
        repetition=to_device([p.repetition_penalty for p in params], device, torch.float32),
        frequency=to_device([p.frequency_penalty for p in params], device, torch.float32),
        presence=to_device([p.presence_penalty for p in params], device, torch.float32))

"""Sampling parameters, the shared probability transform and the sampler.

Reading path: `SamplingParams` (what a request asks; its ranges), `probs` (temperature, top-k,
top-p, min-p; also used by speculative decoding's accept/reject), `Sampler.sample`; then
`kvferry.common.sampling.stops` (when a request ends).

Penalties (repetition, frequency, presence), logit bias and `min_new_tokens` change the raw
logits before `probs` (common/sampling/penalties.py, through `Sampler.sample`'s `adjust`). Structured output: `grammar`, applied by
the runner through common/sampling/grammar.py.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvferry.common.errors import RequestError
from kvferry.common.kernels.h2d import to_device

if TYPE_CHECKING:
    from kvferry.common.sampling.grammar import GrammarSpec

logger = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
MAX_N = 32  # completions per prompt (n): the prompt's KV is computed once and forked
MAX_SEED = 2**63
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
MAX_BIAS = 100.0  # |bias| of one logit_bias entry (OpenAI's range)
# Below this temperature logits / T leaves fp32's useful range; such requests are greedy, as in
# SGLang (its _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-6

@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops. `temperature` 0 means greedy; `top_k` -1 or 0
    means off; `max_new_tokens` 0 means prefill only; `n` completions share one prompt KV."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    # vLLM's definitions, applied on the raw logits before the transform above
    # (common/sampling/penalties.py); neutral: 1.0, 0.0, 0.0, no bias, 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), by token id
    min_new_tokens: int = 0  # no stop (token or string) is honoured before this many tokens
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string/token in the text (SGLang's name)
    n: int = 1
    grammar: GrammarSpec | None = None  # structured output: common/sampling/grammar.py

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def check_ranges(self, names: Mapping[str, str] | None = None) -> None:
        """Raise `RequestError` for a value out of range; `names` maps a field to the client's
        name for it (max_new_tokens → max_tokens)."""
        def bad(field: str, allowed: str, value: Any) -> RequestError:
            name = (names or {}).get(field, field)
            return RequestError(f"{name} must be {allowed}, got {value!r}")

        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise bad("temperature", ">= 0 and finite", self.temperature)
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if self.top_k < -1:
            raise bad("top_k", ">= -1 (-1 or 0 disables it)", self.top_k)
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]", self.min_p)
        if self.max_new_tokens < 0:
            raise bad("max_new_tokens", ">= 0", self.max_new_tokens)
        if self.seed is not None and not 0 <= self.seed < MAX_SEED:
            raise bad("seed", "in [0, 2**63)", self.seed)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} strings", len(self.stop))
        if any(s == "" for s in self.stop):
            raise bad("stop", "non-empty strings", list(self.stop))
        if not 1 <= self.n <= MAX_N:
            raise bad("n", f"in [1, {MAX_N}] (completions of the prompt)", self.n)
        self._check_adjustments(bad, (names or {}).get("max_new_tokens", "max_new_tokens"))

    def _check_adjustments(self, bad: Callable[[str, str, Any], RequestError], limit_name: str) -> None:
        if not 0 < self.repetition_penalty <= 2:
            raise bad("repetition_penalty", "in (0, 2] (1 is off)", self.repetition_penalty)
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "in [-2, 2] (0 is off)", getattr(self, name))
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise bad("min_new_tokens", f"in [0, {limit_name}={self.max_new_tokens}]", self.min_new_tokens)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"an object of at most {MAX_LOGIT_BIAS} entries", len(self.logit_bias))
        for token_id, bias in self.logit_bias:
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise bad("logit_bias", f"an object of biases in [-{MAX_BIAS:g}, {MAX_BIAS:g}]", {str(token_id): bias})
            if token_id < 0:
                raise bad("logit_bias", "an object whose keys are token ids >= 0", {str(token_id): bias})

    def validate(self, vocab_size: int, max_context_tokens: int | None = None,
                 prompt_tokens: int | None = None) -> None:
        """Raise `RequestError` naming the field and its allowed range for the first bad value."""
        self.check_ranges()
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise RequestError(
                    f"stop_token_ids must be in [0, {vocab_size}) (vocab_size), got {token_id}")
        for token_id, _ in self.logit_bias:
            if token_id >= vocab_size:
                raise RequestError(f"logit_bias must be an object whose keys are token ids in "
                                   f"[0, {vocab_size}) (vocab_size), got {token_id}")
        if max_context_tokens is not None and prompt_tokens is not None:
            if prompt_tokens + self.max_new_tokens > max_context_tokens:
                raise RequestError(
                    f"prompt tokens ({prompt_tokens}) + max_new_tokens ({self.max_new_tokens}) "
                    f"= {prompt_tokens + self.max_new_tokens} exceeds the context of "
                    f"{max_context_tokens} tokens; shorten the prompt or lower max_new_tokens")


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A per-request generator; seeded requests draw the same tokens whatever their batch."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()  # non-deterministic, from the OS
    else:
        generator.manual_seed(seed)
    return generator


def _mask_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    # scaled: [B, V] logits / T; top_k: [B] long (V when off); top_p: [B] (> 1 when off)
    # A stable sort keeps the lowest index first among ties, as argmax does, so top_k=1 == greedy.
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], -math.inf)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it
    # already does. The top token is always kept. Top-p acts on the top-k renormalized mass.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    return torch.empty_like(scaled).scatter_(-1, sorted_idx, sorted_logits)


def probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Per-row sampling distribution: temperature, then top-k, top-p, min-p; greedy rows are
    one-hot at argmax. Every row sums to 1. Speculative decoding uses it for both models.
    logits: [B, V] fp32 → [B, V] fp32."""
    if logits.shape[0] != len(params):
        raise ValueError(f"logits has {logits.shape[0]} rows but {len(params)} params were given")
    logits = logits.float()
    device, vocab_size = logits.device, logits.shape[-1]
    is_greedy = [p.is_greedy for p in params]
    temps = to_device([1.0 if g else p.temperature for p, g in zip(params, is_greedy)], device)
    scaled = logits / temps[:, None]
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_ps = [p.top_p if p.top_p < 1 else 2.0 for p in params]
    if any(k < vocab_size for k in top_ks) or any(p <= 1 for p in top_ps):
        scaled = _mask_top_k_top_p(scaled, to_device(top_ks, device), to_device(top_ps, device))
    out = torch.softmax(scaled, dim=-1)
    if any(p.min_p > 0 for p in params):
        min_ps = to_device([p.min_p for p in params], device)
        threshold = out.max(dim=-1, keepdim=True).values * min_ps[:, None]
        out = out.masked_fill(out < threshold, 0.0)
        out = out / out.sum(dim=-1, keepdim=True)
    if any(is_greedy):
        # scatter, not F.one_hot: one_hot checks its indices on the host (a sync on CUDA)
        one_hot = torch.zeros_like(out).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        out = torch.where(to_device(is_greedy, device)[:, None], one_hot, out)
    return out


def sample_from_probs(p: torch.Tensor,
                      generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row of p [B, V]; each row uses its own generator so a seeded request's
    draws do not depend on its neighbours. Rows without a generator share the default RNG."""
    out = torch.empty(p.shape[0], dtype=torch.long, device=p.device)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        rows = to_device(shared, p.device)
        out[rows] = torch.multinomial(p[rows], 1).squeeze(-1)
    for i, generator in enumerate(generators):
        if generator is not None:
            out[i] = torch.multinomial(p[i], 1, generator=generator).squeeze(-1)
    return out


class LogitsAdjust(Protocol):
    """What a batch's rows ask to change in the raw logits before sampling (penalties, logit
    bias, min_tokens: `kvferry.common.sampling.penalties.LogitAdjust`)."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor: ...

    def record(self, token_ids: torch.Tensor) -> None: ...


class Sampler:
    """Picks the next token of every row of a batch."""

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None],
               adjust: LogitsAdjust | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [B, V] → (token_ids [B] long, logprobs [B] fp32). The logprob is log_softmax of
        the raw logits at the chosen token (temperature-free, as SGLang reports it). `adjust`
        (None: no row asks) changes the logits the token is picked from, then counts the picks."""
        if not logits.shape[0] == len(params) == len(generators):
            raise ValueError(f"batch mismatch: {logits.shape[0]} logit rows, {len(params)} "
                             f"params, {len(generators)} generators")
        logits = logits.float()
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if adjust is None and not sampled:
            return greedy_picks(logits)
        chosen = logits if adjust is None else adjust.apply(logits)
        token_ids = chosen.argmax(dim=-1)
        if sampled:
            rows = to_device(sampled, logits.device)
            p = probs(chosen[rows], [params[i] for i in sampled])
            token_ids[rows] = sample_from_probs(p, [generators[i] for i in sampled])
        logprobs = _logprobs_of(logits, token_ids)
        if adjust is not None:
            adjust.record(token_ids)
        return token_ids, logprobs


# On CUDA, the argmax and logprobs in one launch (``triton_sample.picks``); False: torch's ops
# (bench/engine.py --picks-ab)
PICK_KERNEL = True


def _picks_kernel(logits: torch.Tensor):
    """``triton_sample`` where it runs these logits (CUDA, fp32, rows of unit stride), else None."""
    if not (PICK_KERNEL and logits.is_cuda and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(-1) == 1):
        return None
    from kvferry.common.kernels import triton_sample  # triton: only on CUDA here

    return triton_sample


def greedy_picks(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits [B, V] -> (argmax token ids [B], their logprobs [B]): ``Sampler.sample`` for
    greedy rows with nothing to adjust. The decode graphs capture the same computation
    (``cuda_graph.StepGraphs``, ``greedy_pairs``), so a step picks the same tokens and logprobs either way."""
    kernel = _picks_kernel(logits)
    if kernel is not None:
        return kernel.picks(logits)
    token_ids = logits.argmax(dim=-1)
    return token_ids, _logprobs_of(logits, token_ids)


def greedy_pairs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``greedy_picks`` as (token ids [B] int64, [B, 2] float64 pairs of token id and logprob), the
    pairs for one copy to the host (one launch on CUDA)."""
    kernel = _picks_kernel(logits)
    if kernel is not None:
        tokens, _, pairs = kernel.picks(logits, pairs=True)
        return tokens, pairs
    tokens, logprobs = greedy_picks(logits)
    return tokens, torch.stack([tokens.double(), logprobs.double()], dim=1)


def _logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log_softmax of the raw logits at each row's token (temperature-free, as SGLang reports it);
    on CUDA as ``greedy_picks`` computes it, so a greedy row's logprob does not depend on its step."""
    kernel = _picks_kernel(logits)
    if kernel is not None and token_ids.dtype == torch.int64:
        return kernel.picks(logits, token_ids)[1]
    return torch.log_softmax(logits, dim=-1).gather(-1, token_ids[:, None]).squeeze(-1)

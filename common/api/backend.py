"""What the HTTP layer needs from a daemon: the `Backend` protocol and the values that cross it.

The prefill daemon, the decode daemon and a colocated single-process server each implement
`Backend`; `kvferry.common.api.app.create_app` turns any of them into the same HTTP API. The HTTP layer
parses, validates and tokenizes; the backend only ever sees `GenerateInput`, and answers with a
stream of `GenerateEvent`s.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvferry.common.sampling.sampler import SamplingParams

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True, slots=True)
class BootstrapInfo:
    """Where the prefill side of a request lives: the prefill host, its ZeroMQ bootstrap port, and
    the room id that both daemons use to name the request's KV. Routers choose all three."""

    host: str
    port: int
    room: int


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """One prompt to run. `prompt_ids` is already tokenized (chat template applied);
    `logprob_start_len` is normalized to `0 <= n <= len(prompt_ids)`: with `return_logprob`, the
    backend reports input logprobs for `prompt_ids[logprob_start_len:]`.

    `bootstrap` is None on a colocated backend, and on a prefill backend asked by vllm-router to
    choose the room itself (`kv_transfer_params["do_remote_decode"]` true): the backend then puts
    the chosen `{"bootstrap_host", "bootstrap_port", "bootstrap_room"}` in the final event's
    `meta["kv_transfer_params"]`, which the router copies into the decode request.
    `kv_transfer_params` is the request's object as received (vllm-router's path), else None.
    `top_logprobs_num` (0 to 20): alternatives per output token (and per input token in the
    logprob range), in `GenerateEvent.top_logprobs` and `meta["input_top_logprobs"]`. A
    cancellation at or past `deadline` is the request deadline, not a client gone."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    return_logprob: bool
    logprob_start_len: int
    bootstrap: BootstrapInfo | None
    kv_transfer_params: dict[str, Any] | None
    top_logprobs_num: int = 0
    deadline: float | None = None  # the request's deadline, in event loop time (None: none known)


@dataclass(slots=True)
class GenerateEvent:
    """A step of one request's output. `token_ids`, `logprobs` and `text` are deltas since the
    previous event (`logprobs[i]` belongs to `token_ids[i]`; empty when logprobs were not asked
    for). The last event has `finished=True` and an SGLang-style `finish_reason`:
    `{"type": "stop", "matched": id | str}`, `{"type": "length", "length": n}` or
    `{"type": "abort", "message": str}`. With `params.n > 1` the events of the n completions
    interleave, each tagged with its `index`, and each completion ends with its own finished event.

    `top_logprobs[i]` holds the alternatives of `token_ids[i]`, `(token_id, logprob)` pairs, most
    likely first (empty when none were asked for).

    `meta` holds extra SGLang `meta_info` keys; keys the HTTP layer reads: `prompt_tokens`,
    `completion_tokens`, `cached_tokens`, `e2e_latency` (it fills those it does not get),
    `input_token_logprobs` (list of float or None, one per token of
    `prompt_ids[logprob_start_len:]`, on the first event so that streams carry it from the start;
    a prefill whose decode returns them sends [], because sglang-router prepends the prefill's list
    to the decode's), `input_top_logprobs` (with `top_logprobs_num`: per token of that range its
    alternatives, None where there are none) and `kv_transfer_params` (dict, echoed at the top
    level of the response for vllm-router). Other keys (`spec_accept_rate`, ...) are passed
    through."""

    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    index: int = 0  # which of the prompt's `params.n` completions this event belongs to


class TokenizerLike(Protocol):
    """The part of `kvferry.common.text.tokenizer.Tokenizer` the HTTP layer uses."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str | list[int]:
        """The rendered prompt text (encoded without special tokens: the template writes
        them), or token ids."""
        ...


class Backend(Protocol):
    """A daemon as the HTTP layer sees it. `role` is one of `ROLES`.

    `generate` is an async generator. It raises `kvferry.common.errors.DisaggError` subclasses (their
    `http_status` becomes the answer's status). The HTTP layer always closes it (`aclose()`, or
    cancellation of the task iterating it) when it stops early — client gone, deadline passed, a
    sibling prompt of a batch failed — so the backend must abort the request and free its pages
    in a `finally`."""

    role: str
    tokenizer: TokenizerLike
    model_name: str
    model_path: str
    max_context_tokens: int

    def is_ready(self) -> bool: ...

    def generate(self, inp: GenerateInput) -> AsyncIterator[GenerateEvent]: ...

    def server_info(self) -> dict[str, Any]: ...

    def metrics_text(self) -> bytes | None: ...

    async def health_generate(self) -> None: ...

    # Optional: ``count_outcome(outcome)``, called by the HTTP layer for a generation request that
    # ended before any generator was opened (a bad body: "refused"; the client gone while its body
    # was read: "cancelled"), so that every request has one outcome (common/api/outcome.py).


class DaemonView(Protocol):
    """What ``DaemonBackend`` reads of the daemon that owns it: identity, health, metrics."""

    tokenizer: TokenizerLike
    model_name: str
    max_context_tokens: int
    is_serving: bool

    @property
    def config(self) -> Any: ...

    @property
    def metrics(self) -> Any: ...

    def server_info(self) -> dict: ...

    def flush_cache(self) -> tuple[int, dict]: ...


class DaemonBackend:
    """What the prefill and decode backends share: they read their identity and health from the
    daemon that owns them, and count every request's outcome in its metrics. Subclasses set
    ``role`` and implement ``run``, the generator behind ``generate``, which moves the request's
    ``Outcome`` phase and names ``ok`` before its last event (common/api/outcome.py)."""

    role = ""

    def __init__(self, daemon: DaemonView):
        self.daemon = daemon
        self.tokenizer = daemon.tokenizer
        self.model_name = daemon.model_name
        self.model_path = daemon.config.model
        self.max_context_tokens = daemon.max_context_tokens

    def is_ready(self) -> bool:
        return self.daemon.is_serving

    def generate(self, inp: GenerateInput) -> AsyncIterator[GenerateEvent]:
        from kvferry.common.api.outcome import Outcome, counted

        outcome = Outcome(self.count_outcome, self.role, inp.request_id, inp.deadline)
        return counted(self.run(inp, outcome), outcome)

    def run(self, inp: GenerateInput, outcome: Any) -> AsyncIterator[GenerateEvent]:
        raise NotImplementedError

    def count_outcome(self, outcome: str) -> None:
        self.daemon.metrics.requests.labels(outcome=outcome).inc()

    def server_info(self) -> dict:
        return self.daemon.server_info()

    def flush_cache(self) -> tuple[int, dict]:
        """``/flush_cache``: (HTTP status, body) from the daemon's prefix cache."""
        return self.daemon.flush_cache()

    def metrics_text(self) -> bytes:
        return self.daemon.metrics.render()

    async def health_generate(self) -> None:
        from kvferry.common.errors import OverloadedError

        if not self.daemon.is_serving:
            raise OverloadedError(f"{self.role} is not serving (starting or draining)")

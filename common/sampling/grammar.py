"""Structured output: grammars compiled by xgrammar, one matcher per constrained sequence.

Reading path: `GrammarSpec` (what a request asks: a JSON schema, a regex or an EBNF grammar, and
the client's name for the field, which every error names), `GrammarCache` (the model's vocabulary
as xgrammar's `TokenizerInfo`, compilation, a bounded LRU of compiled grammars keyed by
(kind, text); `matcher_async` compiles on the executor its daemon owns, never on the event loop),
`GrammarMatcher` (one sequence's parser state: the next-token bitmask, advancing by a token),
`mask_logits` (what the runner calls on a step's logits before sampling), `DraftMasks` (the
masks of a speculative step: the draft proposes under the grammar, the target verifies under it).

Who calls what: the prefill samples the first token under the grammar (`ModelRunner.prefill`
masks its logits); the decode builds its own matcher, which the first token (from the aux record)
advances when the sequence joins the batch; each decode step is masked (`ModelRunner.decode`,
`DraftMasks` when it speculates), and every token kept advances the matcher
(`kvferry.common.engine.output.OutputTracker`, the one place a matcher moves for good). A sequence ends
when its matcher rejects a token (an abort: masking makes that a bug) or terminates (it accepted a
stop token: finish reason stop). A stop token is allowed only where the grammar is complete, as
xgrammar's masks say.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from kvferry.common.errors import RequestError

KINDS = ("json_schema", "regex", "ebnf")
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # OpenAI's {"type": "json_object"}, as SGLang maps it
ANY_JSON = "$$ANY$$"  # SGLang's json_schema value for any JSON value
DEFAULT_CACHE_ENTRIES = 256
MAX_GRAMMAR_CHARS = 1 << 20
# A whitespace run inside JSON is at most this long, so that a model cannot spin on spaces
# forever between two values (xgrammar's max_whitespace_cnt); enough for indented output.
MAX_JSON_WHITESPACE = 32
# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: " and sometimes "Check failed: ...".
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A request's output constraint. `kind`: json_schema (`text` a JSON schema as a string, or
    `ANY_JSON`), regex, or ebnf (xgrammar's EBNF, `root ::= ...`). `field`: the client's name of
    the field it came from (sampling_params.regex, response_format), named by every error."""

    kind: str
    text: str
    field: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.text


def tokenizer_info(tokenizer: Any, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of `tokenizer` (kvferry.common.text.tokenizer.Tokenizer over a `tokenizers`
    backend), over the model's `vocab_size` (the width of its logits): ids past the tokenizer's
    vocabulary are never allowed, tokenizer ids past the model's are dropped. Special tokens are
    passed as empty strings, which xgrammar never lets a grammar produce: their text
    ("<|eot_id|>") would otherwise count as characters. Stop tokens are the tokenizer's
    end-of-sequence ids. The vocabulary type and prefix space come from xgrammar's own detection
    on tokenizer.json, the one its from_huggingface uses (a private function: xgrammar is pinned)."""
    backend = tokenizer.backend
    special = {i for i, added in backend.get_added_tokens_decoder().items() if added.special}
    encoded = [""] * vocab_size
    for text, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size and token_id not in special:
            encoded[token_id] = text
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=list(tokenizer.eos_token_ids), add_prefix_space=meta["add_prefix_space"])


def xgrammar_message(exc: Exception) -> str:
    """xgrammar's error text without its timestamp and source-file prefix."""
    return _NOISE.sub("", str(exc).strip()).strip()


class GrammarMatcher:
    """One sequence's position in its grammar. `error` is set when a token was rejected; the
    matcher is `is_terminated` once it accepted a stop token (the grammar was complete)."""

    def __init__(self, compiled: xgr.CompiledGrammar, spec: GrammarSpec):
        self.spec = spec
        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)
        self.error: str | None = None

    def fresh(self) -> GrammarMatcher:
        """A matcher of the same grammar at its start (another completion of the same request)."""
        return GrammarMatcher(self.compiled, self.spec)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    @property
    def is_done(self) -> bool:
        return self.error is not None or self.matcher.is_terminated()

    def is_completed(self) -> bool:
        """The tokens so far form a complete string of the grammar (no stop token needed)."""
        return self.matcher.is_completed()

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`; False (and `error` set) when the grammar does not allow it."""
        if self.error is not None:
            return False
        if not self.matcher.accept_token(int(token_id)):
            self.error = f"token {token_id} is not allowed by the grammar of {self.spec.field}"
            return False
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` ([B, ceil(V / 32)] int32, CPU)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


def mask_logits(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor:
    """Set to -inf every token the grammar of each constrained row forbids next; rows without a
    matcher (or whose matcher is done: the sequence is ending) are left as they are. Returns the
    logits to sample from: `logits` itself when no row is constrained, else fp32 logits masked in
    place on their device. logits: [B, V]."""
    rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_done]
    if not rows:
        return logits
    logits = logits.float()
    # [B, ceil(V / 32)] int32, all allowed; filled on the host while the forward runs on the device,
    # pinned there so that its copy up does not wait for that forward
    shape = xgr.get_bitmask_shape(logits.shape[0], logits.shape[-1])
    bitmask = torch.full(shape, -1, dtype=torch.int32, pin_memory=logits.is_cuda)
    for i in rows:
        matchers[i].fill(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
    return logits


class DraftMasks:
    """The grammar masks of one speculative step, for the rows that have a grammar.

    At draft step j a row's matcher stands after its proposals d0..d(j-1): the mask it gives then
    restricts the draft's pick (`draft`), and is also what the target's row j must be verified
    under (`verify`); the proposal then advances the matcher for a while (`accept`). `close` fills
    the mask after all k proposals (the bonus position) and rolls every matcher back to where it
    was: the tokens the target keeps advance it for good (`OutputTracker`). A row whose grammar
    terminated among its proposals (a stop token) is not masked past it: nothing after a stop
    token is kept. Greedy and sampled verification of masked draft and target distributions then
    give exactly what plain constrained decoding gives (greedy) or its distribution (sampled)."""

    def __init__(self, matchers: Sequence[GrammarMatcher | None], k: int):
        self.matchers = matchers
        self.k = k
        self.rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_done]
        self.masks: dict[int, torch.Tensor] = {}  # row -> [k + 1, ceil(V / 32)] int32, host
        self._live = set(self.rows)  # rows whose matcher can still give a mask
        self._num_accepted = dict.fromkeys(self.rows, 0)

    def draft(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """The draft's logits of `step` ([B, V]), masked on the constrained rows."""
        if not self.rows:
            return logits
        if not self.masks:
            shape = xgr.get_bitmask_shape(self.k + 1, logits.shape[-1])
            self.masks = {i: torch.full(shape, -1, dtype=torch.int32) for i in self.rows}
        bitmask = torch.full(xgr.get_bitmask_shape(*logits.shape), -1, dtype=torch.int32)
        for i in self._live:
            self.matchers[i].fill(self.masks[i], step)
            bitmask[i] = self.masks[i][step]
        logits = logits.float()
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=self.rows)
        return logits

    def accept(self, row: int, token: int) -> None:
        """Advance row `row`'s matcher by its proposal, for the rest of this step only."""
        if row not in self._live:
            return
        matcher = self.matchers[row].matcher
        if not matcher.accept_token(int(token)):  # a masked pick always passes; masks stay open past it
            self._live.discard(row)
            return
        self._num_accepted[row] += 1
        if matcher.is_terminated():
            self._live.discard(row)

    def close(self) -> None:
        """Fill the masks after the last proposal, then roll each matcher back to the step's start."""
        for i in self._live:
            self.matchers[i].fill(self.masks[i], self.k)
        for i, n in self._num_accepted.items():
            if n:
                self.matchers[i].matcher.rollback(n)

    def verify(self, target_logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """The target's logits ([k + 1, V] per row) with each constrained row masked, row j by the
        grammar after that row's proposals d0..d(j-1)."""
        out = list(target_logits)
        for i in self.rows:
            logits = out[i].float()
            xgr.apply_token_bitmask_inplace(logits, self.masks[i].to(logits.device))
            out[i] = logits
        return out


class GrammarCache:
    """Compiles grammars for one model's vocabulary and keeps the last `max_entries` of them.
    `compile` blocks (run it on `executor`); `matcher_async` answers a cached grammar without
    leaving the loop. An invalid grammar raises `RequestError` naming the spec's field with
    xgrammar's message."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, executor: Executor | None = None,
                 max_entries: int = DEFAULT_CACHE_ENTRIES, observe: Callable[[str, float], None] | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.executor = executor
        self.max_entries = max_entries
        self.observe = observe or (lambda result, seconds: None)  # ("cached" | "compiled" | "invalid", seconds)
        self._compiled: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._compiled)

    def cached(self, spec: GrammarSpec) -> xgr.CompiledGrammar | None:
        with self._lock:
            compiled = self._compiled.get(spec.key)
            if compiled is not None:
                self._compiled.move_to_end(spec.key)
            return compiled

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        compiled = self.cached(spec)
        if compiled is not None:
            self.observe("cached", 0.0)
            return compiled
        started = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except RequestError:
            self.observe("invalid", time.perf_counter() - started)
            raise
        self.observe("compiled", time.perf_counter() - started)
        with self._lock:
            self._compiled[spec.key] = compiled
            while len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        return GrammarMatcher(self.compile(spec), spec)

    async def matcher_async(self, spec: GrammarSpec) -> GrammarMatcher:
        compiled = self.cached(spec)
        if compiled is None:
            loop = asyncio.get_running_loop()
            compiled = await loop.run_in_executor(self.executor, self.compile, spec)
        else:
            self.observe("cached", 0.0)
        return GrammarMatcher(compiled, spec)

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if len(spec.text) > MAX_GRAMMAR_CHARS:
            raise RequestError(f"{spec.field} has {len(spec.text)} characters; at most {MAX_GRAMMAR_CHARS} are served")
        if self._compiler is None:
            with self._lock:
                if self._compiler is None:
                    info = tokenizer_info(self.tokenizer, self.vocab_size)
                    self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        try:
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.text)
            if spec.kind == "ebnf":
                return self._compiler.compile_grammar(spec.text)
            if spec.text == ANY_JSON:
                return self._compiler.compile_builtin_json_grammar()
            json.loads(spec.text)  # a clearer message than xgrammar's for text that is no JSON
            return self._compiler.compile_json_schema(spec.text, any_whitespace=True,
                                                      max_whitespace_cnt=MAX_JSON_WHITESPACE)
        except json.JSONDecodeError as exc:
            raise RequestError(f"{spec.field} is not valid JSON: {exc}") from None
        except (RuntimeError, ValueError, TypeError) as exc:
            raise RequestError(f"{spec.field} is not a valid {_NAMES[spec.kind]}: {xgrammar_message(exc)}") from None


_NAMES = {"json_schema": "JSON schema", "regex": "regular expression", "ebnf": "EBNF grammar"}

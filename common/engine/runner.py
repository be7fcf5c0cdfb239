"""The forward steps both daemons and the colocated engine share (synchronous; run on an executor).

``ModelRunner`` owns a target model (and optionally a draft) with their KV caches and page
allocators. It knows nothing about HTTP, ZeroMQ or NIXL: the prefill daemon calls ``prefill``,
the decode daemon calls ``prefill_draft`` and ``decode``, the colocated engine calls all three.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvferry.common.engine.admission import Admission
from kvferry.common.engine.cuda_graph import StepGraphs
from kvferry.common.engine.penalty_inputs import decode_adjust, prefill_adjust, record_accepted, verify_logits
from kvferry.common.engine.sequence import Sequence
from kvferry.common.engine.spec import Verdict, verify_greedy_ids, verify_sampled
from kvferry.common.sampling.grammar import DraftMasks, mask_logits
from kvferry.common.cache.kv_cache import PageAllocator
from kvferry.common.cache.pool import KvPool
from kvferry.common.kernels.h2d import to_device
from kvferry.common.models.llama import SeqChunk, TokenFeed
from kvferry.common.sampling.penalties import TokenHistory, has_adjustments
from kvferry.common.sampling.sampler import Sampler, probs
from kvferry.common.sampling.top_logprobs import TopK, attach, prompt_tops, spec_tops, to_host, top_logprobs, with_tops

logger = logging.getLogger(__name__)


@dataclass
class ModelSlot:
    """A model with its paged KV cache, the allocator of that cache's pages and, on CUDA, the
    captured decode graphs (``cuda_graph.py``). With tensor parallelism, ``tp`` (rank 0's
    ``tp_group.TpGroup``) runs every KV-changing step on the other ranks too."""

    model: object  # kvferry.common.models.llama model: forward(chunks, kv, all_logits=False)
    kv: KvPool  # KvCache (K/V per layer) or LatentCache (MLA), as the model class picked
    allocator: PageAllocator
    graphs: list[StepGraphs] = field(default_factory=list)  # decode (q = 1), then verify (q = k + 1)
    tp: object | None = None  # TpGroup: forward(model, kv, chunks, ...), copy_page(src, dst), close()

    def forward(self, chunks: list[SeqChunk], *, all_logits: bool = False, feed: TokenFeed | None = None):
        if self.tp is not None:
            return self.tp.forward(self.model, self.kv, chunks, all_logits=all_logits, feed=feed)
        for graphs in self.graphs:
            if graphs.can_run(chunks, all_logits):
                self.model.check(chunks, self.kv)
                return graphs.run(chunks, feed)
        return self.model.forward(chunks, self.kv, all_logits=all_logits, feed=feed)

    def greedy(self, chunks: list[SeqChunk], feed: TokenFeed | None = None):
        """(tokens [n], pairs [n, 2]) of a decode step whose rows all pick greedily with nothing to
        adjust, from a captured graph and its greedy head (``StepGraphs.run_greedy``); None where no
        graph runs ``chunks`` (the caller then samples from ``forward``'s logits)."""
        for graphs in self.graphs:
            if graphs.heads and graphs.can_run(chunks, False):
                self.model.check(chunks, self.kv)
                return graphs.run_greedy(chunks, feed)
        return None

    def copy_page(self, src: int, dst: int) -> None:
        """Page ``dst`` of every region becomes a copy of page ``src``, on every TP rank."""
        if self.tp is not None:
            self.tp.copy_page(src, dst)
        self.kv.copy_page(src, dst)

    def close(self) -> None:
        """End the TP workers, if any (no-op at TP 1)."""
        if self.tp is not None:
            self.tp.close()


@dataclass(eq=False)
class PendingStep:
    """A decode step launched on the device whose sampled tokens are not on the host yet.

    ``tokens`` stay on the device as the next step's input; the tokens and logprobs also go to a
    pinned host buffer by a copy queued right behind the sampling, so ``result`` waits for this
    step only, not for a later one queued after it."""

    seqs: list[Sequence]
    tokens: torch.Tensor                 # [B] int64 on the device
    host: torch.Tensor                   # [2, B] float64: token ids (exact below 2**53), logprobs
    ready: torch.cuda.Event | None = None
    tops: TopK | None = None             # the asking rows' top logprobs, copied with the tokens

    @classmethod
    def of(cls, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor,
           tops: TopK | None = None) -> "PendingStep":
        both = torch.stack([tokens.double(), logprobs.double()])
        if not both.is_cuda:
            return cls(seqs, tokens, both, tops=tops)
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        tops = to_host(tops, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(seqs, tokens, host, ready, tops)

    @classmethod
    def of_picks(cls, seqs: list[Sequence], tokens: torch.Tensor, pairs: torch.Tensor) -> "PendingStep":
        """A step whose graph picked greedily (``ModelSlot.greedy``): ``pairs`` [B, 2] float64 (token,
        logprob) go to the host in one copy queued now, before the next replay overwrites them."""
        host = torch.empty(pairs.shape, dtype=pairs.dtype, pin_memory=True)
        host.copy_(pairs, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(seqs, tokens, host.t(), ready)

    def result(self) -> list[list[tuple[int, float]]]:
        """Each sequence's (token, logprob), after the step's one host sync."""
        if self.ready is not None:
            self.ready.synchronize()
        ids, logprobs = self.host.tolist()
        return [[pair] for pair in attach([(int(t), lp) for t, lp in zip(ids, logprobs)], self.tops)]


class ModelRunner(Admission):
    greedy_in_graph = True  # all-greedy decode steps pick in the graph's greedy head (bench/engine.py A/Bs it)

    def __init__(self, target: ModelSlot, draft: ModelSlot | None = None, *, spec_k: int = 4):
        self.target = target
        self.draft = draft
        self.spec_k = spec_k if draft is not None else 0
        self.page_size = target.kv.page_size
        self.sampler = Sampler()
        # penalties' token counts; the daemons set the tokenizer's EOS ids (what min_tokens masks)
        self.history = TokenHistory(target.model.config.vocab_size, target.kv.device, target.model.config.eos_token_ids)
        self.prefix_cache = None  # a RadixCache once enable_prefix_cache (admission.py) ran

    def close(self) -> None:
        """Release what outlives the process's memory: the TP worker processes, if any."""
        for slot in self.slots:
            slot.close()

    # -- prefill ----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], *, ends: list[int] | None = None, with_draft: bool = False) -> None:
        """Compute prompt KV for ``seqs`` from ``num_cached`` on, up to ``ends`` (default: the whole
        prompt), and sample the first token of each prompt that is then complete.

        A chunk that ends before its prompt does (chunked prefill) only fills KV and moves
        ``num_cached``. Logits are computed for each completed prompt's last token, and for the
        prompt tokens whose logprobs a sequence asks for (``input_logprobs`` set, from
        ``logprob_start_len`` on; such a prompt is never chunked) and no others: the prompt before
        that range runs in the batch like any other, the range in a second pass over its cached
        prefix, so a request for a few prompt logprobs never costs [tokens x vocab]."""
        ends = ends or [s.num_prompt_tokens for s in seqs]
        first_row = {id(s): _first_logit_row(s) for s in seqs}
        # first pass: every chunk up to its end, or up to the logprob range of a sequence that wants one
        stops = {id(s): end if first_row[id(s)] is None else first_row[id(s)] for s, end in zip(seqs, ends)}
        head_seqs = [s for s in seqs if stops[id(s)] > s.num_cached]
        head = [SeqChunk(s.prompt_ids[s.num_cached:stops[id(s)]], s.num_cached, s.pages) for s in head_seqs]
        last_rows = dict(zip(map(id, head_seqs), self.target.forward(head) if head else []))
        wanting = [s for s in seqs if first_row[id(s)] is not None]
        if wanting:
            tails = [SeqChunk(s.prompt_ids[first_row[id(s)]:], first_row[id(s)], s.pages) for s in wanting]
            for s, logits in zip(wanting, self.target.forward(tails, all_logits=True)):
                s.input_logprobs = _input_logprobs(logits, s.prompt_ids, first_row[id(s)])
                if s.top_logprobs_num > 0:  # row j holds the alternatives of prompt token j + 1
                    num_rows = s.num_prompt_tokens - 1 - first_row[id(s)]
                    s.input_top_logprobs = ([[]] * (first_row[id(s)] + 1)
                                            + prompt_tops(logits[:num_rows], s.top_logprobs_num))
                last_rows[id(s)] = logits[-1]
        for s, end in zip(seqs, ends):
            s.num_cached = end
        done = [s for s in seqs if s.num_cached == s.num_prompt_tokens]
        if done:
            last = mask_logits(torch.stack([last_rows[id(s)] for s in done]), [s.grammar for s in done])
            tops = top_logprobs(last, [s.top_logprobs_num for s in done])  # before sample: raw logits
            tokens, logprobs = self.sampler.sample(last, [s.params for s in done], [s.generator for s in done],
                                                   prefill_adjust(done, self.history))
            for s, (tok, lp, *alts) in zip(done, with_tops(tokens, logprobs, tops)):
                s.output_ids.append(tok)
                s.output_logprobs.append(lp)
                s.output_top_logprobs.extend(alts)
            if with_draft and self.draft is not None:
                self.prefill_draft(done)
        _synchronize(self.target.kv.device)  # the KV must be in memory before NIXL reads it

    @torch.inference_mode()
    def prefill_draft(self, seqs: list[Sequence]) -> None:
        """Fill the draft's KV for each prompt from ``draft_num_cached`` on (decode-only speculative
        decoding does this locally)."""
        seqs = [s for s in seqs if s.draft_num_cached < s.num_prompt_tokens]  # a cached prefix is filled
        if not seqs:
            return
        chunks = [SeqChunk(s.prompt_ids[s.draft_num_cached:], s.draft_num_cached, s.draft_pages) for s in seqs]
        self.draft.forward(chunks)
        for s in seqs:
            s.draft_num_cached = s.num_prompt_tokens

    # -- decode -----------------------------------------------------------------------------
    @property
    def is_speculative(self) -> bool:
        return self.draft is not None and self.spec_k > 0

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> list[list[tuple[int, float]]]:
        """One step for every running sequence; returns the (token, logprob) pairs each produced."""
        if self.is_speculative:
            return self._spec_step(seqs)
        return self.launch_decode(seqs).result()

    @torch.inference_mode()
    def launch_decode(self, seqs: list[Sequence], prev: PendingStep | None = None) -> PendingStep:
        """Queue one decode step (no speculation) on the device and return without waiting for it.

        A sequence of ``prev`` (the step before, still running) takes its input token from
        ``prev.tokens`` on the device; its ``output_ids`` lack that token until the caller has
        read ``prev.result()``. ``num_cached`` moves at launch: the step writes that position."""
        rows = {id(s): i for i, s in enumerate(prev.seqs)} if prev is not None else {}
        chunks = [SeqChunk([0 if id(s) in rows else s.last_token], s.num_cached, s.pages) for s in seqs]
        feed = _feed([i for i, s in enumerate(seqs) if id(s) in rows], [rows[id(s)] for s in seqs if id(s) in rows],
                     prev.tokens if prev is not None else None)
        picks = self.target.greedy(chunks, feed) if self.greedy_in_graph and _plain_greedy(seqs) else None
        if picks is not None:  # sampled in the graph: no sampling op launched from here
            step = PendingStep.of_picks(seqs, *picks)
        else:
            logits = mask_logits(self.target.forward(chunks, feed=feed), [s.grammar for s in seqs])
            tops = top_logprobs(logits, [s.top_logprobs_num for s in seqs])
            tokens, logprobs = self.sampler.sample(logits, [s.params for s in seqs], [s.generator for s in seqs],
                                                   decode_adjust(seqs, self.history))
            step = PendingStep.of(seqs, tokens, logprobs, tops)
        for s in seqs:
            s.num_cached += 1
        return step

    def _spec_step(self, seqs: list[Sequence]) -> list[list[tuple[int, float]]]:
        k = self.spec_k
        masks = DraftMasks([s.grammar for s in seqs], k)  # structured output: propose and verify under it
        proposals, q_rows = self._propose(seqs, k, masks)
        chunks = [SeqChunk([s.last_token] + d, s.num_cached, s.pages) for s, d in zip(seqs, proposals)]
        target_logits = masks.verify(self.target.forward(chunks, all_logits=True))  # list of [k+1, V]
        chosen = verify_logits(seqs, proposals, target_logits, self.history)  # penalized, or None
        greedy = _greedy_verdicts(seqs, proposals, target_logits, chosen)
        results = []
        for i, (s, d, q, logits) in enumerate(zip(seqs, proposals, q_rows, target_logits)):
            if i in greedy:
                verdict, lps = greedy[i]
                accepted = verdict.tokens(d)
            else:
                logits = logits.float()
                p = probs(logits if chosen is None else chosen[i].float(), [s.params] * logits.shape[0])
                verdict = verify_sampled(p, torch.stack(q), d, s.generator)
                accepted = verdict.tokens(d)
                logp = torch.log_softmax(logits[: len(accepted)], dim=-1)
                lps = [float(logp[i, t]) for i, t in enumerate(accepted)]
            s.num_proposed += k
            s.num_accepted += verdict.num_accepted
            # Target cache now validly holds last_token + accepted drafts; the new token is uncached.
            s.num_cached += 1 + verdict.num_accepted
            s.draft_num_cached = min(s.draft_num_cached, s.num_cached)
            tops = spec_tops(logits[: len(accepted)], s.top_logprobs_num)  # row i: accepted[i]'s alternatives
            results.append(list(zip(accepted, lps, tops)) if tops else list(zip(accepted, lps)))
        if chosen is not None:
            record_accepted(seqs, [[pair[0] for pair in r] for r in results], self.history)
        return results

    def _propose(self, seqs: list[Sequence], k: int, masks: DraftMasks):
        """Run the draft k times; returns proposals [B][k] and their draft probabilities [B][k][V]
        (under each constrained row's grammar)."""
        proposals: list[list[int]] = [[] for _ in seqs]
        q_rows: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in range(k):
            chunks = []
            for s, d in zip(seqs, proposals):
                if step == 0:
                    # The draft may lag by more than one token (accepted drafts + bonus token).
                    pending = s.tokens[s.draft_num_cached:]
                    chunks.append(SeqChunk(pending, s.draft_num_cached, s.draft_pages))
                else:
                    chunks.append(SeqChunk([d[-1]], s.num_tokens + step - 1, s.draft_pages))
            logits = masks.draft(self.draft.forward(chunks).float(), step)
            # every greedy row's pick in one device-to-host copy
            best = logits.argmax(dim=-1).tolist() if any(s.params.is_greedy for s in seqs) else []
            for i, s in enumerate(seqs):
                if s.params.is_greedy:
                    tok = best[i]
                else:
                    # The draft may live on another device (DRAM draft, VRAM target): sample where
                    # the request's generator and the target's probabilities live.
                    q = probs(logits[i : i + 1], [s.params])[0].to(self.target.kv.device)
                    tok = int(torch.multinomial(q, 1, generator=s.generator).item())
                    q_rows[i].append(q)
                proposals[i].append(tok)
                masks.accept(i, tok)
            for s in seqs:
                if step == 0:
                    s.draft_num_cached = s.num_tokens
        for s in seqs:
            # Proposals d0..d(k-2) were fed to the draft; d(k-1) was not.
            s.draft_num_cached = s.num_tokens + k - 1
        masks.close()
        return proposals, q_rows


def _greedy_verdicts(seqs: list[Sequence], proposals: list[list[int]],
                     target_logits: list[torch.Tensor],
                     chosen: list[torch.Tensor] | None = None) -> dict[int, tuple[Verdict, list[float]]]:
    """Greedy rows of a verify step, checked together: their argmax tokens (of ``chosen``, the
    penalized logits, when given) and logprobs (of the raw logits) come to the host in one copy.
    Returns {row: (verdict, logprob of each output token)}."""
    rows = [i for i, s in enumerate(seqs) if s.params.is_greedy]
    if not rows:
        return {}
    stacked = torch.stack([target_logits[i] for i in rows]).float()  # [G, k+1, V]
    picks = stacked if chosen is None else torch.stack([chosen[i] for i in rows])
    best = picks.argmax(dim=-1, keepdim=True)
    logp = torch.log_softmax(stacked, dim=-1).gather(-1, best)  # the output tokens are the argmaxes
    host = torch.cat([best.double(), logp.double()], dim=-1).tolist()  # [G][k+1][token, logprob]
    out = {}
    for i, row in zip(rows, host):
        verdict = verify_greedy_ids([int(t) for t, _ in row], proposals[i])
        out[i] = (verdict, [lp for _, lp in row[: verdict.num_accepted + 1]])
    return out


def _plain_greedy(seqs: list[Sequence]) -> bool:
    """Every row picks its argmax with nothing to change first: no sampling, penalty, bias,
    min_tokens, grammar or top logprobs (``Sampler.sample``'s ``greedy_picks`` case)."""
    return all(s.params.is_greedy and s.grammar is None and s.top_logprobs_num == 0 and not has_adjustments(s.params)
               for s in seqs)


def _feed(dst: list[int], src: list[int], tokens: torch.Tensor | None) -> TokenFeed | None:
    """Rows ``dst`` of the next batch take ``tokens[src]``; the common case (the same sequences
    in the same order) needs no gather."""
    if not dst:
        return None
    values = tokens[:len(src)] if src == list(range(len(src))) else tokens.index_select(0, to_device(src, tokens.device))
    rows = _first_rows(len(dst), tokens.device) if dst == list(range(len(dst))) else to_device(dst, tokens.device)
    return TokenFeed(rows, values)


_ROWS: dict[torch.device, torch.Tensor] = {}


def _first_rows(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` on ``device`` as a view of one kept tensor: a step fed in the same order as the
    step before (the common case) copies no row indices up."""
    rows = _ROWS.get(device)
    if rows is None or rows.numel() < n:
        rows = _ROWS[device] = torch.arange(max(n, 256), dtype=torch.int64, device=device)
    return rows[:n]


def _pairs(tokens: torch.Tensor, logprobs: torch.Tensor) -> list[tuple[int, float]]:
    """(token, logprob) per row with one device-to-host copy (ids < 2**53 are exact in float64)."""
    both = torch.stack([tokens.double(), logprobs.double()], dim=1).tolist()
    return [(int(t), lp) for t, lp in both]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_logit_row(seq: Sequence) -> int | None:
    """The first prompt position whose logits ``seq`` needs beyond its last (row j predicts token
    j + 1), or None when it wants no prompt logprobs."""
    n = seq.num_prompt_tokens
    if seq.input_logprobs is None or seq.logprob_start_len >= n:
        return None
    return max(seq.logprob_start_len - 1, 0)


def _input_logprobs(logits: torch.Tensor, prompt_ids: list[int], first_row: int) -> list[float | None]:
    """logprob of each prompt token given its prefix, from ``logits`` [n - first_row, vocab] of rows
    ``first_row..n-1``; None before the range and for the first token (SGLang's convention)."""
    ids = torch.tensor(prompt_ids[first_row + 1:], device=logits.device)
    rows = logits[: len(ids)]
    values = (rows.gather(1, ids[:, None]).squeeze(1) - torch.logsumexp(rows, dim=-1)).tolist()
    return [None] * (first_row + 1) + values
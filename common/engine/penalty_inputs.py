"""A batch's penalties, logit bias and min_tokens (common/sampling/penalties.py) from its sequences.

Only sequences whose `SamplingParams` ask for any of them are looked at; a batch with none builds
nothing, and the sampler takes its plain path. A sequence that needs token counts gets a
`TokenHistory` row at its first decode step, filled from `prompt_ids + output_ids` (the host has
them then: the first token came from the prefill), and counted on the device from then on; the
runner frees the row with the sequence's pages.

How many tokens a sequence has generated is read from `num_cached`, which the runner moves when
it launches a step, so it is right also when the previous step's token has not reached the host
(overlapped decode).

Speculative decoding: the draft proposes from its own, unadjusted distribution; the target's k+1
verify positions are adjusted, position j counting the proposals before it as output. Greedy
verification then yields exactly the tokens of plain adjusted greedy decoding, and the sampled
accept/reject rule (common/engine/spec.py) leaves the output distributed as the adjusted target's.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from kvferry.common.engine.sequence import Sequence
from kvferry.common.sampling.penalties import LogitAdjust, RowRequest, TokenHistory, build_adjust, has_adjustments, needs_history


def _num_generated(s: Sequence) -> int:
    """Output tokens before the one this step picks (while decoding, the newest token is the one
    the step feeds, at position num_cached)."""
    return s.num_cached + 1 - s.num_prompt_tokens


def _slot(s: Sequence, history: TokenHistory) -> int | None:
    if needs_history(s.params) and s.history_row is None:
        s.history_row = history.acquire(s.prompt_ids, s.output_ids)
    return s.history_row


def prefill_adjust(seqs: Seq[Sequence], history: TokenHistory) -> LogitAdjust | None:
    """The first token of each prompt: no output yet; repetition_penalty counts the prompt."""
    requests = [RowRequest(i, s.params, 0, prompt_ids=s.prompt_ids)
                for i, s in enumerate(seqs) if has_adjustments(s.params)]
    return build_adjust(requests, history) if requests else None


def decode_adjust(seqs: Seq[Sequence], history: TokenHistory) -> LogitAdjust | None:
    """One decode step; each pick is counted into its sequence's history on the device."""
    requests = [RowRequest(i, s.params, _num_generated(s), slot=_slot(s, history), is_recorded=True)
                for i, s in enumerate(seqs) if has_adjustments(s.params)]
    return build_adjust(requests, history) if requests else None


def verify_logits(seqs: Seq[Sequence], proposals: Seq[list[int]], target_logits: Seq[torch.Tensor],
                  history: TokenHistory) -> list[torch.Tensor] | None:
    """The logits a verify step picks from: each [k+1, V] of `target_logits`, adjusted for the
    sequences that ask (position j after the proposals d[:j]), the others as they are; None when
    no sequence asks."""
    asking = [i for i, s in enumerate(seqs) if has_adjustments(s.params)]
    if not asking:
        return None
    out = list(target_logits)
    requests, row = [], 0
    for i in asking:
        s, d = seqs[i], proposals[i]
        for j in range(len(d) + 1):
            requests.append(RowRequest(row, s.params, _num_generated(s) + j, slot=_slot(s, history),
                                       extra_ids=d[:j]))
            row += 1
    adjust = build_adjust(requests, history)
    if adjust is None:
        return None
    adjusted = adjust.apply(torch.cat([target_logits[i] for i in asking]))
    for i, part in zip(asking, adjusted.split([len(proposals[i]) + 1 for i in asking])):
        out[i] = part
    return out


def record_accepted(seqs: Seq[Sequence], accepted: Seq[list[int]], history: TokenHistory) -> None:
    """Count a speculative step's output tokens into the histories of the sequences that have one."""
    rows = [s.history_row for s, tokens in zip(seqs, accepted) if s.history_row is not None for _ in tokens]
    ids = [t for s, tokens in zip(seqs, accepted) if s.history_row is not None for t in tokens]
    history.record_ids(rows, ids)

"""A room's prompt logprobs as the TransferResult carries them to the decode, sized to one frame.

The TransferResult is one msgpack frame, and the decode's DEALER drops a connection whose frame
passes ``wire.MAX_FRAME_BYTES`` (libzmq's MAXMSGSIZE), failing every room on that link. So the
prefill refuses, before the forward, a request for more prompt positions than any encoding of them
fits (``max_prompt_logprob_tokens``: msgpack's worst case per position, list headers included), and
measures the frame it would send once the logprobs exist (``prompt_logprobs_of``): the bound is the
promise, the encoded bytes the check.
"""

from __future__ import annotations

import math

from kvferry.common.wire import messages as wire
from kvferry.common.api.schema import FieldError
from kvferry.common.engine.sequence import Sequence

_FRAME_SLACK_BYTES = 4096  # the TransferResult's other fields and the three outer lists' headers
_FLOAT_BYTES = 9  # msgpack float64
_ID_BYTES = 5  # msgpack uint32, a token id >= 65,536 (Llama-3, Qwen)


def _list_header_bytes(num: int) -> int:
    """msgpack's array header: fixarray, array 16 or array 32."""
    return 1 if num < 16 else 3 if num < 1 << 16 else 5


def position_bytes(top_logprobs_num: int) -> int:
    """The most bytes msgpack spends on one prompt position: its logprob and two lists (ids,
    logprobs) of ``top_logprobs_num`` each (empty ones too), with their headers."""
    return (_FLOAT_BYTES + 2 * _list_header_bytes(top_logprobs_num)
            + top_logprobs_num * (_ID_BYTES + _FLOAT_BYTES))


def max_prompt_logprob_tokens(top_logprobs_num: int) -> int:
    """Prompt positions whose logprobs (and ``top_logprobs_num`` alternatives each) fit one
    TransferResult frame however msgpack encodes their values (``position_bytes``).
    Invariant (tested): a result of that many positions encodes to at most ``wire.MAX_FRAME_BYTES``."""
    return (wire.MAX_FRAME_BYTES - _FRAME_SLACK_BYTES) // position_bytes(top_logprobs_num)


def result_frame_bytes(room: int, prompt: wire.PromptLogprobs) -> int:
    """The bytes of the TransferResult that would carry ``prompt`` for ``room`` (its largest form)."""
    return len(wire.encode(wire.TransferResult(room=room, ok=True, error=None, prompt_logprobs=prompt, staged=True)))


def prompt_logprobs_of(seq: Sequence, room: int) -> wire.PromptLogprobs | None:
    """The prompt logprobs ``seq`` asked for, as the TransferResult carries them to the decode; a
    ``FieldError`` (logprob_start_len) when that frame would pass ``wire.MAX_FRAME_BYTES``."""
    if not seq.input_logprobs:
        return None
    start = seq.logprob_start_len
    tops = (seq.input_top_logprobs or [])[start:]
    prompt = wire.PromptLogprobs(start=start, logprobs=[math.nan if lp is None else lp for lp in seq.input_logprobs[start:]],
                                 top_ids=[[t for t, _ in alts] for alts in tops],
                                 top_logprobs=[[lp for _, lp in alts] for alts in tops])
    num_bytes = result_frame_bytes(room, prompt)
    if num_bytes > wire.MAX_FRAME_BYTES:
        raise FieldError("logprob_start_len", f"room={room} request_id={seq.request_id}: the logprobs of "
                         f"{len(prompt.logprobs)} prompt tokens take {num_bytes} bytes, more than one control frame "
                         f"holds ({wire.MAX_FRAME_BYTES}); ask for fewer (a later logprob_start_len or a smaller "
                         f"top_logprobs_num)")
    return prompt

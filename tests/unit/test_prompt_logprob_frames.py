"""The prompt logprobs' frame (prefill_worker/prompt_logprobs.py): the prefill's limit on prompt
positions holds however msgpack encodes them, and a frame measured over the limit is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.common.wire import messages as wire
from kvferry.common.api.schema import FieldError
from kvferry.common.engine.sequence import Sequence
from kvferry.common.sampling.sampler import SamplingParams
from kvferry.prefill_worker.prompt_logprobs import max_prompt_logprob_tokens, position_bytes, prompt_logprobs_of, result_frame_bytes

# the largest values msgpack can be given here: token ids past 65,535 (5 bytes), float64 logprobs (9)
WIDE_ID = (1 << 32) - 1


def widest(num_positions: int, top: int) -> wire.PromptLogprobs:
    return wire.PromptLogprobs(start=1, logprobs=[-0.1] * num_positions, top_ids=[[WIDE_ID] * top] * num_positions,
                               top_logprobs=[[-0.2] * top] * num_positions)


@pytest.mark.parametrize("top", [0, 1, 10, 15, 16, 20])
def test_the_limit_fits_one_frame_with_the_widest_ids(top):
    """Fails if the limit leaves out msgpack's list headers: with 10 or more alternatives of ids past
    65,535 a result at the old limit (9 + 14 * top bytes a position) passed 1 MiB."""
    limit = max_prompt_logprob_tokens(top)
    assert result_frame_bytes((1 << 63) - 1, widest(limit, top)) <= wire.MAX_FRAME_BYTES
    assert result_frame_bytes((1 << 63) - 1, widest(limit + 64, top)) > wire.MAX_FRAME_BYTES - 4096  # and is tight


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 20), st.integers(0, 40), st.data())
def test_a_position_never_takes_more_than_position_bytes(top, num, data):
    ids = st.integers(0, WIDE_ID)
    lps = st.floats(allow_nan=True)
    prompt = wire.PromptLogprobs(start=0, logprobs=data.draw(st.lists(lps, min_size=num, max_size=num)),
                                 top_ids=[data.draw(st.lists(ids, min_size=top, max_size=top)) for _ in range(num)],
                                 top_logprobs=[data.draw(st.lists(lps, min_size=top, max_size=top)) for _ in range(num)])
    empty = wire.PromptLogprobs(start=0, logprobs=[], top_ids=[], top_logprobs=[])
    outer = 3 * 4  # the three outer lists' headers grow from 1 to at most 5 bytes each
    assert result_frame_bytes(1, prompt) - result_frame_bytes(1, empty) <= num * position_bytes(top) + outer


def test_a_measured_frame_over_the_limit_is_refused_naming_the_field():
    """The check on the encoded bytes, behind the limit: a sequence whose logprobs would not fit one
    frame is refused with a FieldError on logprob_start_len, not sent to drop the decode's link."""
    num = max_prompt_logprob_tokens(20) + 200
    seq = Sequence("req-1", list(range(num + 1)), SamplingParams(), top_logprobs_num=20)
    seq.logprob_start_len = 1
    seq.input_logprobs = [None] + [-0.5] * num
    seq.input_top_logprobs = [[]] + [[(WIDE_ID, -0.25)] * 20] * num
    with pytest.raises(FieldError, match=r"room=7 request_id=req-1: the logprobs of \d+ prompt tokens take") as info:
        prompt_logprobs_of(seq, 7)
    assert info.value.param == "logprob_start_len"
    seq.input_logprobs, seq.input_top_logprobs = seq.input_logprobs[:101], seq.input_top_logprobs[:101]
    got = prompt_logprobs_of(seq, 7)
    assert len(got.logprobs) == 100 and got.top_ids[0] == [WIDE_ID] * 20

"""Top logprobs on CUDA: the device computation equals the float64 reference on the host, and an
overlapped decode step that asks for them still makes no host sync at launch (their copy rides the
step's pinned buffer and event) and gives what one step at a time gives."""

from __future__ import annotations

import pytest
import torch

from kvferry.common.engine.factory import build_runner
from kvferry.common.engine.sequence import Sequence
from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.sampling.top_logprobs import attach, to_host, top_logprobs, with_tops

pytestmark = pytest.mark.gpu


def test_top_logprobs_on_cuda_equal_the_host_reference():
    logits = torch.randn(6, 32000, generator=torch.Generator().manual_seed(0)) * 5
    nums = [0, 20, 3, 0, 1, 7]
    tops = top_logprobs(logits.to("cuda"), nums)
    values, ids = torch.log_softmax(logits.double(), dim=-1).topk(20, dim=-1)
    host = to_host(tops, non_blocking=True)
    torch.cuda.synchronize()
    tokens = logits.argmax(-1)
    out = attach([(int(t), 0.0) for t in tokens], host)
    on_host = with_tops(tokens, torch.zeros(6), top_logprobs(logits, nums))  # the CPU path agrees on the ids
    assert [[t for t, _ in o[2]] if len(o) > 2 else None for o in out] == \
        [[t for t, _ in o[2]] if len(o) > 2 else None for o in on_host]
    for row, n in zip(tops.rows, tops.nums):
        alts = out[row][2]
        assert [t for t, _ in alts] == ids[row, :n].tolist()
        assert [lp for _, lp in alts] == pytest.approx(values[row, :n].tolist(), abs=1e-4)


@pytest.fixture(scope="module")
def runner(tiny_models):
    return build_runner(tiny_models[0], device="cuda:0", dtype="float32", max_total_tokens=4096,
                        attention_backend="triton", page_size=16, disable_cuda_graph=True)


def _run(runner, overlap: bool) -> list[list]:
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    seqs = [Sequence(f"s{i}", [5 + i] * (20 + 9 * i), params, top_logprobs_num=(0, 5, 20)[i % 3]) for i in range(4)]
    for s in seqs:
        runner.admit(s)
    steps: list[list] = []
    try:
        runner.prefill(seqs)
        if not overlap:
            for _ in range(4):
                pairs = runner.decode(seqs)
                steps.append(pairs)
                for s, p in zip(seqs, pairs):
                    s.output_ids.append(p[0][0])
            return steps
        prev = runner.launch_decode(seqs)
        torch.cuda.synchronize()
        for _ in range(4):
            torch.cuda.set_sync_debug_mode("error")
            try:
                step = runner.launch_decode(seqs, prev)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            pairs = prev.result()
            steps.append(pairs)
            for s, p in zip(seqs, pairs):
                s.output_ids.append(p[0][0])
            prev = step
        prev.result()
        return steps
    finally:
        for s in seqs:
            runner.release(s)


def test_overlapped_steps_with_top_logprobs_make_no_sync_and_equal_plain_steps(runner):
    plain, overlapped = _run(runner, overlap=False), _run(runner, overlap=True)
    for a_step, b_step in zip(plain, overlapped):
        for (a,), (b,) in zip(a_step, b_step):
            assert a[0] == b[0] and len(a) == len(b)
            if len(a) > 2:
                assert [t for t, _ in a[2]] == [t for t, _ in b[2]]
                assert [lp for _, lp in a[2]] == pytest.approx([lp for _, lp in b[2]], abs=1e-4)
    assert [len(p[0]) for p in plain[0]] == [2, 3, 3, 2] and len(plain[0][2][0][2]) == 20

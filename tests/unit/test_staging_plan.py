"""The staging plan (``common/plan/staging.py``): the chooser, the crossover, the stream of a room's
runs, the row view, the chunks and the pipeline's order of work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from kvferry.common.kernels import staging_copy
from kvferry.common.models.config import ModelConfig
from kvferry.common.cache.kv_cache import KV_LAYOUTS, KvCache
from kvferry.common.plan.desc_lists import DescGroup
from kvferry.common.plan.staging import (
    DirectReason, StagingCosts, StepOp, StreamSegment, TransferPath, chunk_plan, choose_path, copy_plan,
    crossover_runs, direct_s, faster_path, num_chunks, pipeline_steps, plan_room, room_stream, staged_s,
)


def test_choose_path():
    assert choose_path(0, 64) is TransferPath.DIRECT
    assert choose_path(63, 64) is TransferPath.DIRECT
    assert choose_path(64, 64) is TransferPath.STAGED and choose_path(1000, 64) is TransferPath.STAGED
    assert choose_path(10**6, 0) is TransferPath.DIRECT and choose_path(10**6, -1) is TransferPath.DIRECT  # off
    with pytest.raises(ValueError, match="num_runs"):
        choose_path(-1, 4)


@given(st.floats(1e-7, 1e-4), st.floats(0, 1e-9), st.floats(0, 1e-4), st.integers(0, 1 << 32), st.integers(1, 10**5))
def test_crossover_is_where_staging_starts_to_win(d, per_byte, fixed, nbytes, runs):
    costs = StagingCosts(per_descriptor_s=d, copy_s_per_byte=per_byte, copy_fixed_s=fixed)
    crossover = crossover_runs(costs, nbytes)
    assert crossover >= 2
    copy_s = fixed + per_byte * nbytes
    staged_wins = (runs - 1) * d > copy_s * (1 + 1e-12)  # the model's own comparison
    if staged_wins:
        assert runs >= crossover
    if runs >= crossover + 1:  # one run of slack for the rounding of floats
        assert (runs - 1) * d > copy_s * (1 - 1e-12)
    assert crossover_runs(StagingCosts(0.0, per_byte, fixed), nbytes) == 0  # free descriptors: never stage


@given(st.lists(st.integers(0, 1 << 20), max_size=40, unique=True), st.integers(1, 1 << 12),
       st.sampled_from([0, 8, 64, 4096]))
def test_copy_plan_rows_hold_the_runs(offset_units, run_nbytes, base_addr):
    unit = np.random.default_rng(len(offset_units)).choice([1, 2, 8, 64])
    ordered = np.sort(np.asarray(offset_units, dtype=np.int64))
    offsets = ordered + np.arange(len(ordered)) * run_nbytes  # spread out: no two runs overlap
    offsets = offsets[np.random.default_rng(len(offsets)).permutation(len(offsets))] * unit
    run_nbytes *= unit
    buffer_nbytes = int(offsets.max()) + run_nbytes if len(offsets) else run_nbytes
    plan = copy_plan(base_addr + offsets, run_nbytes, base_addr, 4096, buffer_nbytes)
    assert run_nbytes % plan.row_nbytes == 0 and plan.row_nbytes % plan.elem_nbytes == 0
    assert np.array_equal(plan.rows * plan.row_nbytes, offsets)
    assert plan.elem_nbytes in (1, 2, 4, 8) and base_addr % plan.elem_nbytes == 0
    if plan.elem_nbytes < 8:  # the widest element the row and the addresses allow
        assert plan.row_nbytes % (2 * plan.elem_nbytes) or base_addr % (2 * plan.elem_nbytes)
    index = plan.row_index()
    assert len(index) == len(offsets) * plan.rows_per_run
    if len(offsets):
        with pytest.raises(ValueError, match="outside the"):
            copy_plan(base_addr + offsets, run_nbytes, base_addr, 4096, buffer_nbytes - 1)
        overlapping = np.append(offsets, offsets[0] + run_nbytes - 1)
        with pytest.raises(ValueError, match="overlap"):
            copy_plan(base_addr + overlapping, run_nbytes, base_addr, 4096, buffer_nbytes + run_nbytes)


def _config(layers: int) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8})


@pytest.mark.parametrize("prefill_layout", KV_LAYOUTS)
@pytest.mark.parametrize("decode_layout", KV_LAYOUTS)
def test_staged_room_lands_where_a_direct_write_would(prefill_layout, decode_layout):
    """Gather a room's stream out of the prefill pool, scatter it into the decode pool: each
    region's decode pages hold the prefill pages' bytes, and nothing else on the decode changed."""
    rng = np.random.default_rng(0)
    prefill = KvCache(_config(3), 12, 4, torch.bfloat16, "cpu", layout=prefill_layout)
    decode = KvCache(_config(3), 20, 4, torch.bfloat16, "cpu", layout=decode_layout)
    prefill.buffer.view(torch.uint8).random_(0, 256)
    decode.buffer.view(torch.uint8).random_(0, 256)
    before = decode.buffer.clone()
    group = DescGroup("DRAM", "DRAM", tuple(zip(prefill.regions(), decode.regions())))
    p_ids, d_ids = rng.choice(12, 7, replace=False).tolist(), rng.choice(20, 7, replace=False).tolist()
    segments = room_stream(group, p_ids, d_ids)
    is_fused = prefill_layout == decode_layout == "page-major"
    assert len(segments) == (1 if is_fused else 6)  # page-major: one run per page, the whole block
    staging = torch.empty(sum(s.num_runs * s.run_nbytes for s in segments), dtype=torch.uint8)
    at = 0
    for seg in segments:  # the stream: segment after segment, runs in token order
        nbytes = seg.num_runs * seg.run_nbytes
        slot = staging[at: at + nbytes]
        plan = copy_plan(seg.prefill_addrs, seg.run_nbytes, prefill.buffer.data_ptr(), slot.data_ptr(), prefill.num_bytes)
        staging_copy.gather_reference(prefill.buffer, slot, plan, staging_copy.row_index(plan, "cpu"))
        plan = copy_plan(seg.decode_addrs, seg.run_nbytes, decode.buffer.data_ptr(), slot.data_ptr(), decode.num_bytes)
        staging_copy.scatter_reference(slot, decode.buffer, plan, staging_copy.row_index(plan, "cpu"))
        at += nbytes
    for p_t, d_t in zip(prefill.tensors(), decode.tensors()):
        assert torch.equal(d_t[d_ids].view(torch.int16), p_t[p_ids].view(torch.int16))
        others = [p for p in range(20) if p not in d_ids]
        assert torch.equal(d_t[others].view(torch.int16), before.view(torch.int16)
                           .as_strided(d_t.shape, d_t.stride(), d_t.storage_offset())[others])


@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 40)), min_size=1, max_size=4),
       st.integers(1, 2000), st.integers(1, 4))
def test_chunks_tile_the_stream(segments, chunk_nbytes, num_buffers):
    run_nbytes, num_runs = [n for n, _ in segments], [c for _, c in segments]
    chunks = chunk_plan(run_nbytes, num_runs, chunk_nbytes, num_buffers)
    if any(n > chunk_nbytes and c for n, c in segments):
        assert chunks is None
        return
    assert chunks is not None
    covered, offset = [], 0
    for i, chunk in enumerate(chunks):
        assert chunk.index == i and chunk.buffer == i % num_buffers
        assert chunk.stream_offset == offset and 0 < chunk.nbytes <= chunk_nbytes
        assert chunk.nbytes == sum(run_nbytes[p.segment] * p.num_runs for p in chunk.parts)
        covered += [(p.segment, r) for p in chunk.parts for r in range(p.first_run, p.first_run + p.num_runs)]
        offset += chunk.nbytes
        if i + 1 < len(chunks):  # greedy: the next chunk's first run did not fit in this one
            first = chunks[i + 1].parts[0]
            assert chunk.nbytes + run_nbytes[first.segment] > chunk_nbytes
    assert covered == [(s, r) for s, c in enumerate(num_runs) for r in range(c)]  # every run once, in order
    assert offset == sum(n * c for n, c in segments)


@given(st.integers(0, 12), st.integers(1, 4))
def test_pipeline_overlaps_and_never_overwrites_a_buffer_in_flight(num_chunks, num_buffers):
    chunks = chunk_plan([10], [num_chunks], 10, num_buffers)
    steps = pipeline_steps(chunks, num_buffers)
    at = {(s.op, s.chunk): i for i, s in enumerate(steps)}
    assert len(at) == len(steps) and steps[-1].op is StepOp.NOTIFY  # each step once; the notification last
    for i in range(num_chunks):
        assert at[(StepOp.GATHER, i)] < at[(StepOp.WRITE, i)] < at[(StepOp.WAIT, i)] < at[(StepOp.NOTIFY, -1)]
        if i >= num_buffers:  # its buffer's previous WRITE is DONE before the gather overwrites it
            assert at[(StepOp.WAIT, i - num_buffers)] < at[(StepOp.GATHER, i)]
        if i + 1 < num_chunks and num_buffers > 1:  # chunk i + 1 is gathered while chunk i is on the wire
            assert at[(StepOp.WRITE, i)] < at[(StepOp.GATHER, i + 1)] < at[(StepOp.WAIT, i)]
    in_flight = 0
    for step in steps:  # never more WRITEs in flight than buffers
        in_flight += {StepOp.WRITE: 1, StepOp.WAIT: -1}.get(step.op, 0)
        assert 0 <= in_flight <= num_buffers


def test_plan_room_says_why_a_room_goes_direct():
    segs = [StreamSegment(1000, np.arange(8) * 4096, np.arange(8) * 8192, 0, 0),
            StreamSegment(200, np.arange(8) * 512, np.arange(8) * 512, 0, 0)]  # 9,600 bytes in 16 runs
    assert plan_room(segs, 16, 0, 4000, 10_000).reason is DirectReason.STAGING_OFF
    assert plan_room(segs, 15, 16, 4000, 10_000).reason is DirectReason.FEW_RUNS
    assert plan_room(segs, 16, 16, 4000, 9_599).reason is DirectReason.ROOM_OVER_SLOT
    assert plan_room(segs, 16, 16, 999, 10_000).reason is DirectReason.RUN_OVER_CHUNK
    staged = plan_room(segs, 16, 16, 3500, 9_600)
    assert staged.path is TransferPath.STAGED and staged.reason is None
    assert [c.nbytes for c in staged.chunks] == [3000, 3000, 3400, 200]  # whole runs; chunk 2 spans both segments
    assert [c.buffer for c in staged.chunks] == [0, 1, 0, 1]


# What one H200 measured at 7a24740 (issue 24 item 10): 7.8 us per descriptor, ~0.23 ms per WRITE
# (a 32 MiB chunk's prepare, post, poll and release), the decode's scatter of a 512 MiB room in
# ~0.85 ms (so gather + scatter ~3.3 ps per byte), a one-descriptor WRITE of it in ~0.57 ms.
H200 = StagingCosts(per_descriptor_s=7.8e-6, copy_s_per_byte=3.3e-12, copy_fixed_s=2e-5, per_write_s=2.3e-4,
                    wire_s_per_byte=1.05e-12)
CHUNK = 32 << 20


def test_the_h200_4k_room_of_256_runs_goes_direct():
    """A 4k-token Llama-3-8B room (512 MiB) in 256 runs, 32 MiB chunks: staged took 5.3 ms against
    direct 1.7 ms on the H200, and the chooser staged it (crossover 228). Fails if the chooser leaves
    out the per-WRITE cost of the 16 chunks (the crossover then comes out ~220)."""
    nbytes = 512 << 20
    assert faster_path(H200, 256, nbytes, CHUNK) is TransferPath.DIRECT
    assert staged_s(H200, nbytes, CHUNK) > direct_s(H200, 256, nbytes)
    assert crossover_runs(H200, nbytes, CHUNK) > 256
    assert crossover_runs(H200, 16 * nbytes, CHUNK) > 1024  # the 16k room of 1,024 runs: direct too (16.7 ms vs 6.3)
    # what staging is for: a room of many more runs than chunks still stages
    assert faster_path(H200, 4096, nbytes, CHUNK) is TransferPath.STAGED


COSTS = st.builds(StagingCosts, per_descriptor_s=st.floats(1e-7, 1e-4), copy_s_per_byte=st.floats(0, 1e-9),
                  copy_fixed_s=st.floats(0, 1e-4), per_write_s=st.floats(0, 1e-3), wire_s_per_byte=st.floats(0, 1e-9),
                  copies_share_wire=st.booleans())


@given(COSTS, st.integers(0, 10**5), st.integers(1, 1 << 32), st.integers(1, 1 << 30))
def test_the_chooser_picks_the_faster_path_and_the_crossover_agrees(costs, runs, nbytes, chunk):
    """``faster_path`` stages exactly when the model's staged time is below its direct time, and the
    crossover is the least run count at which it does (one run of slack for float rounding)."""
    direct, staged = direct_s(costs, runs, nbytes), staged_s(costs, nbytes, chunk)
    path = faster_path(costs, runs, nbytes, chunk)
    assert path is (TransferPath.STAGED if staged < direct else TransferPath.DIRECT)
    crossover = crossover_runs(costs, nbytes, chunk)
    assert crossover >= 2
    if path is TransferPath.STAGED:
        assert runs >= crossover - 1
    if runs >= crossover + 1:
        assert path is TransferPath.STAGED
    # more runs never make direct faster; a larger per-WRITE cost never makes staging more likely
    assert staged_s(costs, nbytes, chunk) >= direct_s(costs, 0, nbytes) - costs.per_write_s
    dearer = StagingCosts(costs.per_descriptor_s, costs.copy_s_per_byte, costs.copy_fixed_s, 2 * costs.per_write_s + 1e-6,
                          costs.wire_s_per_byte, costs.copies_share_wire)
    assert crossover_runs(dearer, nbytes, chunk) >= crossover


@given(COSTS, st.integers(1, 1 << 32), st.integers(1, 1 << 30))
@example(StagingCosts(per_descriptor_s=1e-4, copy_s_per_byte=0.0, copy_fixed_s=0.0, per_write_s=0.00011868982952845466,
                      wire_s_per_byte=0.0, copies_share_wire=False), 146397406, 1)  # ~32,000 s: rounding > 1e-12
def test_staged_time_counts_each_chunk_write_and_both_copies(costs, nbytes, chunk):
    """Staged: one WRITE (one descriptor) per chunk and one for the aux record, the bytes once on the
    wire, and the gather and the scatter; only where the copies do not share the WRITE's memory does
    the gather of chunk i + 1 hide under chunk i's WRITE."""
    n = num_chunks(nbytes, chunk)
    assert n == -(-nbytes // chunk)
    copy = costs.copy_fixed_s + nbytes * costs.copy_s_per_byte
    wire = nbytes * costs.wire_s_per_byte
    full = (n + 1) * (costs.per_write_s + costs.per_descriptor_s) + wire + copy
    got = staged_s(costs, nbytes, chunk)
    if costs.copies_share_wire:
        assert got == pytest.approx(full, rel=1e-9)
    else:
        slack = 1e-9 * full  # float rounding, relative as in the branch above
        assert full - copy / 2 - slack <= got <= full + slack
    assert direct_s(costs, 7, nbytes) == pytest.approx(costs.per_write_s + 8 * costs.per_descriptor_s + wire, rel=1e-9)

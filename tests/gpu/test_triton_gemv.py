"""The decode-sized GEMMs (``triton_gemv.py``) against their torch references: the weight-only FP8
GEMV against ``fp8.reference_weight_only``, and the per-slot MoE GEMV against ``fused_moe_ref``.

On CPU they run under Triton's interpreter (float8 loads are exact there). Tolerances: both sides
multiply the same values and scales and differ in summation order and the final cast: fp32 1e-4,
bf16/fp16 one rounding of the dtype."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from kvferry.common.kernels import gemv_tiles
from kvferry.common.layers import fp8
from kvferry.common.layers.moe import fused_moe_ref, select_experts

pytestmark = pytest.mark.gpu
triton_gemv = pytest.importorskip("kvferry.common.kernels.triton_gemv")
split_sum = pytest.importorskip("kvferry.common.kernels.split_sum")

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
HALF = torch.float16 if DEVICE == "cpu" else torch.bfloat16
# (N out rows, K in columns): ragged N and K tails, several 128-column groups
SHAPES = [(40, 200), (130, 384), (64, 1100)]


def _weight(n: int, k: int, block: int | None, seed: int) -> fp8.Fp8Weight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    out = fp8.Fp8Weight(n, k, block, torch.device(DEVICE))
    if block is None:
        q, scale = fp8.quantize_rows(w)
    else:
        q, scale_inv = fp8.quantize_blocks(w, block)
        scale = scale_inv.repeat_interleave(block, dim=0)[:n]
    out.weight.copy_(q)
    out.scale.copy_(scale)
    return out


def _tol(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2**-7


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("rows", [1, 3, 16, 40, 128])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_fp8_gemv_equals_weight_only_reference(shape, block, rows, dtype):
    n, k = shape
    w = _weight(n, k, block, seed=n + k)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    bias = torch.randn(n, generator=g).to(DEVICE, dtype)
    got = triton_gemv.fp8_gemv(x, w.weight, w.scale, block, bias)
    want = fp8.reference_weight_only(x, w, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = _tol(dtype)
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=tol, atol=tol)


@pytest.mark.parametrize("block", [None, 128])
def test_fp8_linear_takes_the_gemv_for_decode_rows(block):
    """fp8_linear on the device: up to FP8_GEMV_MAX_ROWS rows weight-only, leading dims kept."""
    w = _weight(96, 256, block, seed=5)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    if DEVICE == "cpu":
        got = triton_gemv.fp8_gemv(x.reshape(6, 256), w.weight, w.scale, block).reshape(2, 3, 96)
    else:
        got = fp8.fp8_linear(x, w)
    want = fp8.reference_weight_only(x.reshape(6, 256), w).reshape(2, 3, 96)
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", [None, 128])
def test_fp8_linear_past_16_rows(block):
    """40 rows on the device: per-row scales W8A8 through the GEMV's FP8 dot (as reference_linear),
    block scales of a narrow weight weight-only (takes_rows)."""
    w = _weight(96, 256, block, seed=6)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE, HALF)
    if block is None:
        # the reference on CPU: torch's per-token quant on CUDA divides by a multiplication with the
        # reciprocal, one e4m3 step off the kernel's (and the CPU's) quotient now and then
        # (test_triton_fp8_gemm.py::test_per_token_quant)
        want = fp8.reference_linear(x.cpu(), copy.deepcopy(w).to("cpu"))  # (Module.to moves w itself)
        if DEVICE == "cpu":
            xq, xs = fp8.per_token_quant(x)
            got = triton_gemv.fp8_gemv(xq, w.weight, w.scale, None, x_scale=xs, out_dtype=HALF)
        else:
            got = fp8.fp8_linear(x, w)
    else:
        assert triton_gemv.takes_rows(40, 96)
        want = fp8.reference_weight_only(x, w)
        got = fp8.fp8_linear(x, w) if DEVICE == "cuda" else triton_gemv.fp8_gemv(x, w.weight, w.scale, block)
    tol = _tol(HALF)
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("shape", [(40, 96), (1000, 600), (24, 2048), (9000, 300)])
def test_dense_gemv(dtype, shape):
    """One row times a bf16/fp16/fp32 weight (use_gemv), every branch of dense_config's shapes."""
    num_out, num_in = shape
    g = torch.Generator().manual_seed(num_out)
    x = torch.randn(1, num_in, generator=g).to(DEVICE, dtype)
    weight = (torch.randn(num_out, num_in, generator=g) / num_in**0.5).to(DEVICE, dtype)
    bias = torch.randn(num_out, generator=g).to(DEVICE, dtype)
    want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(triton_gemv.gemv(x, weight, bias).float(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(triton_gemv.gemv(x, weight).float(), want - bias.float(), atol=tol, rtol=tol)


def test_dense_gemv_of_an_fp32_router_weight_returns_fp32():
    """A 16-bit row times an fp32 weight (DeepSeek's router): fp32 logits, x taken exactly, as
    F.linear(x.float(), weight) computes them; TritonBackend.linear sends a row of it here."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 2048, generator=g).to(DEVICE, HALF)
    weight = (torch.randn(64, 2048, generator=g) / 2048**0.5).to(DEVICE)
    got = triton_gemv.gemv(x, weight)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.nn.functional.linear(x.float(), weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("split_k", [2, 3, 8])
@pytest.mark.parametrize("rows", [2, 33])
def test_fp8_gemv_split_k_equals_reference(block, split_k, rows):
    """K split over programs: the parts cover K once (ragged last part, whole 128-column groups),
    the second launch adds them and the bias once; a split larger than K's steps is clamped."""
    n, k = 72, 1100
    w = _weight(n, k, block, seed=split_k)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(DEVICE)
    bias = torch.randn(n, generator=g).to(DEVICE)
    cfg = triton_gemv.GemvConfig(block_n=32, block_k=128, num_warps=4, num_stages=2, split_k=split_k)
    want = fp8.reference_weight_only(x, w, bias)
    torch.testing.assert_close(triton_gemv.fp8_gemv(x, w.weight, w.scale, block, bias, cfg).cpu(), want.cpu(),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(triton_gemv.fp8_gemv(x, w.weight, w.scale, block, None, cfg).cpu(),
                               fp8.reference_weight_only(x, w).cpu(), rtol=1e-4, atol=1e-4)


def _moe_inputs(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, seed: int):
    """x [T, 80], w13 [E, 96, 80], w2 [E, 80, 48] (past a 4-column block and a 256-wide K step's
    masks), renormalised top-k weights and ids, and an extra [T, 80] (the shared experts'), on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter = 80, 48
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=g), top_k, renormalize=True)
    extra = torch.randn(num_tokens, hidden, generator=g)
    x, w13, w2, weights, extra = (t.to(DEVICE, dtype) for t in (x, w13, w2, weights, extra))
    return x, w13, w2, weights, ids.to(DEVICE), extra


def _split_case(fp8_x: bool, split_k: int, rows: int, seed: int):
    """A per-row FP8 weight [72, 1100], ``rows`` rows of x (e4m3 with per-row scales if ``fp8_x``), a bias,
    and tiles of 32 x 128 that split K in ``split_k`` parts: (w, x, x_scale, bias, config)."""
    n, k = 72, 1100
    w = _weight(n, k, None, seed=split_k)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(DEVICE, HALF)
    bias = torch.randn(n, generator=g).to(DEVICE, HALF)
    x_scale = None
    if fp8_x:
        x, x_scale = fp8.per_token_quant(x)
    return w, x, x_scale, bias, triton_gemv.GemvConfig(block_n=32, block_k=128, num_warps=4, num_stages=2,
                                                       split_k=split_k)


@pytest.mark.parametrize("fp8_x", [False, True])
@pytest.mark.parametrize("split_k, rows", [(2, 64), (3, 2), (8, 33)])
def test_split_k_parts_added_in_the_kernel_equal_the_sum_launch(monkeypatch, fp8_x, split_k, rows):
    """The last program of each output tile adds the split-K parts (+ bias) in part order
    (SPLIT_SUM_IN_KERNEL; off by default): bit for bit the second launch's sum, with and without a bias,
    W8A16 and W8A8, the same result again on the next launch (the counts are back at 0)."""
    w, x, x_scale, bias, cfg = _split_case(fp8_x, split_k, rows, seed=rows + split_k)

    def run(b):
        return triton_gemv.fp8_gemv(x, w.weight, w.scale, None, b, cfg, x_scale=x_scale, out_dtype=HALF)

    for b in (bias, None):
        monkeypatch.setattr(triton_gemv, "SPLIT_SUM_IN_KERNEL", True)
        got = [run(b), run(b)]
        monkeypatch.setattr(triton_gemv, "SPLIT_SUM_IN_KERNEL", False)
        want = run(b)
        assert got[0].shape == (rows, w.shape[0]) and got[0].dtype == HALF
        assert torch.equal(got[0], want) and torch.equal(got[1], want)
    assert not split_sum.counters(x.device, 1).any()


@pytest.mark.parametrize("fp8_x", [False, True])
@pytest.mark.parametrize("split_k, rows", [(1, 64), (2, 64), (3, 17)])
def test_split_k_parts_deferred_to_their_consumer(fp8_x, split_k, rows):
    """``defer_sum``: a split-K GEMV hands back its fp32 parts (``SplitParts``) whose sum in part order is
    bit for bit the summed output; one split, or a bias, gives the summed output as before."""
    from kvferry.common.kernels.quant_rows import SplitParts

    w, x, x_scale, bias, cfg = _split_case(fp8_x, split_k, rows, seed=rows)

    def run(b, defer):
        return triton_gemv.fp8_gemv(x, w.weight, w.scale, None, b, cfg, x_scale=x_scale, out_dtype=HALF,
                                    defer_sum=defer)

    got = run(None, True)
    if split_k == 1:
        assert torch.equal(got, run(None, False))
    else:
        n = w.shape[0]
        assert isinstance(got, SplitParts) and got.parts.shape == (split_k, rows, n) and got.shape == (rows, n)
        assert torch.equal(got.total(), run(None, False))
        pick = torch.tensor([rows - 1, 0], device=DEVICE)
        assert torch.equal(got.index_select(0, pick).total(), run(None, False).index_select(0, pick))
    assert torch.equal(run(bias, True), run(bias, False))


@pytest.mark.parametrize("num_tokens, top_k", [(1, 8), (4, 8), (3, 6), (16, 2)])
@pytest.mark.parametrize("with_extra", [False, True])
def test_moe_slots_added_in_the_down_kernel_equal_slot_sum(monkeypatch, num_tokens, top_k, with_extra):
    """``moe_gemv``'s down projection adds each token's slots in the last of its programs for a column
    block (SLOT_SUM_IN_KERNEL; off by default): bit for bit ``slot_sum`` after a program per slot (the
    same products, slot order and roundings), twice in a row (the counts are back at 0)."""
    x, w13, w2, weights, ids, extra = _moe_inputs(num_tokens, 16, top_k, HALF, seed=num_tokens * 7 + top_k)
    extra = extra if with_extra else None
    hidden = x.shape[1]
    monkeypatch.setattr(triton_gemv, "SLOT_SUM_IN_KERNEL", True)
    got = [triton_gemv.moe_gemv(x, w13, w2, weights, ids, extra=extra) for _ in range(2)]
    monkeypatch.setattr(triton_gemv, "SLOT_SUM_IN_KERNEL", False)
    want = triton_gemv.moe_gemv(x, w13, w2, weights, ids, extra=extra)
    assert got[0].shape == (num_tokens, hidden) and got[0].dtype == HALF
    assert torch.equal(got[0], want) and torch.equal(got[1], want)
    assert not split_sum.counters(x.device, 1).any()


@pytest.mark.parametrize("rows, n, k, block", [(32, 4096, 4096, None), (64, 4096, 14336, 128), (64, 28672, 4096, None),
                                               (17, 6144, 4096, 128), (128, 4096, 4096, None), (8, 6144, 4096, None)])
def test_fp8_config_splits_k_unless_the_weight_is_wide(rows, n, k, block):
    """Several rows: whole groups a step (256 columns only for per-row scales), K split unless the
    weight (gate-up) is wide, every part at least four steps deep."""
    cfg = triton_gemv.fp8_config(rows, n, k, block)
    assert cfg.block_k % triton_gemv.GROUP == 0 and (block is None or cfg.block_k == triton_gemv.GROUP)
    assert (cfg.split_k == 1) == (n > 8192)
    assert k // cfg.split_k >= 4 * cfg.block_k


def test_fp8_gemv_takes_the_shapes_it_measured_faster():
    assert all(triton_gemv.takes_rows(rows, 28672) for rows in (1, 8, 16))
    assert not triton_gemv.takes_rows(32, 28672) and triton_gemv.takes_rows(32, 6144)
    assert triton_gemv.takes_rows(64, 4096) and not triton_gemv.takes_rows(64, 6144)
    assert not triton_gemv.takes_rows(65, 4096)


@pytest.mark.parametrize("rows, dtype", [(128, torch.float32), (64, HALF)])
def test_fp8_gemv_fits_shared_memory(rows, dtype):
    """A configuration whose x tile would overflow a block's shared memory (float32 at 128 rows, 256
    columns a step, 4 stages) runs with fewer stages or a shallower step, and agrees."""
    w = _weight(64, 512, None, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    cfg = triton_gemv.GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=2)
    fitted, block_k = gemv_tiles.fit(cfg, rows, x.element_size(), 256)
    assert (fitted.num_stages, block_k) != (4, 256) or dtype != torch.float32
    tol = _tol(dtype)
    torch.testing.assert_close(triton_gemv.fp8_gemv(x, w.weight, w.scale, None, None, cfg).float().cpu(),
                               fp8.reference_weight_only(x, w).float().cpu(), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows", [2, 40])
def test_fp8_gemv_with_an_fp8_x_equals_the_w8a8_reference(rows):
    """x quantized per token (e4m3, W8A8): the dot on FP8 tensor cores, both scales applied after."""
    w = _weight(96, 384, None, seed=rows)
    x = torch.randn(rows, 384, generator=torch.Generator().manual_seed(rows)).to(DEVICE, HALF)
    xq, xs = fp8.per_token_quant(x)
    got = triton_gemv.fp8_gemv(xq, w.weight, w.scale, None, x_scale=xs, out_dtype=HALF)
    assert got.dtype == HALF
    tol = _tol(HALF)
    torch.testing.assert_close(got.float().cpu(), fp8.reference_linear(x, w).float().cpu(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="an e4m3 x takes per-row weight scales"):
        triton_gemv.fp8_gemv(xq, w.weight, w.scale[:, None].expand(96, 3).contiguous(), 128, x_scale=xs)


def test_fp8_gemv_refuses_an_x_of_another_width():
    w = _weight(72, 1100, None, seed=11)
    with pytest.raises(ValueError, match=r"x \(1, 2200\) for a weight \(72, 1100\)"):
        triton_gemv.fp8_gemv(torch.zeros(1, 2200, dtype=HALF, device=DEVICE), w.weight, w.scale, None)


def test_fp8_linear_sends_no_more_rows_than_the_kernel_takes():
    assert 16 <= fp8.FP8_GEMV_MAX_ROWS <= triton_gemv.FP8_GEMV_MAX_ROWS


def test_fp8_gemv_refuses_prefill_rows():
    w = _weight(32, 128, None, seed=0)
    rows = triton_gemv.FP8_GEMV_MAX_ROWS + 1
    with pytest.raises(ValueError, match=f"at most {rows - 1} rows, got {rows}"):
        triton_gemv.fp8_gemv(torch.randn(rows, 128).to(DEVICE), w.weight, w.scale, None)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_one_row_gemvs_with_the_late_sum_equal_their_references(dtype):
    """``GemvConfig.late_sum``: ``gemv``, a one-row ``fp8_gemv`` (per-row scales; block scales keep their sum
    a step) and ``moe_gemv`` (both projections), with the products added per column over the K loop and summed
    once after it, against the references the sum every step meets; tiles narrowed so that each runs several K
    steps."""
    assert triton_gemv.ONE_ROW_LATE_SUM is None  # each configuration's own choice
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 300, generator=g).to(DEVICE, dtype)
    weight = (torch.randn(70, 300, generator=g) / 300**0.5).to(DEVICE, dtype)
    got = triton_gemv.gemv(x, weight, config=gemv_tiles.GemvConfig(block_n=8, block_k=128, num_warps=4, late_sum=1))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), torch.nn.functional.linear(x.float(), weight.float()), atol=tol, rtol=tol)
    for block in (None, 128):
        w = _weight(130, 1100, block, seed=3)
        x = torch.randn(1, 1100, generator=g).to(DEVICE, dtype)
        got = triton_gemv.fp8_gemv(x, w.weight, w.scale, block, config=gemv_tiles.GemvConfig(16, 256, 4, late_sum=1))
        torch.testing.assert_close(got.float(), fp8.reference_weight_only(x, w, None).float(), rtol=_tol(dtype),
                                   atol=_tol(dtype))
    hidden, inter, num_experts, top_k = 80, 48, 8, 3  # 3 and 2 K steps of 32
    x = torch.randn(2, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    weights, ids = select_experts(torch.randn(2, num_experts, generator=g), top_k, renormalize=True)
    x, w13, w2, weights = (t.to(DEVICE, dtype) for t in (x, w13, w2, weights))
    narrow = gemv_tiles.GemvConfig(block_n=16, block_k=32, num_warps=4, late_sum=1)
    got = triton_gemv.moe_gemv(x, w13, w2, weights, ids.to(DEVICE), configs=(narrow, narrow))
    torch.testing.assert_close(got.float(), fused_moe_ref(x, w13, w2, weights, ids.to(DEVICE)).float(),
                               rtol=1e-5 if dtype == torch.float32 else 2**-7,
                               atol=1e-5 if dtype == torch.float32 else 1e-2)


def test_moe_gemv_asks_the_rules_for_a_gate_up_and_a_down_with_its_silu(monkeypatch):
    """``moe_gemv`` without configurations takes the gate-up's tiles as a plain projection and the down's as
    the one that makes silu(gate) * up as it reads (``moe_config``'s ``silu``: the late sum for the first only)."""
    asked, rules = [], triton_gemv.moe_config
    monkeypatch.setattr(triton_gemv, "moe_config", lambda n, k, silu=False: asked.append((n, k, silu)) or
                        rules(n, k, silu))
    g = torch.Generator().manual_seed(5)
    hidden, inter, num_experts = 64, 48, 4
    weights, ids = select_experts(torch.randn(1, num_experts, generator=g), 2, renormalize=True)
    got = triton_gemv.moe_gemv(torch.randn(1, hidden, generator=g).to(DEVICE, HALF),
                               torch.randn(num_experts, 2 * inter, hidden, generator=g).to(DEVICE, HALF) / 8,
                               torch.randn(num_experts, hidden, inter, generator=g).to(DEVICE, HALF) / 8,
                               weights.to(DEVICE, HALF), ids.to(DEVICE))
    assert asked == [(2 * inter, hidden, False), (hidden, inter, True)] and got.isfinite().all()


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 8, 2), (1, 16, 8), (4, 8, 8), (3, 64, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_moe_gemv_equals_reference(num_tokens, num_experts, top_k, dtype):
    # hidden 80 and inter 48: not multiples of the blocks, so the K and N masks are exercised
    g = torch.Generator().manual_seed(num_tokens * 100 + top_k)
    hidden, inter = 80, 48
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=g), top_k, renormalize=True)
    x, w13, w2, weights = (t.to(DEVICE, dtype) for t in (x, w13, w2, weights))
    ids = ids.to(DEVICE)
    extra = torch.randn(num_tokens, hidden, generator=g).to(DEVICE, dtype)  # DeepSeek's shared experts'
    got = triton_gemv.moe_gemv(x, w13, w2, weights, ids)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    assert torch.equal(triton_gemv.moe_gemv(x, w13, w2, weights, ids, extra=extra), got + extra)  # one more rounding
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("num_tokens, top_k, hidden", [(1, 8, 2048), (3, 6, 80), (40, 2, 1030)])
def test_slot_sum_adds_each_tokens_slots_in_order(num_tokens, top_k, hidden):
    """One launch: each token's k fp32 slots added in slot order, rounded, then + extra rounded,
    bit for bit as the same sequence of torch ops."""
    g = torch.Generator().manual_seed(top_k)
    down = torch.randn(num_tokens * top_k, hidden, generator=g).to(DEVICE)
    extra = torch.randn(num_tokens, hidden, generator=g).to(DEVICE, HALF)
    slots = down.view(num_tokens, top_k, hidden)
    acc = slots[:, 0].clone()
    for j in range(1, top_k):
        acc = acc + slots[:, j]
    assert torch.equal(split_sum.slot_sum(down, top_k, HALF), acc.to(HALF))
    assert torch.equal(split_sum.slot_sum(down, top_k, HALF, extra), acc.to(HALF) + extra)
    assert torch.equal(split_sum.slot_sum(down, top_k, torch.float32), acc)


def test_moe_gemv_refuses_many_slots():
    x, ids = torch.randn(5, 16).to(DEVICE), torch.zeros(5, 8, dtype=torch.int64).to(DEVICE)
    w13, w2 = torch.randn(2, 32, 16).to(DEVICE), torch.randn(2, 16, 16).to(DEVICE)
    with pytest.raises(ValueError, match="at most 32 token slots"):
        triton_gemv.moe_gemv(x, w13, w2, torch.ones(5, 8).to(DEVICE), ids)

"""The fused MoE kernel (``triton_moe.py``) against its torch reference (``common/layers/moe.py``).

On CPU it runs under Triton's interpreter in small shapes. Tolerances: fp32 1e-5; fp16/bf16 one
rounding of the dtype (the kernel weights the down projection in fp32 before it rounds)."""

from __future__ import annotations

import os

import pytest
import torch

from kvferry.common.layers.moe import fused_moe_ref, select_experts

pytestmark = pytest.mark.gpu
triton_moe = pytest.importorskip("kvferry.common.kernels.triton_moe")

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
DTYPES = [torch.float32, torch.float16 if DEVICE == "cpu" else torch.bfloat16]


def _inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=g), top_k, renormalize=True)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights.to(dtype), ids)]


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 4, 2), (7, 8, 2), (40, 8, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_matches_reference(num_tokens, num_experts, top_k, dtype):
    # hidden 48 and inter 24 are not multiples of the kernel's blocks: the K and N masks are exercised
    x, w13, w2, weights, ids = _inputs(num_tokens, num_experts, top_k, 48, 24, dtype, seed=num_tokens)
    got = triton_moe.fused_moe(x, w13, w2, weights, ids)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    assert got.shape == want.shape and got.dtype == dtype
    # the shared experts' output, added to the rounded sum in the slot sum's launch, rounded as torch adds
    shared = torch.randn(num_tokens, 48, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    assert torch.equal(triton_moe.fused_moe(x, w13, w2, weights, ids, shared), got + shared)
    assert torch.equal(fused_moe_ref(x, w13, w2, weights, ids, shared), want + shared)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("num_slots, num_experts, block_m, skew",
                         [(2, 4, 16, False), (27, 3, 4, False), (100, 8, 16, True), (512, 128, 16, False),
                          (512, 128, 64, True), (300, 64, 32, False), (2048, 256, 16, True)])
def test_align_kernel_equals_the_torch_sort(num_slots, num_experts, block_m, skew, monkeypatch):
    """The one-launch counting sort (decode-sized slot counts) gives the torch argsort path's tensors
    exactly: chunks of slots past one (512 and 2,048 slots), experts with no slot, experts past 128
    (DeepSeek-V3's 256), and skewed routing (most slots on a few experts)."""
    gen = torch.Generator().manual_seed(num_slots + num_experts)
    if skew:
        ids = torch.randint(0, max(1, num_experts // 8), (num_slots,), generator=gen)
        ids[::7] = torch.randint(0, num_experts, (len(ids[::7]),), generator=gen)
    else:
        ids = torch.randint(0, num_experts, (num_slots,), generator=gen)
    ids = ids.view(-1, 2 if num_slots % 2 == 0 else 1).to(DEVICE)
    monkeypatch.setattr(triton_moe, "ALIGN_KERNEL_MAX_SLOTS", 4096)  # the kernel past its default bound too
    got = triton_moe.align_by_expert(ids, num_experts, block_m)
    want = triton_moe.align_by_expert_torch(ids, num_experts, block_m)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m", [(1, 4, 2, 16), (9, 3, 3, 4), (50, 8, 2, 16)])
def test_align_by_expert_blocks(num_tokens, num_experts, top_k, block_m):
    """Every slot once, sentinels elsewhere, each block one expert's slots in order."""
    ids = _inputs(num_tokens, num_experts, top_k, 16, 16, torch.float32, seed=3)[4]
    sorted_slots, block_experts = triton_moe.align_by_expert(ids, num_experts, block_m)
    num_slots = num_tokens * top_k
    real = sorted_slots[sorted_slots < num_slots]
    assert sorted(real.tolist()) == list(range(num_slots))
    assert sorted_slots.numel() == block_experts.numel() * block_m
    flat = ids.flatten().cpu()
    for b, expert in enumerate(block_experts.tolist()):
        block = [s for s in sorted_slots[b * block_m:(b + 1) * block_m].tolist() if s < num_slots]
        assert block == sorted(block)
        assert all(int(flat[s]) == expert for s in block)
        assert (expert == -1) == (not block)
    used = block_experts[block_experts >= 0].tolist()
    assert used == sorted(used)


def test_tiny_moe_model_on_the_triton_backend_equals_torch(tmp_path):
    """The whole ``tiny-moe`` model (its sparse layers through ``fused_moe``) on the triton backend
    gives the torch backend's logits: a batched prefill, then a decode step."""
    from kvferry.common.cache.kv_cache import KvCache
    from kvferry.common.layers.attn_backend import TorchBackend, TritonBackend
    from kvferry.common.models.llama import SeqChunk
    from kvferry.common.models.loader import load_model
    from kvferry.common.models.tiny import make_tiny_model

    target, _ = make_tiny_model(tmp_path, seed=4, preset="tiny-moe")
    model = load_model(target, dtype=torch.float32, device=DEVICE)
    prompts, pages = [[11, 200, 37, 5, 480], [9, 9, 301]], [[0, 1], [2]]
    logits = {}
    for backend in (TorchBackend(), TritonBackend(torch.device(DEVICE), model.shard.kv_heads.count)):
        model.attn = backend
        kv = KvCache(model.config, 4, 8, torch.float32, DEVICE)
        first = model.forward([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], kv)
        step = model.forward([SeqChunk([int(row.argmax())], len(p), pg)
                              for row, p, pg in zip(first, prompts, pages)], kv)
        logits[backend.name] = (first, step)
    for got, want in zip(logits["triton"], logits["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


TABLE_CONFIGS = sorted({triton_moe.SMALL_CONFIG, *triton_moe.DEFAULT_CONFIGS,
                        *(c for row in triton_moe.GEMM_CONFIGS.values() for c in row)})


@pytest.mark.parametrize("config", TABLE_CONFIGS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_table_config_matches_reference(config, dtype):
    """Each tile configuration of the table, forced on both GEMMs, gives ``fused_moe_ref``'s result:
    hidden 48 and inter 136 are multiples of no BLOCK_K or BLOCK_N (the masks), 2 x 136 columns take
    two programs or more at every BLOCK_N, and 70 tokens x 3 over 8 experts leave partial and empty
    blocks at every BLOCK_M and fewer row blocks than a GROUP_M of 16 (a short band)."""
    num_tokens, num_experts, top_k = 70, 8, 3
    x, w13, w2, weights, ids = _inputs(num_tokens, num_experts, top_k, 48, 136, dtype, seed=5)
    sorted_slots, block_experts = triton_moe.align_by_expert(ids, num_experts, config.block_m)
    gate_up = torch.empty(num_tokens * top_k, w13.shape[1], dtype=dtype, device=DEVICE)
    triton_moe._grouped_gemm(x, w13, gate_up, sorted_slots, block_experts, config, top_k, None)
    down = torch.empty(num_tokens * top_k, w2.shape[1], dtype=torch.float32, device=DEVICE)
    triton_moe._grouped_gemm(triton_moe.silu_mul(gate_up), w2, down, sorted_slots, block_experts, config, 1,
                             weights.flatten().contiguous())
    got = down.view(num_tokens, top_k, -1).sum(dim=1).to(dtype)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-2)


def test_gemm_config_by_shape_and_slots_per_expert():
    """Up to 512 slots the small configuration; beyond, the (N, K) row's bucket by slots per expert,
    the default rows for a shape outside the table; both GEMMs of a preset agree on BLOCK_M."""
    pick = triton_moe.gemm_config
    assert pick(1536, 2048, 512, 128) == triton_moe.SMALL_CONFIG
    qwen = triton_moe.GEMM_CONFIGS[(1536, 2048)]
    assert [pick(1536, 2048, t * 8, 128) for t in (128, 256, 1024, 8192)] == list(qwen)
    assert pick(1536, 2048, 2047, 128) == qwen[0] and pick(1536, 2048, 2048, 128) == qwen[1]
    assert pick(100, 200, 8192 * 8, 128) == triton_moe.DEFAULT_CONFIGS[-1]
    for (n, k), row in triton_moe.GEMM_CONFIGS.items():
        partner = triton_moe.GEMM_CONFIGS[(k, n // 2)] if (k, n // 2) in triton_moe.GEMM_CONFIGS else None
        if partner is not None:  # (2I, H) and (H, I): w13's and w2's rows
            assert [c.block_m for c in row] == [c.block_m for c in partner]


def test_fused_moe_past_the_small_configuration_matches_reference():
    """fused_moe itself over more than 512 slots, where the table's rows take over."""
    x, w13, w2, weights, ids = _inputs(300, 8, 2, 48, 24, torch.float32, seed=6)
    assert triton_moe.gemm_config(48, 48, 600, 8) != triton_moe.SMALL_CONFIG
    torch.testing.assert_close(triton_moe.fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_fp32_tiles_fit_shared_memory():
    """The table's largest bf16 row, in float32, is cut to fit (the H200 refused it as out of
    resources); bf16 rows that fit are left alone."""
    big = triton_moe.GemmConfig(128, 256, 64, 16, 8, 4)
    assert triton_moe.fit_shared_memory(big, 2) == big
    fitted = triton_moe.fit_shared_memory(big, 4)
    assert fitted.num_stages * (fitted.block_m + fitted.block_n) * fitted.block_k * 4 <= triton_moe.SHARED_MEMORY_BYTES
    assert fitted[:2] == big[:2] and fitted.num_stages < big.num_stages


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 128, 8), (5, 64, 6), (3, 60, 2), (2, 8, 1)])
@pytest.mark.parametrize("renormalize, scale, eps", [(True, 1.0, 0.0), (False, 1.0, 0.0), (True, 1.0, 1e-20),
                                                     (False, 2.5, 1e-20)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_topk_equals_select_experts(num_tokens, num_experts, top_k, renormalize, scale, eps, dtype):
    """The one-launch router against moe.select_experts: the same experts in the same (descending)
    order, and their weights to within one rounding of the output dtype (60 experts: a ragged block)."""
    g = torch.Generator().manual_seed(num_experts + top_k)
    # distinct logits (a permutation of a grid as wide as randn's), so that no two experts tie in any dtype
    grid = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(num_tokens)]).float()
    logits = ((grid - num_experts / 2) * (6.0 / num_experts)).to(dtype).to(DEVICE)
    want_w, want_ids = select_experts(logits, top_k, renormalize, scale, eps)
    got_w, got_ids = triton_moe.softmax_topk(logits, top_k, renormalize, dtype, scale, eps)
    assert got_ids.dtype == torch.int64 and got_w.dtype == dtype and got_w.shape == (num_tokens, top_k)
    assert torch.equal(got_ids.cpu(), want_ids.cpu())
    # both round the same fp32 weight (up to exp's last bit) to the dtype: at most one ulp apart
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got_w.float().cpu(), want_w.float().cpu(), rtol=tol, atol=2**-10)
    fp32_w, _ = triton_moe.softmax_topk(logits, top_k, renormalize, torch.float32, scale, eps)  # DeepSeek's fp32
    torch.testing.assert_close(fp32_w.cpu(), select_experts(logits, top_k, renormalize, scale, eps,
                                                            torch.float32)[0].cpu(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, shared", [(1, 64, 6, 2), (3, 60, 2, 1), (2, 8, 1, 3)])
def test_softmax_topk_appends_the_shared_experts(num_tokens, num_experts, top_k, shared):
    """DeepSeek's shared experts after the routed picks: ids E .. E + shared - 1, weight 1, in the same
    launch, as moe.select_experts(shared=) appends them (the routed columns unchanged)."""
    g = torch.Generator().manual_seed(num_experts + shared)
    grid = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(num_tokens)]).float()
    logits = ((grid - num_experts / 2) * (6.0 / num_experts)).to(DEVICE)
    want_w, want_ids = select_experts(logits, top_k, False, 2.0, 1e-20, torch.float32, shared)
    got_w, got_ids = triton_moe.softmax_topk(logits, top_k, False, torch.float32, 2.0, 1e-20, shared)
    assert got_ids.shape == got_w.shape == (num_tokens, top_k + shared)
    assert torch.equal(got_ids.cpu(), want_ids.cpu())
    assert torch.equal(got_ids[:, top_k:].cpu(), torch.arange(num_experts, num_experts + shared).expand(num_tokens, -1))
    assert torch.equal(got_w[:, top_k:].cpu(), torch.ones(num_tokens, shared))
    torch.testing.assert_close(got_w.cpu(), want_w.cpu(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_experts, hidden, top_k, shared", [(64, 2048, 6, 2), (128, 80, 8, 0), (60, 1100, 2, 1)])
@pytest.mark.parametrize("weight_dtype", DTYPES)
@pytest.mark.parametrize("renormalize, scale", [(True, 1.0), (False, 2.5)])
def test_router_in_one_launch_equals_the_gemv_then_softmax_topk(num_experts, hidden, top_k, shared, weight_dtype,
                                                                renormalize, scale):
    """``router_topk``: the router's logits with the one-row GEMV's tiles, then the picks by the last
    of the token's programs, bit for bit ``gemv`` then ``softmax_topk`` (weights, ids and the shared
    experts' columns), an fp32 router weight (DeepSeek's: fp32 logits) or one in the model dtype, a
    token a row of x; twice in a row (the counts are back at 0)."""
    from kvferry.common.kernels import split_sum, triton_gemv

    g = torch.Generator().manual_seed(num_experts + hidden)
    half = DTYPES[1]
    weight = (torch.randn(num_experts, hidden, generator=g) / hidden**0.5).to(DEVICE, weight_dtype)
    x = torch.randn(3, hidden, generator=g).to(DEVICE, half)
    out_dtype = torch.promote_types(half, weight_dtype)
    for t in range(3):
        row = x[t:t + 1]
        logits = triton_gemv.gemv(row, weight)
        want = triton_moe.softmax_topk(logits, top_k, renormalize, out_dtype, scale, 1e-20, shared)
        for _ in range(2):
            got = triton_moe.router_topk(row, weight, top_k, renormalize, out_dtype, scale, 1e-20, shared)
            assert got[0].shape == (1, top_k + shared) and got[0].dtype == out_dtype
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not split_sum.counters(x.device, 1).any()


@pytest.mark.parametrize("num_tokens, top_k", [(1, 4), (3, 2), (20, 3)])  # 4, 6 slots: moe_gemv; 60: grouped
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_slots_added_by_the_next_norm_equal_the_slot_sum_then_the_norm(num_tokens, top_k, dtype):
    """``fused_moe(defer_sum=True)`` hands back the weighted slots unsummed (``SplitParts.of_slots``: part j
    is every token's slot j); their total and ``add_rms_norm`` over them equal the slot sum and the norm over
    it bit for bit. With an extra (unfolded shared experts) the sum stays in the slot sum's launch."""
    from kvferry.common.kernels import triton_fused
    from kvferry.common.kernels.quant_rows import SplitParts

    x, w13, w2, weights, ids = _inputs(num_tokens, 8, top_k, 64, 48, dtype, seed=num_tokens)
    summed = triton_moe.fused_moe(x, w13, w2, weights, ids)
    parts = triton_moe.fused_moe(x, w13, w2, weights, ids, defer_sum=True)
    assert isinstance(parts, SplitParts) and parts.parts.shape == (top_k, num_tokens, 64)
    assert torch.equal(parts.total(), summed)
    residual, norm = torch.randn_like(x), torch.rand(64, dtype=dtype, device=DEVICE) + 0.5
    for got, want in zip(triton_fused.add_rms_norm(residual, parts, norm, 1e-6),
                         triton_fused.add_rms_norm(residual, summed, norm, 1e-6)):
        assert torch.equal(got, want)
    last = torch.tensor([num_tokens - 1], device=DEVICE)  # final_norm's rows: still parts
    assert torch.equal(parts.index_select(0, last).total(), summed.index_select(0, last))
    extra = torch.randn_like(x)
    assert torch.equal(triton_moe.fused_moe(x, w13, w2, weights, ids, extra, defer_sum=True),
                       triton_moe.fused_moe(x, w13, w2, weights, ids, extra))


@pytest.mark.parametrize("preset", ["tiny-moe", "deepseek-v2-tiny"])
def test_moe_blocks_leave_their_slot_sum_to_the_next_norm(tmp_path, monkeypatch, preset):
    """A whole tiny MoE model on the triton backend, a prefill then a decode step: each sparse layer's
    slots are added by the next add_norm's launch (``moe_sum_in_norm``), so no layer runs ``slot_sum``'s
    launch; the logits equal those of the slot sum launch bit for bit."""
    from kvferry.common.kernels import split_sum
    from kvferry.common.layers.attn_backend import TritonBackend
    from kvferry.common.models.llama import SeqChunk
    from kvferry.common.models.loader import load_model
    from kvferry.common.models.tiny import make_tiny_model

    target, _ = make_tiny_model(tmp_path, seed=4, preset=preset)
    model = load_model(target, dtype=DTYPES[1], device=DEVICE)
    model.attn = TritonBackend(torch.device(DEVICE), model.shard.kv_heads.count)
    calls = []
    real = split_sum.sum_parts  # slot_sum's launch
    monkeypatch.setattr(split_sum, "sum_parts", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prompts, pages = [[11, 200, 37, 5, 480], [9, 9, 301]], [[0, 1], [2]]
    runs = {}
    for in_norm in (True, False):
        model.attn.moe_sum_in_norm = in_norm
        calls.clear()
        kv = type(model).make_kv_cache(model.config, 4, 8, DTYPES[1], DEVICE)
        first = model.forward([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], kv)
        step = model.forward([SeqChunk([int(row.argmax())], len(p), pg)
                              for row, p, pg in zip(first, prompts, pages)], kv)
        runs[in_norm] = (first, step, len(calls))
    sparse = sum(hasattr(layer, "moe") or type(getattr(layer, "mlp", None)).__name__ == "MoeBlock"
                 for layer in model.layers)
    assert sparse > 0 and (runs[True][2], runs[False][2]) == (0, 2 * sparse)
    assert torch.equal(runs[True][0], runs[False][0]) and torch.equal(runs[True][1], runs[False][1])

"""The MoE block's torch path (``common/layers/moe.py``) against a naive per-token loop: routing
(softmax, top-k, renormalisation) and ``fused_moe_ref``'s sort-by-expert matmuls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvferry.common.layers.moe import fused_moe_ref, select_experts, sort_by_expert


def _naive(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate, up = w13[e, :inter].double() @ x[t].double(), w13[e, inter:].double() @ x[t].double()
            out[t] += float(topk_weights[t, j]) * (w2[e].double() @ (F.silu(gate) * up))
    return out


def _case(num_tokens: int, num_experts: int, seed: int, hidden: int = 24, inter: int = 10):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    return x, w13, w2, torch.randn(num_tokens, num_experts, generator=g)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, renormalize",
                         [(1, 4, 1, False), (9, 8, 2, True), (33, 8, 3, False), (5, 16, 8, True)])
def test_fused_moe_ref_equals_a_per_token_loop(num_tokens, num_experts, top_k, renormalize):
    x, w13, w2, logits = _case(num_tokens, num_experts, seed=num_tokens)
    weights, ids = select_experts(logits, top_k, renormalize)
    got = fused_moe_ref(x, w13, w2, weights, ids)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), _naive(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_select_experts_is_softmax_then_topk():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 5.5, 0.0]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 3], [2, 0]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    renormed, same_ids = select_experts(logits, 2, renormalize=True)
    assert torch.equal(same_ids, ids)
    torch.testing.assert_close(renormed.sum(-1), torch.ones(2))
    torch.testing.assert_close(renormed, weights / weights.sum(-1, keepdim=True))


def test_sort_by_expert_groups_every_slot_once():
    ids = torch.tensor([[3, 0], [0, 2], [3, 1], [0, 3]])
    order, counts = sort_by_expert(ids, num_experts=5)
    assert counts.tolist() == [3, 1, 1, 3, 0]
    assert sorted(order.tolist()) == list(range(8))
    assert ids.flatten()[order].tolist() == [0, 0, 0, 1, 2, 3, 3, 3]
    assert order.tolist()[:3] == [1, 2, 6]  # stable: slot order within an expert


def test_unrouted_experts_change_nothing():
    """Weights of experts no token picks never enter the output."""
    x, w13, w2, logits = _case(6, 8, seed=7)
    weights, ids = select_experts(logits, 2, True)
    unused = sorted(set(range(8)) - set(ids.flatten().tolist()))
    assert unused, "the case needs an expert no token picks"
    w13b, w2b = w13.clone(), w2.clone()
    w13b[unused], w2b[unused] = float("nan"), float("nan")
    assert torch.equal(fused_moe_ref(x, w13, w2, weights, ids), fused_moe_ref(x, w13b, w2b, weights, ids))

"""bench/engine.py's roofline arithmetic (``bench/_roofline.py``), on CPU: a dense model reads every
weight, a MoE model its dense weights plus the experts a batch touches, and the split of a real
tiny-moe model's parameters finds its sparse layers and experts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench._roofline import (WeightBytes, active_params_per_token, decode_roofline_ms, expected_experts_touched,
                             moe_decode_fields, split_weights)


def test_one_token_touches_top_k_experts_and_a_large_batch_nearly_all():
    assert expected_experts_touched(8, 2, 1) == pytest.approx(2.0)
    assert expected_experts_touched(8, 2, 0) == 0.0
    assert expected_experts_touched(128, 8, 2) == pytest.approx(128 * (1 - (120 / 128) ** 2))  # 15.5
    assert expected_experts_touched(128, 8, 256) == pytest.approx(128.0, rel=1e-6)
    assert expected_experts_touched(4, 4, 3) == 4.0  # top_k = E: every expert, every step


@given(st.integers(1, 256), st.data())
def test_experts_touched_stays_between_k_and_e_and_rises_with_batch(num_experts, data):
    top_k = data.draw(st.integers(1, num_experts))
    batch = data.draw(st.integers(1, 512))
    now, more = (expected_experts_touched(num_experts, top_k, b) for b in (batch, batch + 1))
    assert top_k - 1e-9 <= now <= num_experts + 1e-9
    assert more >= now - 1e-9
    # the union bound: b tokens reach at most b * k experts
    assert now <= batch * top_k + 1e-9


@pytest.mark.parametrize("num_experts,top_k,batch", [(8, 0, 1), (8, 9, 1), (0, 0, 1), (8, 2, -1)])
def test_impossible_routing_is_refused_with_its_values(num_experts, top_k, batch):
    with pytest.raises(ValueError, match=f"top_k={top_k}, num_experts={num_experts}, batch={batch}"):
        expected_experts_touched(num_experts, top_k, batch)


def test_a_dense_model_reads_every_weight_and_adds_no_fields():
    params = [("layers.0.qkv_weight", 1000, 2), ("layers.0.gate_up_weight", 3000, 2), ("lm_head", 500, 2)]
    w = split_weights(params)
    assert w == WeightBytes(dense_bytes=9000, dense_params=4500)
    # (9,000 weight bytes + 1,000 KV bytes) at 1 GB/s: 10 us
    assert decode_roofline_ms(w, batch=8, kv_bytes=1000, hbm_gb_s=1.0) == pytest.approx(0.01)
    assert moe_decode_fields(w, batch=8) == {}
    assert active_params_per_token(w) == 4500


def test_a_moe_step_reads_the_dense_weights_and_the_experts_touched():
    # two sparse layers of 4 experts, each expert 100 params of w13 and 50 of w2 in 2-byte elements
    params = [("layers.0.qkv_weight", 1000, 2), ("layers.0.moe.gate_weight", 40, 2),
              ("layers.0.moe.w13", 400, 2), ("layers.0.moe.w2", 200, 2),
              ("layers.1.qkv_weight", 1000, 2), ("layers.1.moe.gate_weight", 40, 2),
              ("layers.1.moe.w13", 400, 2), ("layers.1.moe.w2", 200, 2), ("lm_head", 920, 2)]
    w = split_weights(params, num_experts=4, top_k=2)
    assert w == WeightBytes(dense_bytes=6000, dense_params=3000, num_sparse_layers=2, num_experts=4, top_k=2,
                            expert_bytes=300, expert_params=150)
    # one token: its two experts in each of the two sparse layers (1 MB/s: bytes / 1e3 ms)
    assert moe_decode_fields(w, batch=1) == {"experts_touched_per_layer": 2.0, "experts_touched_source": "expected",
                                             "weight_bytes_read": 6000 + 2 * 2 * 300}
    assert decode_roofline_ms(w, batch=1, kv_bytes=0, hbm_gb_s=1e-3) == pytest.approx(7200 / 1e3)
    # batch 3 touches 4 * (1 - (1/2)^3) = 3.5 experts per layer; 500 KV bytes on top
    assert moe_decode_fields(w, batch=3)["weight_bytes_read"] == 6000 + 2 * 3.5 * 300
    assert decode_roofline_ms(w, batch=3, kv_bytes=500, hbm_gb_s=1e-3) == pytest.approx((6000 + 2100 + 500) / 1e3)
    # each token multiplies through its two experts of each sparse layer
    assert active_params_per_token(w) == 3000 + 2 * 2 * 150


def test_deepseeks_shared_experts_stacked_after_the_routed_count_as_dense():
    # one sparse layer of 4 routed + 2 shared experts stacked ([6, ...]), 150 params each: the 2 shared are read
    # by every step whatever the routing, so they are dense; an expert's size is the stack's over 6
    params = [("layers.0.qkv_weight", 1000, 2), ("layers.0.mlp.w13", 600, 2), ("layers.0.mlp.w2", 300, 2)]
    w = split_weights(params, num_experts=4, top_k=2, shared=2)
    assert w == WeightBytes(dense_bytes=2000 + 2 * 300, dense_params=1000 + 2 * 150, num_sparse_layers=1,
                            num_experts=4, top_k=2, expert_bytes=300, expert_params=150)
    assert moe_decode_fields(w, batch=1)["weight_bytes_read"] == 2600 + 2 * 300  # the two routed on top
    assert active_params_per_token(w) == 1300 + 2 * 150


def test_sparse_layers_without_num_experts_are_refused():
    with pytest.raises(ValueError, match="1 sparse layers but num_experts=0"):
        split_weights([("layers.0.moe.w13", 400, 2)])


def test_split_of_the_tiny_moe_model_counts_its_sparse_layers(tmp_path):
    """tiny-moe: 4 layers, layer 1 dense; 8 experts of 3 x 32 x 64 parameters each."""
    import torch

    from kvferry.common.engine.factory import build_runner
    from kvferry.common.models.tiny import make_tiny_model

    torch.set_num_threads(1)
    target, _ = make_tiny_model(tmp_path, seed=0, preset="tiny-moe")
    model = build_runner(str(target), page_size=16, max_total_tokens=256).target.model
    named = [(n, p.numel(), p.element_size()) for n, p in model.named_parameters() if n != "embed"]
    w = split_weights(named, model.config.moe.num_experts, model.config.moe.num_experts_per_tok)
    assert (w.num_sparse_layers, w.num_experts, w.top_k) == (3, 8, 2)
    assert (w.expert_params, w.expert_bytes) == (3 * 32 * 64, 3 * 32 * 64 * 4)
    assert w.dense_params + 3 * 8 * w.expert_params == sum(n for _, n, _ in named)
    assert moe_decode_fields(w, 64)["experts_touched_per_layer"] == pytest.approx(8 * (1 - 0.75**64), abs=0.005)

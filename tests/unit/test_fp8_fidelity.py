"""FP8 fidelity against a derived bound: the FP8 GEMM of every linear, at every step of a prefill
and several decode steps of the tiny checkpoint, stays within the error the activations' e4m3
rounding can cause, next to a reference that holds the same (dequantised) weights in fp32.

The bound. An FP8 linear computes ``y' = Q(x) @ W^T`` where ``W`` is the dequantised weight (exactly
what the reference multiplies by: the weights' own rounding is shared) and ``Q(x)`` rounds each
activation to e4m3 after dividing by its scale ``s`` (one per token, or per token and 128-column
group for block checkpoints, ``s = amax / 448``). e4m3 keeps 3 mantissa bits: a scaled value in
the normal range (``|x / s| >= 2^-6``) is rounded to within half a spacing, ``2^-4 |x|``; a
subnormal one to within ``2^-10 s``. So, per output element,

    |y' - y| <= sum_i |Q(x)_i - x_i| |W_ji| <= 2^-4 (|x| @ |W|^T)_j + 2^-10 sum_groups s_g (sum_{i in g} |W_ji|)

plus the two fp32 matmuls' accumulation, at most ``K * 2^-24`` of ``(|x| @ |W|^T)`` each. The test
feeds both GEMMs the reference's own inputs at every linear (the reference model runs; each call
is checked against the FP8 weight of the same linear), so the bound is per step and per linear,
not compounded through the layers. It is also tight: the largest error reaches a fraction of it.
"""

from __future__ import annotations

import pytest
import torch

from kvferry.common.cache.kv_cache import KvCache
from kvferry.common.layers import fp8
from kvferry.common.models.llama import SeqChunk
from kvferry.common.models.loader import load_model
from kvferry.common.models.tiny import make_tiny_model

PAGE = 16
LINEARS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


def _bound(x: torch.Tensor, w: fp8.Fp8Weight) -> torch.Tensor:
    """The bound above for x [T, K] through ``w``: [T, out]."""
    flat = x.reshape(-1, x.shape[-1]).float()
    dq = w.dequantize().abs()
    k = flat.shape[1]
    group = k if w.block is None else w.block
    pad = (-k) % group
    groups = torch.nn.functional.pad(flat.abs(), (0, pad)).view(flat.shape[0], -1, group)
    scales = groups.amax(dim=2).clamp(min=fp8.MIN_AMAX) / fp8.FP8_MAX  # [T, G]
    w_groups = torch.nn.functional.pad(dq, (0, pad)).view(dq.shape[0], -1, group).sum(dim=2)  # [out, G]
    magnitude = flat.abs() @ dq.t()
    return 2**-4 * magnitude + 2**-10 * (scales @ w_groups.t()) + 2 * k * 2**-24 * magnitude


@pytest.mark.parametrize("quantize", ["fp8-channel", "fp8-block"])
def test_every_fp8_linear_stays_within_the_activation_rounding_bound(tmp_path, quantize):
    torch.manual_seed(0)
    quantized_dir, _ = make_tiny_model(tmp_path / "q", quantize=quantize)
    plain_dir, _ = make_tiny_model(tmp_path / "p")
    fp8_model = load_model(quantized_dir, dtype="float32", device="cpu")
    reference = load_model(plain_dir, dtype="float32", device="cpu")
    by_weight = {}
    for ref_layer, q_layer in zip(reference.layers, fp8_model.layers):
        for name in LINEARS:
            w = getattr(q_layer, name)
            assert isinstance(w, fp8.Fp8Weight), name
            getattr(ref_layer, name).data.copy_(w.dequantize())  # the same weights, in fp32
            by_weight[id(getattr(ref_layer, name))] = w
    checked, worst = 0, 0.0
    linear = reference.attn.linear

    def checking_linear(x, weight, bias=None, to_add_norm=False):  # the torch backend: always summed
        nonlocal checked, worst
        out = linear(x, weight, bias, to_add_norm)
        w = by_weight.get(id(weight))
        if w is not None:
            got = fp8.reference_linear(x, w, bias).reshape(out.shape)
            error = (got - out).abs().reshape(-1, out.shape[-1])
            bound = _bound(x, w)
            assert (error <= bound).all(), f"{quantize}: error {error.max():.3g} past the bound {bound.max():.3g}"
            worst = max(worst, float((error / bound.clamp(min=1e-30)).max()))
            checked += 1
        return out

    reference.attn.linear = checking_linear
    prompt = [(7 * j) % 500 + 5 for j in range(40)]
    kv = KvCache(reference.config, 8, PAGE, torch.float32, "cpu")
    pages = list(range(8))
    token = int(reference.forward([SeqChunk(prompt, 0, pages)], kv).argmax(-1)[0])
    for step in range(4):  # decode steps, one token each
        token = int(reference.forward([SeqChunk([token], len(prompt) + step, pages)], kv).argmax(-1)[0])
    assert checked == 5 * len(LINEARS) * reference.config.num_hidden_layers
    print(f"{quantize}: {checked} GEMMs, largest error {worst:.3f} of its bound")
    assert 0.01 < worst <= 1.0  # the rounding shows, and the bound is not vacuous

"""What one engine step must read and compute, for ``bench/engine.py``'s rooflines: pure arithmetic
over parameter sizes, no device.

A dense model reads every weight each decode step. A MoE model reads its dense weights (attention,
norms, routers, dense MLPs, lm_head) and, in each sparse layer, only the experts the batch's tokens
were routed to: with ``top_k`` of ``num_experts`` picked per token, independently and uniformly, a
batch of ``b`` tokens touches ``E * (1 - (1 - k/E)^b)`` distinct experts per layer in expectation
(``expected_experts_touched``). Prefill FLOPs count each token through its ``top_k`` experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class WeightBytes:
    """A model's weights split by how a step reads them. ``expert_bytes`` and ``expert_params`` are
    one expert of one sparse layer (its gate, up and down projections); zero for a dense model."""

    dense_bytes: int
    dense_params: int
    num_sparse_layers: int = 0
    num_experts: int = 0
    top_k: int = 0
    expert_bytes: int = 0
    expert_params: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_sparse_layers > 0


def expected_experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a batch of ``batch`` tokens reaches in one sparse layer, in expectation, when
    each token picks ``top_k`` of ``num_experts``: each expert is missed by one token with
    probability ``1 - k/E``, by all of them with ``(1 - k/E)^b``. Between ``min(k, E)`` (b = 1: k)
    and ``E``; rises with ``batch``."""
    if not 0 < top_k <= num_experts or batch < 0:
        raise ValueError(f"expected 0 < top_k <= num_experts and batch >= 0; got top_k={top_k}, "
                         f"num_experts={num_experts}, batch={batch}")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def split_weights(params: Iterable[tuple[str, int, int]], num_experts: int = 0, top_k: int = 0,
                  shared: int = 0) -> WeightBytes:
    """``params``: (name, numel, element bytes) of every weight a step reads (the embedding table
    left out unless tied to lm_head). Names ending ``.moe.w13`` / ``.moe.w2`` (Qwen3-MoE) or
    ``.mlp.w13`` / ``.mlp.w2`` (DeepSeek's experts) are a sparse layer's stacked experts
    ``[E + shared, ...]`` (``common/layers/moe.py``): the last ``shared`` (DeepSeek's shared experts,
    every token's) count as dense; everything else is dense. An FP8
    linear's ``.scale`` (``common/layers/fp8.py``) is read with its weight but multiplies nothing:
    its bytes count, not its elements."""
    dense_bytes = dense_params = expert_bytes = expert_params = 0
    sparse_layers: set[str] = set()
    for name, numel, element_bytes in params:
        if name.endswith(".scale"):
            dense_bytes += numel * element_bytes
            continue
        layer, _, kind = name.rpartition(".moe.")
        if not layer:  # DeepSeek's routed experts: ``layers.{i}.mlp.w13`` / ``.w2`` (shared experts apart)
            layer, _, kind = name.rpartition(".mlp.")
        if kind in ("w13", "w2") and layer:
            sparse_layers.add(layer)
            expert_bytes += numel * element_bytes
            expert_params += numel
        else:
            dense_bytes += numel * element_bytes
            dense_params += numel
    if not sparse_layers:
        return WeightBytes(dense_bytes, dense_params)
    if num_experts <= 0:
        raise ValueError(f"{len(sparse_layers)} sparse layers but num_experts={num_experts}")
    per_expert = len(sparse_layers) * (num_experts + shared)
    one_bytes, one_params = expert_bytes // per_expert, expert_params // per_expert
    always = len(sparse_layers) * shared  # the shared experts: read by every step, whatever the routing
    return WeightBytes(dense_bytes + always * one_bytes, dense_params + always * one_params, len(sparse_layers),
                       num_experts, top_k, one_bytes, one_params)


def decode_weight_bytes(w: WeightBytes, experts_touched: float) -> float:
    """Weight bytes of one decode step in which each sparse layer reads ``experts_touched`` experts."""
    return w.dense_bytes + w.num_sparse_layers * experts_touched * w.expert_bytes


def decode_roofline_ms(w: WeightBytes, batch: int, kv_bytes: int, hbm_gb_s: float) -> float:
    """The decode step's floor in ms: (weights read + ``kv_bytes``) over ``hbm_gb_s``, a MoE model's
    sparse layers each reading ``expected_experts_touched`` experts."""
    touched = expected_experts_touched(w.num_experts, w.top_k, batch) if w.is_moe else 0.0
    return (decode_weight_bytes(w, touched) + kv_bytes) / hbm_gb_s / 1e6


def moe_decode_fields(w: WeightBytes, batch: int) -> dict:
    """What a MoE decode row adds: the experts per sparse layer the roofline counts, where that
    count comes from ("expected": not measured), and the weight bytes a step reads; ``{}`` for dense."""
    if not w.is_moe:
        return {}
    touched = expected_experts_touched(w.num_experts, w.top_k, batch)
    return {"experts_touched_per_layer": round(touched, 2), "experts_touched_source": "expected",
            "weight_bytes_read": round(decode_weight_bytes(w, touched))}


def active_params_per_token(w: WeightBytes) -> int:
    """Parameters one token multiplies through in a forward: the dense ones and its top_k experts."""
    return w.dense_params + w.num_sparse_layers * w.top_k * w.expert_params

"""The DeepSeek-V2/V3 part of a ``config.json``: multi-head latent attention (MLA) and the MoE router.

``ModelConfig.deepseek`` holds a ``DeepseekSpec`` for ``DeepseekV2ForCausalLM`` and
``DeepseekV3ForCausalLM`` checkpoints and None for every other family. Parsed once, here, from the
same ``_Fields`` reader ``config.py`` uses (passed in, so this module imports nothing of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# V2 routers: softmax scores, then top-k over all experts or over the best groups (by their best
# expert). V3: sigmoid scores plus a learned per-expert bias for the choice, groups ranked by the
# sum of their two best experts ("noaux_tc").
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
V3_TOPK_METHODS = ("noaux_tc",)


@dataclass(frozen=True)
class DeepseekSpec:
    """MLA and MoE settings of one DeepSeek checkpoint (names as in ``config.json``).

    MLA: q through ``q_lora_rank`` (None: one plain q_proj), K/V through one latent of
    ``kv_lora_rank`` per token plus a shared roped key of ``qk_rope_head_dim``; the KV cache holds
    ``latent_width = kv_lora_rank + qk_rope_head_dim`` elements per token and layer.
    MoE: layer i is MoE when ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``.
    """

    version: int  # 2 or 3
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    is_rope_interleaved: bool  # pairs (x0, x1), (x2, x3), ...: V2 always, V3 when rope_interleave
    has_attention_bias: bool  # q_a_proj, kv_a_proj_with_mqa and o_proj
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    topk_method: str
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool

    @property
    def latent_width(self) -> int:
        """Elements of one token's cache row: the latent, then the roped key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0


def parse_deepseek(f: Any, architecture: str) -> DeepseekSpec:
    """``f`` is ``config._Fields``; raises its ModelLoadError naming the file and the field."""
    version = 3 if architecture == "DeepseekV3ForCausalLM" else 2
    if f.raw.get("quantization_config") is not None:
        raise f.error("quantization_config", f"is set ({f.raw['quantization_config'].get('quant_method', '?')}); "
                      f"{architecture} loads unquantized weights only: convert the checkpoint to bfloat16 first")
    if f.get("mlp_bias", bool, False):
        raise f.error("mlp_bias", f"is true; {architecture} checkpoints carry no MLP biases and this model code "
                      "reads none")
    q_lora_rank = f.raw.get("q_lora_rank")
    if q_lora_rank is not None:
        q_lora_rank = f.positive("q_lora_rank")
    rope_dim = f.positive("qk_rope_head_dim")
    if rope_dim % 2:
        raise f.error("qk_rope_head_dim", f"is {rope_dim}, expected an even number (rotary pairs)")
    return DeepseekSpec(
        version=version,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=f.positive("kv_lora_rank"),
        qk_nope_head_dim=f.positive("qk_nope_head_dim"),
        qk_rope_head_dim=rope_dim,
        v_head_dim=f.positive("v_head_dim"),
        is_rope_interleaved=version == 2 or f.get("rope_interleave", bool, True),
        has_attention_bias=f.get("attention_bias", bool, False),
        moe_intermediate_size=f.positive("moe_intermediate_size"),
        n_shared_experts=_count(f, "n_shared_experts"),
        first_k_dense_replace=_count(f, "first_k_dense_replace"),
        moe_layer_freq=f.positive("moe_layer_freq", 1),
        routed_scaling_factor=f.get("routed_scaling_factor", float, 1.0),
        norm_topk_prob=f.get("norm_topk_prob", bool, version == 3),
        **_router(f, architecture, version),
    )


def _count(f: Any, field: str) -> int:
    value = f.get(field, int, 0)
    if value < 0:
        raise f.error(field, f"is {value}, expected >= 0")
    return value


def _router(f: Any, architecture: str, version: int) -> dict[str, Any]:
    """The expert counts and the top-k method with its groups, checked against each other."""
    methods = V3_TOPK_METHODS if version == 3 else V2_TOPK_METHODS
    topk_method = f.get("topk_method", str, methods[0])
    if topk_method not in methods:
        raise f.error("topk_method", f"is {topk_method!r}; {architecture} supports {list(methods)}")
    scoring = f.get("scoring_func", str, "sigmoid" if version == 3 else "softmax")
    if scoring != ("sigmoid" if version == 3 else "softmax"):
        raise f.error("scoring_func", f"is {scoring!r}; {architecture} routes by "
                      f"{'sigmoid' if version == 3 else 'softmax'} scores")
    num_experts = f.positive("n_routed_experts")
    top_k = f.positive("num_experts_per_tok")
    if top_k > num_experts:
        raise f.error("num_experts_per_tok", f"is {top_k}, more than n_routed_experts={num_experts}")
    is_grouped = topk_method != "greedy"
    n_group = f.positive("n_group", 1) if is_grouped else 1
    topk_group = f.positive("topk_group", 1) if is_grouped else 1
    if num_experts % n_group or topk_group > n_group:
        raise f.error("n_group", f"is {n_group} with topk_group={topk_group} and n_routed_experts={num_experts}; "
                      "n_group must divide the experts and be >= topk_group")
    if version == 3 and num_experts // n_group < 2:
        raise f.error("n_group", f"is {n_group}: {num_experts} experts leave fewer than the 2 per group that "
                      "noaux_tc ranks groups by")
    if top_k > topk_group * (num_experts // n_group):
        raise f.error("num_experts_per_tok", f"is {top_k}, more than the {topk_group} chosen groups of "
                      f"{num_experts // n_group} experts hold")
    return {"topk_method": topk_method, "n_routed_experts": num_experts, "num_experts_per_tok": top_k,
            "n_group": n_group, "topk_group": topk_group}

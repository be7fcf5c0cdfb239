"""DeepSeek-V2/V3 shapes of the generated checkpoints (``tiny.py``'s ``TinySpec.deepseek``).

``config_fields`` is what a DeepSeek ``config.json`` adds to (or changes in) the Llama fields
``tiny.py`` writes, with transformers 5's names; ``layer_tensors`` the Hugging Face tensors of one
layer, experts one by one (``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``, as DeepSeek's
checkpoints and transformers' ``save_pretrained`` write them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeepseekShape:
    """MLA and MoE shapes; ``version`` 2 or 3 picks the architecture and its router."""

    version: int = 3
    q_lora_rank: int | None = 48
    kv_lora_rank: int = 32
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    topk_method: str = "noaux_tc"
    n_group: int = 4
    topk_group: int = 2
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True

    @property
    def architecture(self) -> str:
        return f"DeepseekV{self.version}ForCausalLM"


def config_fields(shape: DeepseekShape, num_heads: int) -> dict:
    out = {
        "architectures": [shape.architecture],
        "model_type": f"deepseek_v{shape.version}",
        "head_dim": shape.qk_rope_head_dim,
        "num_key_value_heads": num_heads,
        "q_lora_rank": shape.q_lora_rank,
        "kv_lora_rank": shape.kv_lora_rank,
        "qk_rope_head_dim": shape.qk_rope_head_dim,
        "qk_nope_head_dim": shape.qk_nope_head_dim,
        "v_head_dim": shape.v_head_dim,
        "n_routed_experts": shape.n_routed_experts,
        "num_experts_per_tok": shape.num_experts_per_tok,
        "moe_intermediate_size": shape.moe_intermediate_size,
        "n_shared_experts": shape.n_shared_experts,
        "first_k_dense_replace": shape.first_k_dense_replace,
        "moe_layer_freq": 1,
        "topk_method": shape.topk_method,
        "n_group": shape.n_group,
        "topk_group": shape.topk_group,
        "routed_scaling_factor": shape.routed_scaling_factor,
        "norm_topk_prob": shape.norm_topk_prob,
    }
    if shape.version == 3:
        out.update({"rope_interleave": True, "scoring_func": "sigmoid"})
    return out


def layer_tensors(shape: DeepseekShape, layer: int, hidden: int, inter: int,
                  num_heads: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of layer ``layer``'s tensors, in generation order."""
    s, p = shape, f"model.layers.{layer}."
    qk = s.qk_nope_head_dim + s.qk_rope_head_dim
    a = p + "self_attn."
    out = [(p + "input_layernorm.weight", (hidden,))]
    if s.q_lora_rank is None:
        out.append((a + "q_proj.weight", (num_heads * qk, hidden)))
    else:
        out += [(a + "q_a_proj.weight", (s.q_lora_rank, hidden)), (a + "q_a_layernorm.weight", (s.q_lora_rank,)),
                (a + "q_b_proj.weight", (num_heads * qk, s.q_lora_rank))]
    out += [
        (a + "kv_a_proj_with_mqa.weight", (s.kv_lora_rank + s.qk_rope_head_dim, hidden)),
        (a + "kv_a_layernorm.weight", (s.kv_lora_rank,)),
        (a + "kv_b_proj.weight", (num_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank)),
        (a + "o_proj.weight", (hidden, num_heads * s.v_head_dim)),
        (p + "post_attention_layernorm.weight", (hidden,)),
    ]
    if layer < s.first_k_dense_replace:
        return out + _mlp(p + "mlp.", hidden, inter)
    out.append((p + "mlp.gate.weight", (s.n_routed_experts, hidden)))
    if s.version == 3:
        out.append((p + "mlp.gate.e_score_correction_bias", (s.n_routed_experts,)))
    for e in range(s.n_routed_experts):
        out += _mlp(f"{p}mlp.experts.{e}.", hidden, s.moe_intermediate_size)
    if s.n_shared_experts:
        out += _mlp(p + "mlp.shared_experts.", hidden, s.n_shared_experts * s.moe_intermediate_size)
    return out


def _mlp(prefix: str, hidden: int, inter: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(prefix + "gate_proj.weight", (inter, hidden)), (prefix + "up_proj.weight", (inter, hidden)),
            (prefix + "down_proj.weight", (hidden, inter))]


def presets(spec) -> dict:
    """The DeepSeek presets of ``tiny.presets``, built with its ``TinySpec`` class ``spec``."""
    return {
        "deepseek-v3-tiny": spec(
            hidden_size=64, num_layers=3, num_heads=4, intermediate_size=96, draft_layers=1, deepseek=DeepseekShape(),
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0,
                          "beta_slow": 1.0, "original_max_position_embeddings": 1024},
        ),
        "deepseek-v2-tiny": spec(
            hidden_size=64, num_layers=3, num_heads=4, intermediate_size=96, draft_layers=1,
            deepseek=DeepseekShape(version=2, q_lora_rank=None, topk_method="group_limited_greedy",
                                   routed_scaling_factor=2.0, norm_topk_prob=False, n_shared_experts=2),
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                          "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 1024},
        ),
        "deepseek-v2-lite": spec(
            hidden_size=2048, num_layers=4, num_heads=16, intermediate_size=10944, draft_layers=1,
            max_position_embeddings=163840, dtype="bfloat16",
            deepseek=DeepseekShape(version=2, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64,
                                   qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6,
                                   moe_intermediate_size=1408, n_shared_experts=2, topk_method="greedy", n_group=1,
                                   topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False),
            rope_scaling={"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                          "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096},
        ),
    }

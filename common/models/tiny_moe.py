"""The Qwen3-MoE parts of the tiny checkpoints (``tiny.py``'s "tiny-moe" and "qwen3-30b-a3b"
presets): the config fields a ``Qwen3MoeConfig`` adds, and each sparse layer's router and experts,
named as the Hub's Qwen3-MoE checkpoints name them. A spec without experts adds nothing."""

from __future__ import annotations


def config_fields(spec, num_layers: int) -> dict:
    """What a Qwen3-MoE ``config.json`` has beyond a Llama one (``{}`` for a dense spec)."""
    if not spec.num_experts:
        return {}
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in spec.mlp_only_layers if i < num_layers],
        "moe_intermediate_size": spec.moe_intermediate_size,
        "norm_topk_prob": True,
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "use_sliding_window": False,
    }


def expert_specs(spec, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
    """A sparse layer's router and experts: (Hugging Face name, shape), in the order they are written."""
    h, inter = spec.hidden_size, spec.moe_intermediate_size
    out = [(prefix + "mlp.gate.weight", (spec.num_experts, h))]
    for e in range(spec.num_experts):
        p = f"{prefix}mlp.experts.{e}."
        out += [(p + "gate_proj.weight", (inter, h)), (p + "up_proj.weight", (inter, h)),
                (p + "down_proj.weight", (h, inter))]
    return out

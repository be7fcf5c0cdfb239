"""bench/engine.py's side-by-side switches: ``--{flag}-ab`` reruns the decode cases with one of the
tree's choices set the other way (``AB_SWITCHES``, ``other_side``), and ``--gemv-configs-ab`` with the
GEMV tiles of an earlier sweep (``hot_sweep_configs``); ``switched`` sets a switch for a block and
captures the CUDA graphs again after it."""

from __future__ import annotations

from contextlib import contextmanager


def recapture(runner) -> None:
    """Every CUDA graph of the target captured again (after a switch that changes its kernels)."""
    for graphs in runner.target.graphs:
        graphs.capture()


@contextmanager
def switched(runner, owner, name: str, value, again: bool = True):
    """``owner.name`` is ``value`` inside the block; the default is set back after it and, with ``again``,
    the graphs are captured again (``rerun`` captures them with the switch on). A caller that undoes
    several switches passes ``again=False`` and recaptures once."""
    default = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, default)
        if again:
            recapture(runner)


# --{flag}-ab: (the lines' key, its value on the default's lines, on the other side's, what the other side runs)
AB_SWITCHES = {
    "mla": ("mla", "kernels", "0fd301d", "MLA models' absorbed projections as torch einsums and the MLA decode "
            "kernel's tiles of tree 0fd301d (32 keys a step, every split used, always merged)"),
    "shared": ("shared_experts", "folded", "dense", "DeepSeek's shared experts as one dense SwiGLU of their own "
               "(deepseek.MoeBlock.fold_shared off; the default: in the routed experts' launches)"),
    "rope": ("rope_programs", "split", "one", "rope_store in one program a token (triton_fused.ROPE_Q_HEADS 0; "
             "the default: 8 q heads a program, k and v in one more)"),
    "merge": ("merge", "tile", "loop", "the decode attention's splits merged one after another "
              "(triton_attention.MERGE_TILE off; the default: all splits as one tile)"),
    "mla_rows": ("mla_rows", "apart", "fused", "MLA's latent rows in absorb_q's launch, one grid for both "
                 "(TritonBackend.fuse_mla_rows on; the default: the rows in a launch of their own first)"),
    "split_sum": ("split_sums", "launch", "in_kernel", "split-K GEMV parts added by each output tile's last "
                  "program (triton_gemv.SPLIT_SUM_IN_KERNEL on; the default: sum_parts in a launch of their own)"),
    "late_sum": ("one_row_sum", "tiles", "each_step", "every one-row GEMV (bf16, FP8 per-row scales, MoE slots) "
                 "summing across the program's threads every K step (triton_gemv.ONE_ROW_LATE_SUM False; the "
                 "default: the shapes whose tiles say late_sum add their products per column over the K loop and "
                 "sum the columns once after it)"),
    "late_all": ("one_row_sum", "tiles", "late", "every one-row GEMV summing its columns once after the K loop "
                 "(triton_gemv.ONE_ROW_LATE_SUM True; the default: only the shapes whose tiles say late_sum)"),
    "norm_sum": ("o_down_sums", "norm", "launch", "o_proj's and down's split-K GEMV parts added by a launch of "
                 "their own (TritonBackend.sum_in_norm off; the default: by the next add_norm's launch)"),
    "moe_norm_sum": ("moe_slot_sums", "launch", "norm", "a MoE block's weighted slots added by the next add_norm's "
                     "launch (TritonBackend.moe_sum_in_norm on; the default: slot_sum in a launch of its own)"),
    "qkv_rope": ("qkv_rope", "fused", "apart", "an FP8 W8A8 q/k/v projection, then rope_store (TritonBackend."
                 "fuse_qkv_rope off; the default: the projection with its rope and K/V store, triton_qkv)"),
    "slot_last": ("moe_slot_sum", "launch", "in_kernel", "the MoE down projection's slots added by the last of each "
                  "token's programs (triton_gemv.SLOT_SUM_IN_KERNEL on; the default: slot_sum in a launch of its "
                  "own)"),
    "attn_quant": ("o_proj_quant", "attention", "launch", "o_proj's per-token quant in a launch of its own "
                   "(triton_attention.QUANT_OUT off; the default: an unsplit decode attention quantizes its rows)"),
    "router": ("router", "two", "one_launch", "a one-row MoE router's logits and picks in one launch "
               "(triton_moe.router_topk, TritonBackend.fuse_router on; the default: the GEMV, then softmax_topk)"),
    "gate_up": ("gate_up_silu", "fused", "apart", "an FP8 W8A8 gate-up, then silu_mul with its quant (TritonBackend."
                "fuse_gate_up off; the default: the gate-up with its silu, then the quant from its parts, triton_mlp)"),
    "picks": ("picks", "kernel", "torch", "the greedy picks by torch's argmax, log_softmax, gather and the "
              "pairs' casts and stack (sampler.PICK_KERNEL off; the default: one launch, triton_sample)"),
    "cos_sin": ("cos_sin", "kernel", "torch", "the step's rope cos/sin by torch ops, seven or eight launches "
                "(TritonBackend.rope_kernel off; the default: one launch)"),
}


def other_side(flag: str, model) -> list[tuple[object, str, object]]:
    """(owner, attribute, value) settings that make ``AB_SWITCHES[flag]``'s other side; [] where the
    model has nothing to switch (no Triton backend, not MLA, no shared experts)."""
    if model.attn.name != "triton":
        return []
    from kvferry.common.kernels import triton_attention, triton_fused, triton_mla
    from kvferry.common.models.deepseek import MoeBlock

    ds = model.config.deepseek
    if flag == "mla":
        tiles = triton_attention.DecodeTiles(32)
        return [] if ds is None else [(model.attn, "absorb_kernels", False),
                                      (triton_mla, "decode_tiles", lambda splits: tiles)]
    if flag == "shared":
        return [(MoeBlock, "fold_shared", False)] if ds is not None and ds.n_shared_experts else []
    if flag == "mla_rows":
        return [] if ds is None else [(model.attn, "fuse_mla_rows", True)]
    if flag in ("split_sum", "slot_last", "late_sum", "late_all"):
        from kvferry.common.kernels import triton_gemv

        if flag == "split_sum":
            return [(triton_gemv, "SPLIT_SUM_IN_KERNEL", True)]
        if flag in ("late_sum", "late_all"):
            return [(triton_gemv, "ONE_ROW_LATE_SUM", flag == "late_all")]
        return [(triton_gemv, "SLOT_SUM_IN_KERNEL", True)] if ds is not None or model.config.moe is not None else []
    if flag == "router":
        return [(model.attn, "fuse_router", True)] if ds is not None or model.config.moe is not None else []
    if flag == "qkv_rope":
        return [(model.attn, "fuse_qkv_rope", False)]
    if flag == "norm_sum":
        return [(model.attn, "sum_in_norm", False)]
    if flag == "moe_norm_sum":
        return [(model.attn, "moe_sum_in_norm", True)] if ds is not None or model.config.moe is not None else []
    if flag == "gate_up":
        return [(model.attn, "fuse_gate_up", False)]
    if flag == "attn_quant":
        return [(triton_attention, "QUANT_OUT", False)]
    if flag == "picks":
        from kvferry.common.sampling import sampler

        return [(sampler, "PICK_KERNEL", False)]
    if flag == "cos_sin":
        return [(model.attn, "rope_kernel", False)]
    return [(triton_fused, "ROPE_Q_HEADS", 0)] if flag == "rope" else [(triton_attention, "MERGE_TILE", False)]


def hot_sweep_configs():
    """``triton_gemv``'s fp8_config / dense_config / moe_config as of tree 6c7418e, from sweeps that
    reread each weight out of L2 (bench/gemv_tune.py --hot), for --gemv-configs-ab."""
    from kvferry.common.kernels.gemv_tiles import GemvConfig as C

    def fp8_config(num_rows: int, n: int, k: int, block, fp8_x: bool = False):
        if fp8_x:
            return C(64, 256, 4, 3, split_k=4 if k > 8192 else 2 if n <= 4096 else 1)
        if num_rows == 1:
            return C(8, 1024, 4) if k >= 8192 or n <= 4096 else C(32 if n > 8192 else 16, 512, 8)
        wide = n > 8192
        split = 1 if wide else 8 if k > 8192 and num_rows > 16 else 4
        block_k = 256 if 16 < num_rows <= 32 and block is None else 128
        return C(32 if num_rows <= 16 else 128 if wide else 64, block_k, 4, 3, split)

    def dense_config(n: int, k: int):
        if n > 8192:
            return C(16, 512, 4)
        if n > 4096:
            return C(8, 256, 4) if k <= 2048 else C(4, 1024, 8)
        return C(8, 1024, 8)

    return {"fp8_config": fp8_config, "dense_config": dense_config,
            "moe_config": lambda n, k, silu=False: C(16 if n <= 4096 else 32, 256, 4)}

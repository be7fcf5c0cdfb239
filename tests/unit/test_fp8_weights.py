"""FP8 checkpoints (``make_tiny_model(..., quantize=)``) load into ``Fp8Weight`` linears whose
dequantized weights equal the unquantized checkpoint's within e4m3 rounding, their scales slice
with the weights under TP 2, and what is not served is refused by name.

Bound (``tests/unit/test_fp8_gemm.py`` derives it): |dequant(w) - w| <= max(2**-4 * |w|, 2**-10 * s)
for the element's scale s; the writer and the loader share the fp32 source, so nothing else adds.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kvferry.common.errors import ModelLoadError
from kvferry.common.layers.fp8 import Fp8Weight
from kvferry.common.models.config import ModelConfig
from kvferry.common.models.loader import load_model
from kvferry.common.models.tiny import make_tiny_model, presets
from tests.unit.test_fp8_gemm import within_e4m3

torch.set_num_threads(1)
KINDS = ("fp8-channel", "fp8-block")
LINEARS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
# the tiny preset's dims in two layers (k/v 64 rows: ragged 128-blocks) ...
SMALL = dataclasses.replace(presets["tiny"], num_layers=2, draft_layers=1)
# ... and dims whose TP 2 halves of o_proj/down_proj columns are whole 128-blocks
ALIGNED = dataclasses.replace(SMALL, hidden_size=256, head_dim=64, intermediate_size=512)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[tuple[str, str | None], Path]:
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for name, spec in (("small", SMALL), ("aligned", ALIGNED)):
        for kind in (None, *KINDS):
            out[name, kind] = make_tiny_model(root / f"{name}-{kind}", seed=3, preset=spec, quantize=kind)[0]
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_dequantized_weights_equal_the_source_within_e4m3(dirs, kind):
    plain, quantized = load_model(dirs["small", None]), load_model(dirs["small", kind])
    assert quantized.config.quantization is not None
    assert quantized.config.fingerprint != plain.config.fingerprint  # the numerics differ: peers must match
    for layer, source in zip(quantized.layers, plain.layers):
        for name in LINEARS:
            w = getattr(layer, name)
            assert isinstance(w, Fp8Weight) and w.weight.dtype == torch.float8_e4m3fn
            want = getattr(source, name)
            assert within_e4m3(w.dequantize(), want, w.expanded_scale().expand_as(want)), name
        assert torch.equal(layer.input_norm, source.input_norm)
    assert torch.equal(quantized.lm_head, plain.lm_head) and torch.equal(quantized.embed, plain.embed)


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_shards_slice_scales_with_weights(dirs, kind):
    model_dir = dirs["aligned", kind]
    whole = load_model(model_dir).layers[1]
    parts = [load_model(model_dir, tp_size=2, tp_rank=r).layers[1] for r in range(2)]
    c = whole.config
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
    for field in ("weight", "scale"):
        full = {name: getattr(getattr(whole, name), field) for name in LINEARS}
        qkv = [getattr(p.qkv_weight, field).split([p.shard.q_size, p.shard.kv_size, p.shard.kv_size]) for p in parts]
        assert torch.equal(torch.cat([x[0] for x in qkv]), full["qkv_weight"][:q])
        assert torch.equal(torch.cat([x[1] for x in qkv]), full["qkv_weight"][q:q + kv])  # 64 rows each: mid-block
        assert torch.equal(torch.cat([x[2] for x in qkv]), full["qkv_weight"][q + kv:])
        gate_up = [getattr(p.gate_up_weight, field).chunk(2) for p in parts]
        assert torch.equal(torch.cat([g for g, _ in gate_up]), full["gate_up_weight"][:inter])
        assert torch.equal(torch.cat([u for _, u in gate_up]), full["gate_up_weight"][inter:])
        for name in ("o_weight", "down_weight"):  # row-parallel: columns split; per-row scales replicated
            got = [getattr(getattr(p, name), field) for p in parts]
            if field == "scale" and whole.o_weight.block is None:
                assert all(torch.equal(g, full[name]) for g in got)
            else:
                assert torch.equal(torch.cat(got, dim=1), full[name])


def test_block_tp_slice_off_the_128_grid_is_refused(dirs):
    # tiny dims at TP 2: each rank's o_proj columns are 64 of 128
    with pytest.raises(ModelLoadError, match=r"o_proj\.weight_scale_inv: this rank's columns \[0, 64\) of 128"):
        load_model(dirs["small", "fp8-block"], tp_size=2, tp_rank=0)


def test_channel_tp_slice_off_the_128_grid_loads(dirs):
    part = load_model(dirs["small", "fp8-channel"], tp_size=2, tp_rank=1)
    assert part.layers[0].o_weight.weight.shape == (128, 64)


def _with_quantization(src: Path, dst: Path, quantization: dict) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return dst


def test_unquantized_tensors_under_an_fp8_config_are_refused(dirs, tmp_path):
    config = json.loads((dirs["small", "fp8-block"] / "config.json").read_text())["quantization_config"]
    bad = _with_quantization(dirs["small", None], tmp_path / "bad", config)
    with pytest.raises(ModelLoadError, match=r"has dtype torch\.float32 where .* implies torch\.float8_e4m3fn"):
        load_model(bad)


def test_fp8_tensors_of_an_ignored_module_are_refused(dirs, tmp_path):
    config = json.loads((dirs["small", "fp8-channel"] / "config.json").read_text())["quantization_config"]
    ignore_all = {**config, "ignore": ["lm_head", "re:.*_proj"]}
    bad = _with_quantization(dirs["small", "fp8-channel"], tmp_path / "bad", ignore_all)
    with pytest.raises(ModelLoadError, match=r"has dtype torch\.float8_e4m3fn where .* implies torch\.float32"):
        load_model(bad)


def _config(quantization: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 2,
            "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 32, "quantization_config": quantization}


CT = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"], "config_groups": {
    "group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _group(**changes) -> dict:
    group = json.loads(json.dumps(CT["config_groups"]["group_0"]))
    for path, value in changes.items():
        table, key = path.split("__")
        group[table][key] = value
    return {**CT, "config_groups": {"group_0": group}}


@pytest.mark.parametrize("quantization,message", [
    ({"quant_method": "awq", "bits": 4}, r"quant_method' is 'awq'"),
    ({**CT, "format": "pack-quantized"}, r"format' is 'pack-quantized'"),
    (_group(input_activations__dynamic=False), r"input_activations\.dynamic' is False: static activation scales"),
    (_group(input_activations__strategy="tensor"), r"input_activations\.strategy' is 'tensor'"),
    (_group(weights__num_bits=4), r"weights\.num_bits' is 4"),
    (_group(weights__strategy="group"), r"weights\.strategy' is 'group'"),
    ({**CT, "ignore": []}, r"a quantized lm_head is not supported"),
    ({**BLOCK, "activation_scheme": "static"}, r"activation_scheme' is 'static'"),
    ({**BLOCK, "weight_block_size": [64, 64]}, r"weight_block_size' is \[64, 64\]"),
    ({**BLOCK, "weight_block_size": None}, r"weight_block_size' is None"),
])
def test_formats_not_served_are_refused_by_name(quantization, message):
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict(_config(quantization))


def test_both_formats_parse():
    channel = ModelConfig.from_dict(_config(CT)).quantization
    assert (channel.quant_method, channel.strategy.value, channel.scale_suffix) == (
        "compressed-tensors", "channel", "weight_scale")
    block = ModelConfig.from_dict(_config({**BLOCK, "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]}))
    scheme = block.quantization
    assert (scheme.strategy.value, scheme.scale_suffix) == ("block", "weight_scale_inv")
    assert not scheme.quantizes("model.layers.0.mlp.down_proj") and scheme.quantizes("model.layers.0.mlp.up_proj")


def test_fused_parts_must_agree_on_quantization():
    config = ModelConfig.from_dict(_config({**CT, "ignore": ["lm_head", "model.layers.0.self_attn.k_proj"]}))
    from kvferry.common.models.llama import LlamaForCausalLM

    with pytest.raises(ModelLoadError, match=r"ignores some of the fused modules .*k_proj': False"):
        LlamaForCausalLM(config, torch.float32, "cpu")


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_bf16_checkpoint_loads_the_same_fp8_weights(dirs, tmp_path, kind):
    """Shards sized by the FP8 tensors' real bytes (1 per weight, 4 per scale) from a bf16 source,
    as the 8B preset writes them."""
    spec = dataclasses.replace(SMALL, dtype="bfloat16", max_shard_bytes=1 << 16)
    target, _ = make_tiny_model(tmp_path, seed=3, preset=spec, quantize=kind)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 4
    plain = load_model(make_tiny_model(tmp_path / "plain", seed=3, preset=spec)[0])
    model = load_model(target)
    assert model.dtype == torch.bfloat16 and model.layers[1].down_weight.weight.dtype == torch.float8_e4m3fn
    for layer, source in zip(model.layers, plain.layers):
        for name in LINEARS:
            w, want = getattr(layer, name), getattr(source, name).float()
            assert within_e4m3(w.dequantize(), want, w.expanded_scale().expand_as(want)), name


def test_make_tiny_model_command_writes_an_fp8_checkpoint(tmp_path):
    from kvferry.common.cli import main

    assert main(["make-tiny-model", str(tmp_path), "--quantize", "fp8-block"]) == 0
    scheme = ModelConfig.from_dir(tmp_path / "target").quantization
    assert (scheme.quant_method, scheme.strategy.value) == ("fp8", "block")
    assert isinstance(load_model(tmp_path / "draft").layers[0].qkv_weight, Fp8Weight)

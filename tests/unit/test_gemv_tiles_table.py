"""``KVFERRY_GEMV_TILES``: a sweep's tile table stands in for the rules for the exact shapes it
measured; a file that is not a table is refused with its name."""

from __future__ import annotations

import json

import pytest

from kvferry.common.kernels import gemv_tiles
from kvferry.common.kernels.gemv_tiles import GemvConfig


@pytest.fixture
def table(tmp_path, monkeypatch):
    def use(entries) -> str:
        path = tmp_path / "tiles.json"
        path.write_text(entries if isinstance(entries, str) else json.dumps({"entries": entries}))
        monkeypatch.setenv(gemv_tiles.TABLE_ENV, str(path))
        monkeypatch.setattr(gemv_tiles, "_table", None)  # read again on first use
        return str(path)

    yield use
    monkeypatch.setattr(gemv_tiles, "_table", None)


def test_table_entries_win_for_their_exact_shapes_only(table, monkeypatch):
    monkeypatch.delenv(gemv_tiles.TABLE_ENV, raising=False)
    monkeypatch.setattr(gemv_tiles, "_table", None)
    rules = (gemv_tiles.dense_config(3648, 2048), gemv_tiles.moe_config(2816, 2048),
             gemv_tiles.fp8_config(64, 6144, 4096, None, fp8_x=True), gemv_tiles.fp8_config(1, 6144, 4096, None),
             gemv_tiles.dense_config(3648, 4096), gemv_tiles.fp8_config(64, 6144, 4096, None))
    table([{"kind": "bf16", "rows": 1, "n": 3648, "k": 2048, "config": [16, 512, 8, 4, 1]},
           {"kind": "moe", "rows": 1, "n": 2816, "k": 2048, "config": [32, 256, 4, 4, 1]},
           {"kind": "fp8_x", "rows": 64, "n": 6144, "k": 4096, "config": [64, 256, 4, 3, 2]},
           {"kind": "fp8", "rows": 1, "n": 6144, "k": 4096, "config": [8, 1024, 4, 4, 1]}])
    assert gemv_tiles.dense_config(3648, 2048) == GemvConfig(16, 512, 8, 4, 1)
    assert gemv_tiles.moe_config(2816, 2048) == GemvConfig(32, 256, 4, 4, 1)
    assert gemv_tiles.fp8_config(64, 6144, 4096, None, fp8_x=True) == GemvConfig(64, 256, 4, 3, 2)
    assert gemv_tiles.fp8_config(1, 6144, 4096, None) == GemvConfig(8, 1024, 4, 4, 1)
    # another shape, row count or scale kind: the rules
    assert gemv_tiles.dense_config(3648, 4096) == rules[4]
    assert gemv_tiles.fp8_config(40, 6144, 4096, None, fp8_x=True) == rules[2]
    assert gemv_tiles.fp8_config(64, 6144, 4096, None) == rules[5]  # weight-only: not fp8_x's entry
    assert gemv_tiles.fp8_config(1, 6144, 4096, 128) != GemvConfig(8, 1024, 4, 4, 1)  # block scales: no entries


def test_a_table_entry_may_say_whether_it_sums_late(table):
    """A sixth value is the entry's ``late_sum``; five values (tables written before it) sum every K step."""
    table([{"kind": "moe", "rows": 1, "n": 2816, "k": 2048, "config": [32, 256, 4, 4, 1]},
           {"kind": "bf16", "rows": 1, "n": 3648, "k": 2048, "config": [8, 1024, 8, 3, 1, 1]}])
    assert gemv_tiles.moe_config(2816, 2048) == GemvConfig(32, 256, 4, 4, 1, late_sum=0)
    assert gemv_tiles.dense_config(3648, 2048).late_sum == 1


def test_which_one_row_shapes_sum_late(monkeypatch):
    """The rules' ``late_sum`` (each kernel alone on an H100, bench/RESULTS.md): the narrow bf16 GEMVs (routers,
    o_proj), a MoE slot's gate-up but not its down (silu made as it reads), an FP8 row with per-row scales but
    for the wide gate-up; never block scales or several rows. ``ONE_ROW_LATE_SUM`` overrides every one."""
    from kvferry.common.kernels import triton_gemv

    late = {"router": gemv_tiles.dense_config(64, 2048), "o": gemv_tiles.dense_config(2048, 4096),
            "moe gate-up": gemv_tiles.moe_config(2816, 2048), "fp8 down": gemv_tiles.fp8_config(1, 4096, 14336, None),
            "fp8 qkv": gemv_tiles.fp8_config(1, 6144, 4096, None), "fp8 o": gemv_tiles.fp8_config(1, 4096, 4096, None)}
    each_step = {"qkv": gemv_tiles.dense_config(3648, 2048), "wide": gemv_tiles.dense_config(21888, 2048),
                 "moe down": gemv_tiles.moe_config(2048, 1408, silu=True),
                 "fp8 gate-up": gemv_tiles.fp8_config(1, 28672, 4096, None),
                 "fp8 block": gemv_tiles.fp8_config(1, 4096, 14336, 128),
                 "fp8 rows": gemv_tiles.fp8_config(4, 4096, 14336, None)}
    assert {name: cfg.late_sum for name, cfg in late.items()} == dict.fromkeys(late, 1)
    assert {name: cfg.late_sum for name, cfg in each_step.items()} == dict.fromkeys(each_step, 0)
    assert triton_gemv.ONE_ROW_LATE_SUM is None
    assert triton_gemv.late_sum(late["o"]) and not triton_gemv.late_sum(each_step["qkv"])
    for forced in (True, False):
        monkeypatch.setattr(triton_gemv, "ONE_ROW_LATE_SUM", forced)
        assert {triton_gemv.late_sum(c) for c in (*late.values(), *each_step.values())} == {forced}


@pytest.mark.parametrize("text, names", [
    ("not json", "JSONDecodeError"),
    (json.dumps({"rows": []}), "KeyError"),
    (json.dumps({"entries": [{"kind": "int4", "rows": 1, "n": 8, "k": 8, "config": [1, 1, 1, 1, 1]}]}), "int4"),
    (json.dumps({"entries": [{"kind": "bf16", "rows": 1, "n": 8, "k": 8, "config": [8, 256, 4, 3]}]}), "5 positive"),
    (json.dumps({"entries": [{"kind": "bf16", "rows": 1, "n": 8, "k": 8, "config": [8, 0, 4, 3, 1]}]}), "5 positive"),
    (json.dumps({"entries": [{"kind": "bf16", "rows": 1, "n": 8, "k": 8, "config": [8, 256, 4, 3, 1, 2]}]}),
     "late_sum of 0 or 1"),
])
def test_a_file_that_is_not_a_table_is_refused_naming_it(table, text, names):
    path = table(text)
    with pytest.raises(ValueError) as e:
        gemv_tiles.dense_config(8, 8)
    assert path in str(e.value) and names in str(e.value)

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


@pytest.mark.parametrize("text, names", [
    ("not json", "JSONDecodeError"),
    (json.dumps({"rows": []}), "KeyError"),
    (json.dumps({"entries": [{"kind": "int4", "rows": 1, "n": 8, "k": 8, "config": [1, 1, 1, 1, 1]}]}), "int4"),
    (json.dumps({"entries": [{"kind": "bf16", "rows": 1, "n": 8, "k": 8, "config": [8, 256, 4, 3]}]}), "5 positive"),
    (json.dumps({"entries": [{"kind": "bf16", "rows": 1, "n": 8, "k": 8, "config": [8, 0, 4, 3, 1]}]}), "5 positive"),
])
def test_a_file_that_is_not_a_table_is_refused_naming_it(table, text, names):
    path = table(text)
    with pytest.raises(ValueError) as e:
        gemv_tiles.dense_config(8, 8)
    assert path in str(e.value) and names in str(e.value)

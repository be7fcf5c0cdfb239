"""Both KV pools (``KvCache``, ``LatentCache``) keep the ``KvPool`` contract the daemons rely on
(``common/cache/pool.py``): regions and tensors agree, pages tile the registered buffer, and a page
copy touches every region's page and nothing else; in both layouts."""

from __future__ import annotations

import pytest
import torch

from kvferry.common.cache.kv_cache import KV_LAYOUTS, KvCache
from kvferry.common.cache.mla_cache import LatentCache
from kvferry.common.cache.pool import KvPool
from kvferry.common.models.tiny import make_tiny_model
from kvferry.common.models.config import ModelConfig
from kvferry.common.wire.messages import LATENT_KIND

NUM_PAGES, PAGE_SIZE = 5, 4


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, ModelConfig]:
    out = {}
    for name, preset in (("dense", "tiny-moe"), ("mla", "deepseek-v2-tiny")):
        target, _ = make_tiny_model(tmp_path_factory.mktemp(preset), seed=0, preset=preset)
        out[name] = ModelConfig.from_dir(target)
    return out


def _pool(configs, form: str, layout: str) -> KvPool:
    cls = KvCache if form == "dense" else LatentCache
    return cls(configs[form], NUM_PAGES, PAGE_SIZE, torch.float32, "cpu", model_name="draft", layout=layout)


@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("form", ["dense", "mla"])
def test_regions_match_tensors_and_tile_the_buffer(configs, form, layout):
    kv = _pool(configs, form, layout)
    assert isinstance(kv, KvPool)
    regions, tensors = kv.regions(), kv.tensors()
    assert len(regions) == len(tensors) == (1 if form == "mla" else 2) * configs[form].num_hidden_layers
    assert {r.kind == LATENT_KIND for r in regions} == {form == "mla"}
    assert {(r.model, r.item_len, r.num_pages, r.head_start, r.num_heads) for r in regions} == {
        ("draft", kv.page_bytes, NUM_PAGES, kv.head_start, kv.num_kv_heads)}
    start, end = kv.buffer.data_ptr(), kv.buffer.data_ptr() + kv.num_bytes
    assert kv.num_bytes == kv.buffer.numel() * kv.buffer.element_size()
    covered = set()
    for r, t in zip(regions, tensors):
        assert t.data_ptr() == r.addr and t.shape[0] == NUM_PAGES
        for page in range(NUM_PAGES):
            at = r.addr + page * kv.page_stride_bytes
            assert t[page].data_ptr() == at and start <= at and at + kv.page_bytes <= end
            covered.add(at)
    assert len(covered) * kv.page_bytes == kv.num_bytes  # every byte in exactly one page of one region
    assert (kv.kv_dtype, kv.mem, kv.model_name) == ("float32", "DRAM", "draft")


@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("form", ["dense", "mla"])
def test_copy_page_copies_every_region_and_nothing_else(configs, form, layout):
    kv = _pool(configs, form, layout)
    for i, t in enumerate(kv.tensors()):
        for page in range(NUM_PAGES):
            t[page].fill_(100 * i + page)
    kv.copy_page(1, 3)
    for i, t in enumerate(kv.tensors()):
        want = [100 * i + p for p in (0, 1, 2, 1, 4)]
        assert [float(t[page].flatten()[0]) for page in range(NUM_PAGES)] == want
        assert torch.equal(t[3], t[1])

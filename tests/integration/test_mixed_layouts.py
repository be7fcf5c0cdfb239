import pytest
from tests.cluster import cluster, colocated, tiny_models, free_pages  # noqa: F401
from tests.integration.test_disagg_equals_colocated import expected, run_all


@pytest.mark.parametrize("prefill_layout,decode_layout", [("page-major", "layer-major"), ("layer-major", "page-major")])
@pytest.mark.parametrize("draft", ["none", "decode", "both"])
def test_mixed_layouts(cluster, colocated, prefill_layout, decode_layout, draft):
    prefill = cluster.prefill(draft=draft == "both", extra=["--kv-layout", prefill_layout])
    decode = cluster.decode(draft=draft != "none", extra=["--kv-layout", decode_layout])
    before = free_pages(prefill), free_pages(decode)
    assert run_all(prefill, decode, "concurrent") == expected(colocated, draft=draft == "both")
    assert (free_pages(prefill), free_pages(decode)) == before

"""On CUDA, a prompt prefilled over prefix-cached pages (the Triton extend kernel reading the hit's
pages) gives what a full prefill of it gives (issue 26's "extend over cached pages equals a full
prefill").

The comparison is ``tests/unit/test_prefix_extend.py``'s ``compare_extend`` (its docstring says
what is compared: the hit, the first token, the last prompt row's logits, every logits row and
prompt logprob of the uncached suffix, greedy decode steps, the draft's last prompt row), here
with the Triton backend and CUDA graphs (decode, batch 1), in float32 and bfloat16, page sizes 16
and 64, with and without the draft, and its four cases: the hit ending on the page boundary where
P2 diverges, P2 diverging mid-page (the hit stops at the page below, the rest of that page
recomputed, a partial last page), P2 repeating P1's prompt, P2 continuing P1's conversation (the
hit holds K/V that decode steps wrote).

Greedy tokens equal exactly in both dtypes. Logits and logprobs, max abs difference:

- float32: ``test_triton_attention.TOL[float32]`` (2e-5), the kernels' own tolerance. Not bitwise:
  the extend kernel splits a query's key range into blocks from the hit on where a full prefill
  splits it from 0, and GEMMs of other row counts round differently. Measured on an H200: at most
  9.1e-6 (page size 64, the suffix's rows), about 5e-6 for most values.
- bfloat16: ``test_triton_attention.TOL[bfloat16]`` (2e-2) times the logits' scale (the
  reference's max abs logit, 16 to 18 here): bf16 logits in [16, 32) are 0.125 apart, so an
  absolute 2e-2 cannot hold once one rounding differs. Measured on an H200: 0 (bitwise) with
  16-token pages, at most 0.125 (one ulp, 7e-3 of the scale) with 64-token pages.

The whole file takes about 20 s on an H200 (32 cases, two runners each).
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_prefix_extend import CASES, compare_extend

pytestmark = pytest.mark.gpu
TOL = pytest.importorskip("tests.gpu.test_triton_attention").TOL
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _runner_maker(tiny_models, *, dtype: str, page_size: int, draft: bool):
    from kvferry.common.engine.factory import build_runner

    target, draft_dir = tiny_models

    def make(*, cache: bool):
        runner = build_runner(target, draft_dir if draft else None, device="cuda:0", dtype=dtype,
                              page_size=page_size, max_total_tokens=4096, attention_backend="triton",
                              cuda_graph_max_bs=1)
        assert runner.target.model.attn.name == "triton"
        if cache:
            runner.enable_prefix_cache()
        return runner
    return make


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("draft", [False, True], ids=["plain", "draft"])
def test_extend_over_cached_pages_equals_full_prefill_on_cuda(tiny_models, dtype, page_size, draft, case):
    make = _runner_maker(tiny_models, dtype=dtype, page_size=page_size, draft=draft)
    diffs = compare_extend(make, page_size, case, TOL[DTYPES[dtype]], relative=dtype == "bfloat16")
    print(dtype, page_size, draft, case, {k: f"{v:.2e}" for k, v in diffs.items()})

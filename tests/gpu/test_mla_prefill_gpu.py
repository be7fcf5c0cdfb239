"""MLA's expanded prefill (``common/layers/mla.py``: k, v expanded through kv_b_proj, SDPA) against
its absorbed form (the Triton extend kernel over the latent rows) in DeepSeek-V2-Lite's attention
shapes on CUDA: 16 heads, nope 128, rope 64, v 128, kv_lora_rank 512, bf16, random weights.

One attention layer (weights drawn once, outputs O(1)) on the triton backend's eager plans: plain
prompts (one long, a batch of ragged ones) and chunks after cached prefixes (rows written by an
absorbed prefill, prefixes ending inside pages), both latent layouts. Each bf16 form is checked
against an fp32 reference (the torch backend's absorbed form over the same bf16-rounded weights and
prefix rows) and against the other; the expanded form runs on flash (SDPA limited to its flash
kernel: v zero-padded to 192, bottom-right causal for a prefix) and at 8k tokens beats the absorbed
one. Tolerance: relative to the reference's largest output, 2e-2 (bf16 rounding of k, v, P)."""

from __future__ import annotations

import time

import pytest
import torch

from kvferry.common.cache.mla_cache import LatentCache
from kvferry.common.layers.attn_backend import TorchBackend
from kvferry.common.layers.mla import LatentRope, MlaAttention
from kvferry.common.models.config import ModelConfig
from kvferry.common.models.llama import SeqChunk

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
LAYOUTS = ["page-major", "layer-major"]
PAGE_SIZE = 16
TOL = 2e-2


def _v2_lite_config() -> ModelConfig:
    from kvferry.common.models.tiny import _config_json, presets

    spec = presets["deepseek-v2-lite"]
    return ModelConfig.from_dict(_config_json(spec, spec.num_layers, 512, 0, [1, 4]))


class Layer:
    """One V2-Lite attention layer in bf16 and its fp32 twin (the same bf16-rounded weights)."""

    def __init__(self, seed: int = 0):
        self.config = config = _v2_lite_config()
        s = config.deepseek
        assert (config.num_attention_heads, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim,
                s.kv_lora_rank) == (16, 128, 64, 128, 512)
        self.bf16 = MlaAttention(config, 1, torch.bfloat16, DEVICE)
        self.fp32 = MlaAttention(config, 1, torch.float32, DEVICE)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for (name, low), (_, high) in zip(self.bf16.named_parameters(), self.fp32.named_parameters()):
                if name.endswith("norm"):
                    value = 1 + 0.1 * torch.randn(low.shape, generator=gen)
                elif low.dim() == 1:  # a bias
                    value = 0.1 * torch.randn(low.shape, generator=gen)
                else:
                    value = torch.randn(low.shape, generator=gen) * low.shape[1] ** -0.5
                low.copy_(value)
                high.copy_(low.float())
        self.rope = {dtype: LatentRope(config, dtype, DEVICE) for dtype in (torch.bfloat16, torch.float32)}

    def hidden(self, num_tokens: int, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(num_tokens, self.config.hidden_size, generator=gen).to(torch.bfloat16).to(DEVICE)

    def run(self, dtype, form: str, backend, chunks, kv: LatentCache, h: torch.Tensor) -> torch.Tensor:
        layer = self.bf16 if dtype == torch.bfloat16 else self.fp32
        _, plan = backend.plan(chunks, kv.page_size, DEVICE)
        layer.form = form
        try:
            return layer(h.to(dtype), self.rope[dtype], self.rope[dtype].cos_sin(plan.positions), kv.latent[1],
                         plan, backend)
        finally:
            layer.form = "auto"


def _triton():
    from kvferry.common.layers.attn_backend import TritonBackend

    return TritonBackend(DEVICE, LatentCache.num_kv_heads)


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref).abs().max() / ref.abs().max())


def _compare(layout: str, prefix_lens: list[int], query_lens: list[int], seed: int = 1) -> None:
    """Chunks of ``query_lens`` new tokens after ``prefix_lens`` cached ones (written by an absorbed
    prefill first): expanded and absorbed bf16 against the fp32 reference and each other."""
    layer = Layer()
    kv_lens = [p + n for p, n in zip(prefix_lens, query_lens)]
    need = [-(-n // PAGE_SIZE) for n in kv_lens]
    order = torch.randperm(sum(need) + 7, generator=torch.Generator().manual_seed(seed)).tolist()
    pages = [order[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))]  # scattered, disjoint
    kv = LatentCache(layer.config, sum(need) + 7, PAGE_SIZE, torch.bfloat16, DEVICE, layout=layout)
    triton = _triton()
    history = [SeqChunk([0] * p, 0, pg) for p, pg in zip(prefix_lens, pages) if p]
    if history:
        layer.run(torch.bfloat16, "absorbed", triton, history, kv, layer.hidden(sum(prefix_lens), seed))
    before = kv.buffer.clone()
    chunks = [SeqChunk([0] * n, p, pg) for n, p, pg in zip(query_lens, prefix_lens, pages)]
    h = layer.hidden(sum(query_lens), seed + 1)
    ref_kv = LatentCache(layer.config, kv.num_pages, PAGE_SIZE, torch.float32, DEVICE, layout=layout)
    ref_kv.buffer.copy_(before.float())
    want = layer.run(torch.float32, "absorbed", TorchBackend(), chunks, ref_kv, h)
    got = {}
    for form in ("expanded", "absorbed"):
        kv.buffer.copy_(before)
        got[form] = layer.run(torch.bfloat16, form, triton, chunks, kv, h)
        assert got[form].dtype == torch.bfloat16 and got[form].shape == want.shape
        assert _rel_err(got[form], want) <= TOL, form
    assert _rel_err(got["expanded"], got["absorbed"].float()) <= TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_without_prefix(layout):
    _compare(layout, [0], [2048])
    _compare(layout, [0, 0, 0], [1000, 300, 17])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_extend_over_cached_prefixes(layout):
    # a chunk of a chunked prefill, a prefill beside it, prefixes ending inside pages, a 1-token chunk
    _compare(layout, [1000, 0, 4099, 33], [700, 300, 2048, 1])


def test_expanded_prefill_runs_on_flash():
    """SDPA limited to flash still runs both the plain and the prefixed prompt: flash accepts the
    192-wide q/k with v padded to 192, and the prefix's bottom-right causal mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    layer, triton = Layer(), _triton()
    kv = LatentCache(layer.config, 80, PAGE_SIZE, torch.bfloat16, DEVICE)
    pages = list(range(80))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        layer.run(torch.bfloat16, "expanded", triton, [SeqChunk([0] * 600, 0, pages)], kv, layer.hidden(600, 2))
        out = layer.run(torch.bfloat16, "expanded", triton, [SeqChunk([0] * 500, 600, pages)], kv,
                        layer.hidden(500, 3))
    assert torch.isfinite(out.float()).all()


def test_expanded_beats_absorbed_at_8k():
    """The reason the expanded form exists: an 8k-token prompt's attention layer runs faster (~3x
    fewer attention FLOPs, flash instead of the 576-wide extend kernel). Prints both times."""
    layer, triton = Layer(), _triton()
    tokens = 8192
    kv = LatentCache(layer.config, tokens // PAGE_SIZE, PAGE_SIZE, torch.bfloat16, DEVICE)
    chunks, h = [SeqChunk([0] * tokens, 0, list(range(tokens // PAGE_SIZE)))], layer.hidden(tokens, 4)
    times = {}
    for form in ("absorbed", "expanded"):
        for _ in range(2):  # warm-up (Triton compile, cuBLAS heuristics)
            layer.run(torch.bfloat16, form, triton, chunks, kv, h)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(5):
            layer.run(torch.bfloat16, form, triton, chunks, kv, h)
        torch.cuda.synchronize()
        times[form] = (time.perf_counter() - started) / 5 * 1e3
    print(f"MLA attention layer, 8k-token prompt, V2-Lite shapes: absorbed {times['absorbed']:.2f} ms, "
          f"expanded {times['expanded']:.2f} ms")
    assert times["expanded"] < times["absorbed"], times

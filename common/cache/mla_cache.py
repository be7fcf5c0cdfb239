"""Paged latent cache of multi-head latent attention (DeepSeek-V2/V3): one buffer per layer, no V.

Each token of each layer stores one row of ``width = kv_lora_rank + qk_rope_head_dim`` elements:
the compressed KV after ``kv_a_layernorm``, then the roped shared key. Every attention head reads
the same row (one "head"), so at any TP size the whole row is replicated, never split. Layouts, as
the dense pool (``kv_cache.py``)::

    page-major (default): [num_pages, num_layers, page_size, width]
        kv.latent[layer] = buffer[:, layer]   # [num_pages, page_size, width], page stride layers * page
    layer-major:          [num_layers, num_pages, page_size, width]
        kv.latent[layer] = buffer[layer]      # [num_pages, page_size, width], pages back to back

One page item (``page_size * width`` elements, tokens in order) is contiguous either way, and each
layer is one wire ``Region`` of kind ``LATENT_KIND``: ``item_len = page_size * width * elem``,
``stride`` the bytes between its pages (0 when back to back), one head.
"""

from __future__ import annotations

import logging

import torch

from kvferry.common.cache.kv_cache import KV_LAYOUTS
from kvferry.common.models.config import ModelConfig
from kvferry.common.wire.messages import LATENT_KIND, MODEL_KINDS, Region

logger = logging.getLogger(__name__)


class LatentCache:
    """The latent rows of every layer of one DeepSeek model ("target" or "draft") on one device."""

    head_start = 0  # one replicated "head": what a dense pool's TP head range reads as here
    num_kv_heads = 1

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str, model_name: str = "target", layout: str = "page-major") -> None:
        if config.deepseek is None:
            raise ValueError(f"{config.source}: {config.architecture} has no latent attention; use KvCache")
        if model_name not in MODEL_KINDS:
            raise ValueError(f"model_name is {model_name!r}, expected one of {MODEL_KINDS}")
        if layout not in KV_LAYOUTS:
            raise ValueError(f"layout is {layout!r}, expected one of {KV_LAYOUTS}")
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages={num_pages} and page_size={page_size} must both be > 0")
        self.config = config
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.model_name = model_name
        self.layout = layout
        self.width = config.deepseek.latent_width
        num_layers = config.num_hidden_layers
        shape = (num_pages, num_layers) if layout == "page-major" else (num_layers, num_pages)
        # Zeros, not empty: padded attention reads unused rows with zero weight, and 0 * NaN is NaN.
        self.buffer = torch.zeros(shape + (page_size, self.width), dtype=dtype, device=self.device)
        views = self.buffer.transpose(0, 1) if layout == "page-major" else self.buffer
        self.latent = [views[layer] for layer in range(num_layers)]  # each [num_pages, page_size, width]
        logger.info("latent cache model=%s layout=%s layers=%d pages=%d page_size=%d width=%d bytes=%d device=%s",
                    model_name, layout, num_layers, num_pages, page_size, self.width, self.num_bytes, self.device)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's region."""
        return self.page_size * self.width * self.buffer.element_size()

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def kv_dtype(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def mem(self) -> str:
        return "VRAM" if self.device.type == "cuda" else "DRAM"

    @property
    def page_stride_bytes(self) -> int:
        """Bytes from one page of a region to the next (every layer's page page-major)."""
        return self.latent[0].stride(0) * self.buffer.element_size()

    def copy_page(self, src: int, dst: int) -> None:
        """Page ``dst`` of every layer becomes a copy of page ``src`` (copy-on-write of a shared page)."""
        if self.layout == "page-major":
            self.buffer[dst].copy_(self.buffer[src])
        else:
            self.buffer[:, dst].copy_(self.buffer[:, src])

    def tensors(self) -> list[torch.Tensor]:
        """Every region's tensor, in ``regions()`` order (one per layer)."""
        return list(self.latent)

    def regions(self) -> list[Region]:
        """One ``LATENT_KIND`` region per layer, addresses from data_ptr(); ``stride`` 0 when the
        pages are back to back (layer-major)."""
        device_index = 0
        if self.device.type == "cuda":
            device_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        stride = 0 if self.page_stride_bytes == self.page_bytes else self.page_stride_bytes
        return [Region(model=self.model_name, layer=layer, kind=LATENT_KIND, mem=self.mem, device=device_index,
                       addr=tensor.data_ptr(), item_len=self.page_bytes, num_pages=self.num_pages,
                       head_start=0, num_heads=1, stride=stride)
                for layer, tensor in enumerate(self.latent)]

"""What the daemons, the runner and the TP workers read of a KV pool, whichever the model picked.

Two classes implement it: ``KvCache`` (K and V per layer, ``kv_cache.py``) and ``LatentCache`` (one
MLA latent per layer, ``mla_cache.py``). Everything outside the model's own attention sees a pool
through this protocol only: one registered ``buffer``, a region table (``regions()``) both sides
match by key, whole-page copies for the prefix cache's copy-on-write, and the labels ``/server_info``
and ``/metrics`` show. What one form alone has (``KvCache.k``/``v`` and their FP8 scales,
``LatentCache.latent``) stays the model's business.

Invariants both classes keep (``tests/unit/test_kv_pool_protocol.py``):

- ``tensors()[i]`` is the tensor of ``regions()[i]``: same address, ``num_pages`` pages of
  ``page_bytes`` bytes each, ``page_stride_bytes`` apart, all inside ``buffer``;
- ``num_bytes`` is ``buffer``'s size, and every region's pages tile it exactly;
- ``copy_page(src, dst)`` makes page ``dst`` of every region equal page ``src`` and touches no
  other page;
- ``head_start``/``num_kv_heads`` are the KV heads the pool holds (a TP rank's slice for K/V; the
  one replicated "head" 0..1 for a latent).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from kvferry.common.models.config import ModelConfig
from kvferry.common.wire.messages import Region


@runtime_checkable
class KvPool(Protocol):
    """One model's ("target" or "draft") paged KV on one device, as the serving code reads it."""

    config: ModelConfig
    num_pages: int
    page_size: int  # tokens per page
    dtype: torch.dtype
    device: torch.device
    model_name: str  # "target" or "draft": the region's model tag on the wire
    layout: str  # "page-major" or "layer-major"
    head_start: int
    num_kv_heads: int
    buffer: torch.Tensor  # the one tensor registered with NIXL

    @property
    def page_bytes(self) -> int: ...

    @property
    def num_bytes(self) -> int: ...

    @property
    def kv_dtype(self) -> str: ...

    @property
    def mem(self) -> str: ...

    @property
    def page_stride_bytes(self) -> int: ...

    def copy_page(self, src: int, dst: int) -> None: ...

    def tensors(self) -> list[torch.Tensor]: ...

    def regions(self) -> list[Region]: ...

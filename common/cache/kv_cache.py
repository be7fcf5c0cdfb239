"""Paged KV cache: page ids (``PageAllocator``) and the page tensors (``KvCache``).

One contiguous buffer holds every layer's K and V, in one of two layouts::

    page-major (default): [num_pages, num_layers, 2 (k, v), num_kv_heads, page_size, head_dim]
        kv.k[layer] = buffer[:, layer, 0].transpose(1, 2)   # [num_pages, page_size, num_kv_heads, head_dim]
        page p of kv.k[layer] = [addr + p * block_bytes, + page_bytes), block_bytes = layers * 2 * page_bytes
    layer-major:          [num_layers, 2 (k, v), num_pages, num_kv_heads, page_size, head_dim]
        kv.k[layer] = buffer[layer, 0].transpose(1, 2)      # [num_pages, page_size, num_kv_heads, head_dim]
        page p of kv.k[layer] = [addr + p * page_bytes, + page_bytes)

Either way each (layer, K|V) tensor is one wire ``Region`` (``item_len`` = one page, ``stride`` =
bytes between its pages), and token t of a sequence lives in page ``page_ids[t // page_size]`` at
row ``t % page_size``. Page-major keeps one page of every layer in one block, so a prompt on
scattered pages is one NIXL descriptor per page instead of one per page per region.

In-page order, heads outermost: one page item is ``[num_kv_heads, page_size, head_dim]``, so the
bytes of heads ``[h, h + n)`` of a page are one contiguous range from
``(h - head_start) * page_size * head_dim * elem`` (and so is any token range of one head). That is
what ``kvferry.common.plan.tp`` assumes: a prefill and a decode with different TP sizes hold different head
slices, and each slice of a page moves as one descriptor. ``kv.k[layer]``/``kv.v[layer]`` keep
the logical ``[num_pages, page_size, Hkv, D]`` shape as strided views (strides ``(page stride,
head_dim, page_size * head_dim, 1)``); each page of them (``kv.k[layer][p]``) is one contiguous
page item seen through a transpose, and ``kv.k[layer].transpose(1, 2)`` is the page items as stored.
"""

from __future__ import annotations

import bisect
import logging

import math

import torch

from kvferry.common.errors import DisaggError, OverloadedError
from kvferry.common.kernels.kv_quant import is_quantized
from kvferry.common.models.config import ModelConfig
from kvferry.common.wire.messages import MODEL_KINDS, Region

logger = logging.getLogger(__name__)

KV_LAYOUTS = ("page-major", "layer-major")


class PageOwnershipError(DisaggError):
    """A page was freed twice, or a page id outside the pool was freed: a bookkeeping bug."""

    http_status = 500


class PageAllocator:
    """Hands out page ids in ``[0, num_pages)`` as whole free extents when it can, so that a room's
    pages form few contiguous runs (few NIXL descriptors after merging; no staging needed).

    The free pages are kept as maximal runs (extents). ``allocate(n)`` takes:

    - best fit: the smallest free run that holds ``n`` (lowest address among equals), from its
      start; a fresh pool therefore hands out ``0..n-1``;
    - when no run holds ``n``: the largest runs (lowest address among equals) until the rest fits
      in one run, then the best fit for the rest. That is the fewest runs any choice from the
      current free pages can have: ``k`` runs hold at most the ``k`` largest runs' pages.

    Pages come back in token order: the chosen runs largest first, each ascending, so that the
    first pages of a sequence (its prompt, the part a transfer moves) sit in the largest run.
    Guarantee, per call: no allocation from the same free pages has fewer runs (so never more than
    lowest-ids-first on the same free pages); across a history the free pages themselves differ,
    and ``bench``-style churn measures that (fewer runs in practice, not a theorem).

    A page may be shared (``share``: the prompt pages of n > 1 completions); it is free again once
    every holder has freed it. Deterministic: two pools given the same calls hand out the same ids
    (the target and draft pools move in lockstep). Not thread-safe: one owner thread.

    Cost: ``allocate`` is O(runs taken × (distinct run lengths + runs of one length)) list moves;
    distinct lengths are at most sqrt(2 × num_pages) (they sum to at most num_pages).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages is {num_pages}, expected > 0")
        self.num_pages = num_pages
        self._refs = [0] * num_pages  # holders of each page; 0 = free
        self._num_free = num_pages
        self._run_at: dict[int, int] = {}       # free run start -> its length
        self._run_ending: dict[int, int] = {}   # free run end (exclusive) -> its start
        self._starts_of: dict[int, list[int]] = {}  # length -> starts of the free runs that long, ascending
        self._lengths: list[int] = []           # the keys of _starts_of, ascending
        self._add_run(0, num_pages)

    @property
    def num_free(self) -> int:
        return self._num_free

    def can_allocate(self, num: int) -> bool:
        return 0 <= num <= self._num_free

    def allocate(self, num: int) -> list[int]:
        if num < 0:
            raise ValueError(f"cannot allocate {num} pages")
        if num > self._num_free:
            raise OverloadedError(
                f"KV pool has {self._num_free} free pages of {self.num_pages}, request needs {num}; "
                "retry later or raise --max-total-tokens"
            )
        pages: list[int] = []
        rest = num
        while rest > 0:
            i = bisect.bisect_left(self._lengths, rest)
            length = self._lengths[i] if i < len(self._lengths) else self._lengths[-1]  # best fit, else largest
            start = self._starts_of[length][0]
            take = min(rest, length)
            self._remove_run(start, length)
            if take < length:
                self._add_run(start + take, length - take)
            pages.extend(range(start, start + take))
            rest -= take
        for page in pages:
            self._refs[page] = 1
        self._num_free -= num
        return pages

    def share(self, pages: list[int]) -> list[int]:
        """One more holder for each of ``pages`` (all in use); returns them."""
        self._check(pages)
        for page in pages:
            self._refs[page] += 1
        return list(pages)

    def holders(self, page: int) -> int:
        """How many hold ``page`` (0: free). A prefix cache's page held by it alone has 1."""
        return self._refs[page]

    def free(self, pages: list[int]) -> None:
        """Drop one hold on each of ``pages``; a page nobody holds goes back (joined with the free
        runs beside it). Checks every id first, so a bad call changes nothing."""
        self._check(pages)
        released = []
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page] == 0:
                released.append(page)
        released.sort()
        i = 0
        while i < len(released):  # each ascending stretch of released pages is one run
            j = i + 1
            while j < len(released) and released[j] == released[j - 1] + 1:
                j += 1
            self._release_run(released[i], j - i)
            i = j
        self._num_free += len(released)

    def free_runs(self) -> list[tuple[int, int]]:
        """The free pages as maximal (start, length) runs, by address."""
        return sorted(self._run_at.items())

    def _release_run(self, start: int, length: int) -> None:
        left = self._run_ending.get(start)
        if left is not None:  # a free run ends where this one starts: join it
            left_length = self._run_at[left]
            self._remove_run(left, left_length)
            start, length = left, length + left_length
        right_length = self._run_at.get(start + length)
        if right_length is not None:
            self._remove_run(start + length, right_length)
            length += right_length
        self._add_run(start, length)

    def _add_run(self, start: int, length: int) -> None:
        self._run_at[start] = length
        self._run_ending[start + length] = start
        starts = self._starts_of.get(length)
        if starts is None:
            self._starts_of[length] = [start]
            bisect.insort(self._lengths, length)
        else:
            bisect.insort(starts, start)

    def _remove_run(self, start: int, length: int) -> None:
        del self._run_at[start]
        del self._run_ending[start + length]
        starts = self._starts_of[length]
        del starts[bisect.bisect_left(starts, start)]
        if not starts:
            del self._starts_of[length]
            del self._lengths[bisect.bisect_left(self._lengths, length)]

    def _check(self, pages: list[int]) -> None:
        seen: set[int] = set()
        for page in pages:
            if not isinstance(page, int) or not 0 <= page < self.num_pages:
                raise PageOwnershipError(f"page {page!r} is not in this pool of {self.num_pages} pages")
            if self._refs[page] == 0 or page in seen:
                raise PageOwnershipError(f"page {page} freed twice (it is already free)")
            seen.add(page)


class KvCache:
    """K and V pages of every layer of one model ("target" or "draft") on one device.

    ``dtype`` is the pool's: the model dtype, or ``torch.float8_e4m3fn`` (``--kv-cache-dtype
    fp8_e4m3``), whose pages hold each layer's K and V divided by its per-tensor scale
    (``k_scales[layer]``, ``v_scales[layer]``; ``common/kernels/kv_quant.py``). A pool of another
    dtype has every scale 1.0."""

    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        model_name: str = "target",
        layout: str = "page-major",
        head_start: int = 0,
        num_kv_heads: int | None = None,
        k_scales: tuple[float, ...] | None = None,
        v_scales: tuple[float, ...] | None = None,
    ) -> None:
        """``head_start``/``num_kv_heads``: the KV heads this pool holds (a TP rank's; default all).
        ``k_scales``/``v_scales``: one scale per layer for an FP8 pool (default all 1.0)."""
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
        self.head_start = head_start
        self.num_kv_heads = config.num_key_value_heads if num_kv_heads is None else num_kv_heads
        self.k_scales = _scales(k_scales, "k_scales", config.num_hidden_layers, dtype)
        self.v_scales = _scales(v_scales, "v_scales", config.num_hidden_layers, dtype)
        num_layers, page_shape = config.num_hidden_layers, (self.num_kv_heads, page_size, config.head_dim)
        is_page_major = layout == "page-major"
        shape = (num_pages, num_layers, 2) if is_page_major else (num_layers, 2, num_pages)
        # Zeros, not empty: padded attention reads unused rows with zero weight, and 0 * NaN is NaN.
        self.buffer = torch.zeros(shape + page_shape, dtype=dtype, device=self.device)
        # [L, 2, N, page_size, Hkv, D]: the logical order every consumer indexes, over heads-outer pages
        views = self.buffer.permute(1, 2, 0, 4, 3, 5) if is_page_major else self.buffer.permute(0, 1, 2, 4, 3, 5)
        self.k = [views[layer, 0] for layer in range(num_layers)]  # each [num_pages, page_size, Hkv, D], strided
        self.v = [views[layer, 1] for layer in range(num_layers)]
        logger.info(
            "KV cache model=%s kv_dtype=%s layout=%s layers=%d pages=%d page_size=%d bytes=%d device=%s",
            model_name, self.kv_dtype, layout, num_layers, num_pages, page_size, self.num_bytes, self.device,
        )

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one (layer, K|V) region."""
        return self.page_size * self.num_kv_heads * self.config.head_dim * self.buffer.element_size()

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
        """Bytes from one page of a region to the next: ``page_bytes`` layer-major, every region's
        page (one block) page-major."""
        return self.k[0].stride(0) * self.buffer.element_size()

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one page item: head ``h`` of a page starts ``(h - head_start) *
        head_bytes`` into it (heads outermost)."""
        return self.page_size * self.config.head_dim * self.buffer.element_size()

    def copy_page(self, src: int, dst: int) -> None:
        """Page ``dst`` of every region becomes a copy of page ``src`` (copy-on-write of a shared page);
        whole page items, whatever their in-page order."""
        if self.layout == "page-major":
            self.buffer[dst].copy_(self.buffer[src])
        else:
            self.buffer[:, :, dst].copy_(self.buffer[:, :, src])

    def tensors(self) -> list[torch.Tensor]:
        """Every region's tensor, in ``regions()`` order (layer 0 k, layer 0 v, layer 1 k, ...)."""
        return [t for layer in range(self.config.num_hidden_layers) for t in (self.k[layer], self.v[layer])]

    def regions(self) -> list[Region]:
        """The wire region table of this cache: one region per (layer, K|V), addresses from data_ptr().
        ``stride`` stays 0 (pages back to back) in the layer-major layout, as older peers expect."""
        device_index = 0
        if self.device.type == "cuda":
            device_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        stride = 0 if self.page_stride_bytes == self.page_bytes else self.page_stride_bytes
        out = []
        for layer in range(self.config.num_hidden_layers):
            for kind, tensor, scale in (("k", self.k[layer], self.k_scales[layer]),
                                        ("v", self.v[layer], self.v_scales[layer])):
                out.append(
                    Region(
                        model=self.model_name,
                        layer=layer,
                        kind=kind,
                        mem=self.mem,
                        device=device_index,
                        addr=tensor.data_ptr(),
                        item_len=self.page_bytes,
                        num_pages=self.num_pages,
                        head_start=self.head_start,
                        num_heads=self.num_kv_heads,
                        stride=stride,
                        scale=scale,  # a prefill converting a room into this pool quantises with it
                    )
                )
        return out


def _scales(values: tuple[float, ...] | None, name: str, num_layers: int, dtype: torch.dtype) -> tuple[float, ...]:
    """One positive finite scale per layer; only an FP8 pool may have scales other than 1.0."""
    if values is None:
        return (1.0,) * num_layers
    values = tuple(float(x) for x in values)
    if len(values) != num_layers:
        raise ValueError(f"{name} has {len(values)} values, the model has {num_layers} layers")
    bad = [(i, x) for i, x in enumerate(values) if not (math.isfinite(x) and x > 0)]
    if bad:
        raise ValueError(f"{name}: layer {bad[0][0]} has scale {bad[0][1]}, expected a finite value > 0")
    if not is_quantized(dtype) and any(x != 1.0 for x in values):
        raise ValueError(f"{name} other than 1.0 need an FP8 pool, this pool is {dtype}")
    return values

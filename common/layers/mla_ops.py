"""MLA's steps on each attention backend: mixins of ``attn_backend.TorchBackend`` (``TorchMlaOps``,
the torch compositions, which are also the references) and ``TritonBackend`` (``TritonMlaOps``,
``common/kernels/triton_mla.py`` and ``triton_absorb.py``).

``mla_rows`` makes a step's latent cache rows (RMSNorm of the latent, rope of k_pe), stores them and
rotates q_pe; ``mla_absorb_q`` / ``mla_absorb_v`` are the absorbed form's per-head projections;
``mla_absorb_q_rows`` is ``mla_rows`` then ``mla_absorb_q`` (one launch on triton with
``fuse_mla_rows``); ``mla_attend`` reads the latent cache (the new rows stored); ``mla_prefix``
gathers a chunk's cached prefix rows for the expanded prefill.
"""

from __future__ import annotations

import torch

from kvferry.common.layers import attention, mla


class TorchMlaOps:
    mla_rows = staticmethod(mla.latent_rows_ref)
    mla_absorb_q, mla_absorb_v = staticmethod(mla.absorb_q_ref), staticmethod(mla.absorb_v_ref)

    def mla_absorb_q_rows(self, q_nope, w_uk, q_pe, kv_a, cos_sin, norm, eps: float, rotary, cache,
                          plan) -> torch.Tensor:
        """The rows of ``kv_a`` made and stored into ``cache`` and the absorbed query [T, H, L + R] of
        q_nope and the rotated ``q_pe``: ``mla_rows`` then ``mla_absorb_q``."""
        q_pe, _ = self.mla_rows(kv_a, q_pe, cos_sin, norm, eps, rotary, cache, plan)
        return self.mla_absorb_q(q_nope, w_uk, q_pe)

    @staticmethod
    def mla_attend(q, cache, plan, latent_dim: int, scale: float) -> torch.Tensor:
        """q [T, H, L + R] (``latent_dim`` = L) over the latent cache, rows already stored -> [T, H, L]:
        one MQA whose key is the whole row and whose value is its first L elements."""
        keys = cache[:, :, None, :]  # [num_pages, page_size, 1, L + R]: one head every query head reads
        return attention.paged_attention(q, keys, keys[..., :latent_dim], plan, None, scale)

    @staticmethod
    def mla_prefix(cache, plan, i: int) -> torch.Tensor:
        """Chunk i's ``plan.starts[i]`` cached latent rows [starts[i], L + R], in token order (a copy)."""
        pages = plan.chunk_pages[i] if plan.chunk_pages is not None else plan.padded.kv_pages[i]
        return mla.prefix_rows(cache, pages, plan.starts[i])


class TritonMlaOps:
    """Needs ``self.mla``, ``self.absorb`` (the kernel modules) and the switches ``absorb_kernels``
    (the absorbed projections as kernels, else torch's einsums) and ``fuse_mla_rows`` (the rows and
    absorb_q in one launch, else two): ``bench/engine.py --mla-ab`` / ``--mla-rows-ab``."""

    def mla_rows(self, kv_a, q_pe, cos_sin, norm, eps: float, rotary, cache=None, plan=None):
        """As ``mla.latent_rows_ref``, in one launch (``triton_mla.latent_rows``)."""
        pages, rows = (plan.write_pages, plan.write_rows) if cache is not None else (None, None)
        return self.mla.latent_rows(kv_a, q_pe, *cos_sin, norm, eps, rotary.is_interleaved, cache, pages, rows)

    def mla_absorb_q(self, q_nope, w_uk, q_pe) -> torch.Tensor:  # one launch each (triton_absorb); torch's A/B
        return (self.absorb.absorb_q if self.absorb_kernels else mla.absorb_q_ref)(q_nope, w_uk, q_pe)

    def mla_absorb_v(self, out, w_uv) -> torch.Tensor:
        return (self.absorb.absorb_v if self.absorb_kernels else mla.absorb_v_ref)(out, w_uv)

    def mla_absorb_q_rows(self, q_nope, w_uk, q_pe, kv_a, cos_sin, norm, eps: float, rotary, cache,
                          plan) -> torch.Tensor:
        """As ``TorchMlaOps.mla_absorb_q_rows``; in one launch (``triton_absorb.absorb_q_rows``) with
        ``fuse_mla_rows`` and ``absorb_kernels``."""
        if not (self.fuse_mla_rows and self.absorb_kernels):
            return TorchMlaOps.mla_absorb_q_rows(self, q_nope, w_uk, q_pe, kv_a, cos_sin, norm, eps, rotary, cache,
                                                 plan)
        return self.absorb.absorb_q_rows(q_nope, w_uk, q_pe, kv_a, *cos_sin, norm, eps, rotary.is_interleaved,
                                         cache, plan.write_pages, plan.write_rows)

    def mla_attend(self, q, cache, plan, latent_dim: int, scale: float) -> torch.Tensor:
        """As ``TorchMlaOps.mla_attend``; always through the paged kernels (no dense prefill: SDPA's
        flash path takes no 576-wide key; a prefill runs MLA's expanded form instead, ``mla.py``)."""
        if plan.max_query == 1:
            return self.mla.decode_attention(q, cache, plan.page_table, plan.kv_lens, latent_dim, scale,
                                             plan.num_splits)
        return self.mla.extend_attention(q, cache, plan.page_table, plan.q_starts, plan.q_lens, plan.prefix_lens,
                                         plan.max_query, latent_dim, scale)

    @staticmethod
    def mla_prefix(cache, plan, i: int) -> torch.Tensor:
        """As ``TorchMlaOps.mla_prefix``, the pages from the plan's page table (host lengths: no sync)."""
        if plan.starts is None:
            raise ValueError("mla_prefix: this plan has no host starts (a CUDA graph's static plan); the expanded "
                             "MLA form needs an eager plan")
        return mla.prefix_rows(cache, plan.page_table[i], plan.starts[i])

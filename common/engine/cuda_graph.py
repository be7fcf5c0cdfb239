"""CUDA graphs for decode-sized forwards (one new token per sequence): target decode and draft steps.

At start-up ``DecodeGraphs.capture`` records ``model.run`` once per batch bucket (1, 2, 4, ... up
to ``--cuda-graph-max-bs``), largest first, all in one memory pool, over static input buffers::

    inputs     [max_bs, 5] int64: token, position, page, row (where its K/V goes), kv_len
    page_table [max_bs, max_pages] int64: the pages of each sequence's context

A step with n sequences copies its inputs into the first rows (rows n..bucket are padding: page
-1 stores nothing, kv_len 0 attends to nothing), replays the smallest bucket that holds n, and
returns the first n rows of that bucket's logits. Larger batches, several tokens per sequence and
``all_logits`` run eagerly. Only the Triton backend is captured: it never syncs the host and reads
pages through the static table (the torch path builds index tensors of data-dependent shapes).
Follows nano-vllm's ``ModelRunner.capture_cudagraph``.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from common.model.attn_backend import TritonPlan, pack_chunks

logger = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


class DecodeGraphs:
    """Captured decode forwards of one model over one KV cache (the logits of a replay are a view
    of a static buffer: use them before the next step)."""

    def __init__(self, model, kv, *, max_batch_size: int, max_context_tokens: int) -> None:
        if model.attn.name != "triton" or kv.device.type != "cuda":
            raise ValueError("CUDA graphs need the triton attention backend on a CUDA device")
        self.model = model
        self.kv = kv
        self.sizes = [b for b in GRAPH_BATCH_SIZES if b <= max_batch_size] or [1]
        self.max_pages = -(-max_context_tokens // kv.page_size)
        device, max_bs = kv.device, self.sizes[-1]
        self.inputs = torch.zeros(max_bs, 5, dtype=torch.int64, device=device)
        self.page_table = torch.zeros(max_bs, self.max_pages, dtype=torch.int64, device=device)
        self.arange = torch.arange(max_bs, dtype=torch.int64, device=device)
        self.ones = torch.ones(max_bs, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def can_run(self, chunks, all_logits: bool) -> bool:
        return (not all_logits and len(chunks) <= self.sizes[-1] and all(len(c.token_ids) == 1 for c in chunks)
                and max(c.start_pos for c in chunks) < self.max_pages * self.kv.page_size)

    def _forward(self, batch: int) -> torch.Tensor:
        cols = self.inputs[:batch].t().contiguous()  # [5, batch]: the kernels want unit strides
        plan = TritonPlan(
            positions=cols[1], write_pages=cols[2], write_rows=cols[3], last_index=self.arange[:batch],
            kv_lens=cols[4], q_starts=self.arange[:batch], q_lens=self.ones[:batch], prefix_lens=cols[1],
            page_table=self.page_table[:batch], query_lens=[1] * batch, max_query=1,
            num_splits=self.model.attn.num_splits(batch))
        return self.model.run(cols[0], plan, self.kv)

    @torch.inference_mode()
    def capture(self) -> float:
        """Record every bucket; returns the seconds it took (also logged)."""
        started = time.perf_counter()
        pool = None
        self.inputs[:, 2] = -1  # capture runs store nothing and attend to nothing
        self.inputs[:, 4] = 0
        for batch in reversed(self.sizes):
            self._forward(batch)  # warm-up: compiles the kernels, settles the allocator
            torch.cuda.synchronize(self.kv.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self._forward(batch)
            pool = graph.pool() if pool is None else pool
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.kv.device)
        took_s = time.perf_counter() - started
        logger.info("captured CUDA graphs model=%s batch_sizes=%s max_context_tokens=%d in %.2f s",
                    self.kv.model_name, self.sizes, self.max_pages * self.kv.page_size, took_s)
        return took_s

    def run(self, chunks) -> torch.Tensor:
        """Logits [n, vocab] (fp32) of a decode step of n <= max_batch_size one-token chunks."""
        num = len(chunks)
        batch = next(b for b in self.sizes if b >= num)
        host, width = pack_chunks(chunks, self.kv.page_size)  # T == B == num
        inputs = np.zeros((batch, 5), np.int64)
        inputs[:num] = host[:4 * num + 2 * num].reshape(6, num)[[0, 1, 2, 3, 5]].T  # skip last_index
        inputs[num:, 2] = -1
        self.inputs[:batch].copy_(torch.from_numpy(inputs))
        table = host[4 * num + 5 * num:].reshape(num, width)
        self.page_table[:num, :width].copy_(torch.from_numpy(table))
        self.graphs[batch].replay()
        return self.outputs[batch][:num]

"""CUDA graphs for decode-sized forwards: q new tokens per sequence, q = 1 (target decode, draft
steps) or q = k + 1 (speculative verify, every row's logits).

At start-up ``StepGraphs.capture`` records ``model.run`` once per batch bucket (1, 2, 4, ... up
to ``--cuda-graph-max-bs``), largest first, in one memory pool shared by every ``StepGraphs`` of the
device, over static input buffers::

    token_inputs [max_bs * q, 4] int64: token, position, page, row (where its K/V goes)
    seq_inputs   [max_bs, 4] int64: kv_len, first token's row, q, cached prefix
    page_table   [max_bs, max_pages] int64: the pages of each sequence's context

A step with n sequences copies its inputs into the first rows (the rest are padding: page -1
stores nothing, kv_len 0 and q 0 attend to nothing), replays the smallest bucket that holds n, and
returns the first n sequences' logits of that bucket. A decode bucket (q = 1) also has a greedy
head, captured as a second graph over its logits: the argmax tokens and their logprobs in
``sampler.greedy_pairs`` (one launch on CUDA), so an all-greedy step (``run_greedy``) launches no sampling op of
its own; a step that samples otherwise replays the forward only. Larger batches and other shapes run eagerly. Only the Triton backend is captured: it never syncs the host and reads
pages through the static table (the torch path builds index tensors of data-dependent shapes).
Every architecture's ``run`` takes the bucket's ``static_plan``: Llama's family, Qwen3-MoE and
DeepSeek (MLA through ``triton_mla``, its MoE through ``fused_moe``, a router without host syncs).
Follows nano-vllm's ``ModelRunner.capture_cudagraph``.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kvferry.common.layers.attn_backend import TritonPlan, pack_chunks, unpack
from kvferry.common.sampling.sampler import greedy_pairs

logger = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


class StepGraphs:
    """Captured forwards of one model over one KV cache, ``tokens_per_seq`` new tokens per sequence
    (the logits of a replay are views of static buffers: use them before the next step)."""

    def __init__(self, model, kv, *, max_batch_size: int, max_context_tokens: int, tokens_per_seq: int = 1,
                 pool=None) -> None:
        if model.attn.name != "triton" or kv.device.type != "cuda":
            raise ValueError("CUDA graphs need the triton attention backend on a CUDA device")
        self.model, self.kv, self.tokens_per_seq, self.pool = model, kv, tokens_per_seq, pool
        self.sizes = [b for b in GRAPH_BATCH_SIZES if b <= max_batch_size] or [1]
        self.max_pages = -(-max_context_tokens // kv.page_size)
        device, max_bs = kv.device, self.sizes[-1]
        self.token_inputs = torch.zeros(max_bs * tokens_per_seq, 4, dtype=torch.int64, device=device)
        self.seq_inputs = torch.zeros(max_bs, 4, dtype=torch.int64, device=device)
        self.page_table = torch.zeros(max_bs, self.max_pages, dtype=torch.int64, device=device)
        self.last_index = torch.arange(1, max_bs + 1, dtype=torch.int64, device=device) * tokens_per_seq - 1
        # pinned staging: a step's inputs go up without a host sync (the step's only sync is its tokens)
        self.host_tokens = torch.zeros(max_bs * tokens_per_seq * 4, dtype=torch.int64, pin_memory=True)
        self.host_seqs = torch.zeros(max_bs * 4, dtype=torch.int64, pin_memory=True)
        self.host_table = torch.zeros(max_bs * self.max_pages, dtype=torch.int64, pin_memory=True)
        self.staged = torch.cuda.Event()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0
        self.outputs: dict[int, torch.Tensor | list[torch.Tensor]] = {}
        self.heads: dict[int, torch.cuda.CUDAGraph] = {}  # q = 1: the greedy head over each bucket's logits
        self.picks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # its tokens [B] and pairs [B, 2]

    def can_run(self, chunks, all_logits: bool) -> bool:
        q = self.tokens_per_seq
        return (all_logits == (q > 1) and len(chunks) <= self.sizes[-1] and all(len(c.token_ids) == q for c in chunks)
                and max(c.start_pos for c in chunks) + q <= self.max_pages * self.kv.page_size)

    def _forward(self, batch: int):
        q = self.tokens_per_seq
        token_ids, plan = static_plan(self.token_inputs[:batch * q], self.seq_inputs[:batch], self.page_table[:batch],
                                      self.last_index[:batch], q, self.model.attn.num_splits(batch))
        return self.model.run(token_ids, plan, self.kv, all_logits=q > 1)

    @torch.inference_mode()
    def capture(self) -> float:
        """Record every bucket; returns the seconds it took (also logged)."""
        started = time.perf_counter()
        self.token_inputs[:, 2] = -1  # capture runs store nothing and attend to nothing
        self.seq_inputs.zero_()
        for batch in reversed(self.sizes):
            self._forward(batch)  # warm-up: compiles the kernels, settles the allocator
            torch.cuda.synchronize(self.kv.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[batch] = self._forward(batch)
            self.pool = graph.pool() if self.pool is None else self.pool
            self.graphs[batch] = graph
            if self.tokens_per_seq == 1:
                greedy_pairs(self.outputs[batch])  # warm-up outside the capture
                head = torch.cuda.CUDAGraph()
                with torch.cuda.graph(head, pool=self.pool):
                    self.picks[batch] = greedy_pairs(self.outputs[batch])
                self.heads[batch] = head
        torch.cuda.synchronize(self.kv.device)
        took_s = self.capture_s = time.perf_counter() - started
        logger.info("captured CUDA graphs model=%s tokens_per_seq=%d batch_sizes=%s max_context_tokens=%d in %.2f s",
                    self.kv.model_name, self.tokens_per_seq, self.sizes, self.max_pages * self.kv.page_size, took_s)
        return took_s

    def run(self, chunks, feed=None):
        """Logits of n <= max batch chunks of ``tokens_per_seq`` tokens: [n, vocab] fp32 (q = 1) or
        a list of n [q, vocab] (q > 1). ``feed`` (``llama.TokenFeed``, q = 1) puts device tokens
        into the static input after the host rows are copied."""
        return self.outputs[self._replay(chunks, feed)][:len(chunks)]

    def run_greedy(self, chunks, feed=None) -> tuple[torch.Tensor, torch.Tensor]:
        """q = 1: the greedy picks of n chunks, as ``Sampler.sample`` makes them for greedy rows with
        nothing to adjust: (tokens [n] int64, pairs [n, 2] float64 of token id and logprob). Views of
        the bucket's static buffers: its next greedy replay overwrites them, so read them (or queue
        a copy) before that."""
        batch = self._replay(chunks, feed)
        self.heads[batch].replay()
        tokens, pairs = self.picks[batch]
        return tokens[:len(chunks)], pairs[:len(chunks)]

    def _replay(self, chunks, feed) -> int:
        """Stage ``chunks``' inputs, replay the smallest bucket that holds them; returns that bucket."""
        num, q = len(chunks), self.tokens_per_seq
        batch = next(b for b in self.sizes if b >= num)
        token_inputs, seq_inputs, table = graph_inputs(chunks, self.kv.page_size, batch)
        if not self.staged.query():  # the previous step's copies still read the staging buffers
            self.staged.synchronize()
        self.token_inputs[:batch * q].copy_(_stage(self.host_tokens, token_inputs), non_blocking=True)
        self.seq_inputs[:batch].copy_(_stage(self.host_seqs, seq_inputs), non_blocking=True)
        self.page_table[:num, :table.shape[1]].copy_(_stage(self.host_table, table), non_blocking=True)
        self.staged.record()
        if feed is not None:
            self.token_inputs[:, 0].index_copy_(0, feed.rows, feed.values)
        self.graphs[batch].replay()
        return batch


def static_plan(token_inputs: torch.Tensor, seq_inputs: torch.Tensor, page_table: torch.Tensor,
                last_index: torch.Tensor, tokens_per_seq: int, num_splits: int) -> tuple[torch.Tensor, TritonPlan]:
    """(token ids [T], TritonPlan) of one bucket over its static buffers: token_inputs [T, 4],
    seq_inputs [batch, 4], page_table [batch, max_pages], last_index [batch] (``graph_inputs``' rows)."""
    per_token = token_inputs.t().contiguous()  # [4, T]: the kernels want unit strides
    per_seq = seq_inputs.t().contiguous()  # [4, batch]
    batch = seq_inputs.shape[0]
    plan = TritonPlan(
        positions=per_token[1], write_pages=per_token[2], write_rows=per_token[3], last_index=last_index,
        kv_lens=per_seq[0], q_starts=per_seq[1], q_lens=per_seq[2], prefix_lens=per_seq[3], page_table=page_table,
        query_lens=[tokens_per_seq] * batch, max_query=tokens_per_seq, num_splits=num_splits)
    return per_token[0], plan


def _stage(pinned: torch.Tensor, values: np.ndarray) -> torch.Tensor:
    """``values`` written into the front of a flat pinned buffer; returns that view, shaped."""
    view = pinned[:values.size].view(values.shape)
    view.numpy()[...] = values
    return view


def graph_inputs(chunks, page_size: int, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host rows of the static buffers for ``chunks`` (each of q tokens) padded to ``batch``
    sequences: token_inputs [batch * q, 4] (padding page -1), seq_inputs [batch, 4] (padding all 0:
    kv_len 0, q 0), page table [len(chunks), pages of the longest context]."""
    num, q = len(chunks), len(chunks[0].token_ids)
    host, width = pack_chunks(chunks, page_size)
    num_tokens = num * q
    per_token, per_chunk, table = unpack(host, num_tokens, num, width)
    token_inputs = np.zeros((batch * q, 4), np.int64)
    token_inputs[:num_tokens] = per_token.T
    token_inputs[num_tokens:, 2] = -1
    seq_inputs = np.zeros((batch, 4), np.int64)
    seq_inputs[:num] = per_chunk[1:].T
    return token_inputs, seq_inputs, table

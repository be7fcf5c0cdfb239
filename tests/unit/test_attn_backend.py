"""The Triton backend's host-side plan (``pack_chunks``) agrees with the torch path's index tensors,
and backend selection refuses Triton off CUDA. Runs on CPU: no kernel is launched here."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.common.layers.attention import build_plan
from kvferry.common.layers.attn_backend import pack_chunks, resolve_backend, unpack
from kvferry.common.models.llama import SeqChunk


@st.composite
def batches(draw):
    page_size = draw(st.sampled_from([1, 4, 16]))
    lens = draw(st.lists(st.tuples(st.integers(0, 70), st.integers(1, 20)), min_size=1, max_size=6))
    if draw(st.booleans()):
        lens = [(start, 1) for start, _ in lens]  # decode: one token per chunk
    rng = random.Random(draw(st.integers(0, 1000)))
    chunks = []
    for start, num_new in lens:
        num_pages = -(-(start + num_new) // page_size) + draw(st.integers(0, 2))  # tables may be longer
        chunks.append(SeqChunk([rng.randrange(512) for _ in range(num_new)], start,
                               rng.sample(range(500), num_pages)))
    return chunks, page_size


@settings(max_examples=60, deadline=None)
@given(batches())
def test_pack_matches_torch_plan(case):
    chunks, page_size = case
    packed, max_pages = pack_chunks(chunks, page_size)
    query_lens = [len(c.token_ids) for c in chunks]
    want = build_plan(query_lens, [c.start_pos for c in chunks], [c.page_ids for c in chunks], page_size,
                      torch.device("cpu"))
    num_tokens, batch = sum(query_lens), len(chunks)
    per_token, per_chunk, table = unpack(packed, num_tokens, batch, max_pages)
    last, kv_lens, q_starts, q_lens, prefix = per_chunk
    # every row starts 16-byte aligned (Triton compiles a kernel per pointer alignment)
    assert all(row.ctypes.data % 16 == 0 for row in [*per_token, *per_chunk, table])
    assert per_token[0].tolist() == [t for c in chunks for t in c.token_ids]
    assert per_token[1].tolist() == want.positions.tolist()
    assert per_token[2].tolist() == want.write_pages.tolist()
    assert per_token[3].tolist() == want.write_rows.tolist()
    assert last.tolist() == want.last_index.tolist()
    assert q_lens.tolist() == query_lens and prefix.tolist() == [c.start_pos for c in chunks]
    assert (kv_lens == q_lens + prefix).all() and (q_starts == last - q_lens + 1).all()
    for i, c in enumerate(chunks):
        used = -(-int(kv_lens[i]) // page_size)
        assert table[i, :used].tolist() == c.page_ids[:used]
        assert not table[i, used:].any()  # padding is page 0, never read (beyond kv_lens)


def test_backend_choice():
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("torch", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="expected one of"):
        resolve_backend("flash", torch.device("cpu"))


@pytest.mark.parametrize("q", [1, 5])
def test_graph_inputs_pad_to_the_bucket(q):
    from kvferry.common.engine.cuda_graph import graph_inputs

    chunks = [SeqChunk(list(range(10 * i, 10 * i + q)), start, pages)
              for i, (start, pages) in enumerate([(3, [7, 2, 9]), (20, [4, 1, 8, 6]), (0, [5])])]
    tokens, seqs, table = graph_inputs(chunks, 8, batch=4)
    assert tokens.shape == (4 * q, 4) and seqs.shape == (4, 4)
    assert tokens[:3 * q, 0].tolist() == [t for c in chunks for t in c.token_ids]
    assert tokens[:q, 1].tolist() == list(range(3, 3 + q))  # positions
    assert tokens[q, 2] == [4, 1, 8, 6][20 // 8] and tokens[q, 3] == 20 % 8  # page, row of token 20
    assert (tokens[3 * q:, 2] == -1).all()  # padding stores nothing
    assert seqs[:3].tolist() == [[3 + q, 0, q, 3], [20 + q, q, q, 20], [q, 2 * q, q, 0]]
    assert not seqs[3].any()  # padding: kv_len 0, q 0
    assert table[1, :-(-(20 + q) // 8)].tolist() == [4, 1, 8, 6][:-(-(20 + q) // 8)]

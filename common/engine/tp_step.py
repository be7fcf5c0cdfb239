"""One step of a tensor-parallel engine as rank 0 sends it to the other ranks: pure, no process
group, no device.

A step is a ``StepHeader`` (64 bytes, fixed size, written to each worker's stdin pipe, which is
also how a worker learns that rank 0 is gone: end of file) and, for a forward, one int64 payload
that rank 0 broadcasts over the TP group::

    [query_len x B] [start_pos x B] [num_page_ids x B] [token_ids x T] [page_ids x P]

so every rank runs ``model.forward`` on the same ``SeqChunk`` list. The token ids are the ones the
forward reads (rank 0 applies a ``TokenFeed`` to them before the broadcast), so a decode step fed
from the device needs no host copy on rank 0.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from kvferry.common.errors import ProtocolError
from kvferry.common.models.llama import SeqChunk

HEADER_MAGIC = 0x4B56_5450_0001  # "KVTP" v1: bump the low digits when the header changes
_HEADER = struct.Struct("<8q")
HEADER_BYTES = _HEADER.size


class StepKind(IntEnum):
    FORWARD = 1  # a payload broadcast follows; every rank runs the forward on its own KV pool
    COPY_PAGE = 2  # page dst_page of every region becomes a copy of src_page (fork copy-on-write)
    CLOSE = 3  # rank 0 closes the group: leave the loop and exit 0


@dataclass(frozen=True, slots=True)
class StepHeader:
    """Sent by rank 0 to each worker before every step, in the same order to all of them."""

    kind: StepKind
    num_chunks: int = 0
    num_tokens: int = 0
    num_page_ids: int = 0
    src_page: int = 0
    dst_page: int = 0

    @property
    def payload_len(self) -> int:
        """int64 elements of the forward payload (0 for other kinds)."""
        if self.kind != StepKind.FORWARD:
            return 0
        return 3 * self.num_chunks + self.num_tokens + self.num_page_ids

    def encode(self) -> bytes:
        return _HEADER.pack(HEADER_MAGIC, int(self.kind), self.num_chunks, self.num_tokens, self.num_page_ids,
                            self.src_page, self.dst_page, 0)

    @classmethod
    def decode(cls, data: bytes) -> "StepHeader":
        if len(data) != HEADER_BYTES:
            raise ProtocolError(f"TP step header is {len(data)} bytes, expected {HEADER_BYTES}")
        magic, kind, num_chunks, num_tokens, num_page_ids, src, dst, _ = _HEADER.unpack(data)
        if magic != HEADER_MAGIC:
            raise ProtocolError(f"TP step header magic is {magic:#x}, expected {HEADER_MAGIC:#x} "
                                "(rank 0 and the worker run different kvferry versions?)")
        if kind not in StepKind._value2member_map_:
            raise ProtocolError(f"TP step kind {kind} is unknown; known: {[k.value for k in StepKind]}")
        if min(num_chunks, num_tokens, num_page_ids, src, dst) < 0:
            raise ProtocolError(f"TP step header has a negative field: {_HEADER.unpack(data)}")
        return cls(StepKind(kind), num_chunks, num_tokens, num_page_ids, src, dst)


def encode_forward(chunks: list[SeqChunk]) -> tuple[StepHeader, np.ndarray]:
    """The header and int64 payload of a forward over ``chunks`` (page lists sent whole, so every
    rank builds the same attention plan)."""
    query_lens = [len(c.token_ids) for c in chunks]
    page_counts = [len(c.page_ids) for c in chunks]
    payload = np.fromiter(
        [*query_lens, *(c.start_pos for c in chunks), *page_counts,
         *(t for c in chunks for t in c.token_ids), *(p for c in chunks for p in c.page_ids)],
        dtype=np.int64)
    header = StepHeader(StepKind.FORWARD, len(chunks), sum(query_lens), sum(page_counts))
    return header, payload


def decode_forward(header: StepHeader, payload: np.ndarray) -> list[SeqChunk]:
    """The chunks ``encode_forward`` packed; raises ProtocolError when the payload does not match."""
    if header.kind != StepKind.FORWARD or len(payload) != header.payload_len:
        raise ProtocolError(f"TP forward payload has {len(payload)} elements, header {header} wants "
                            f"{header.payload_len}")
    b = header.num_chunks
    query_lens, starts, page_counts = (payload[i * b:(i + 1) * b].tolist() for i in range(3))
    if sum(query_lens) != header.num_tokens or sum(page_counts) != header.num_page_ids:
        raise ProtocolError(f"TP forward payload: query lengths sum to {sum(query_lens)} and page counts to "
                            f"{sum(page_counts)}, header says {header.num_tokens} and {header.num_page_ids}")
    tokens = payload[3 * b:3 * b + header.num_tokens].tolist()
    pages = payload[3 * b + header.num_tokens:].tolist()
    out, t, p = [], 0, 0
    for n, start, num_pages in zip(query_lens, starts, page_counts):
        out.append(SeqChunk(tokens[t:t + n], start, pages[p:p + num_pages]))
        t, p = t + n, p + num_pages
    return out

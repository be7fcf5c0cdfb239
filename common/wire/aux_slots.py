"""Aux record slots: a small pinned block of fixed-size records that rides along with each KV WRITE.

The prefill fills its slot with the room id, first token (and its top logprobs) and prompt length,
and the same WRITE that moves the KV copies it into the decode's slot (DESIGN §3; the record's
layout and versions: ``common/wire/aux_record.py``). Slots are handed out one per room
in flight; ``acquire`` never returns a slot twice before ``release``.
"""

from __future__ import annotations

import torch

from kvferry.common.errors import OverloadedError
from kvferry.common.wire.aux_record import AUX_RECORD_V3_BYTES
from kvferry.common.wire.messages import AuxInfo


class AuxSlots:
    def __init__(self, num_slots: int, *, item_len: int = AUX_RECORD_V3_BYTES, device: str = "cpu"):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        # buffer: [num_slots, item_len] bytes; one contiguous block so one NIXL registration covers it
        self.buffer = torch.zeros((num_slots, item_len), dtype=torch.uint8, device=device)
        self.item_len = item_len
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise OverloadedError(f"all {self.num_slots} aux slots are in use; retry later")
        slot = self._free.pop()
        self._held.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._held:
            raise ValueError(f"aux slot {slot} is not held")
        self._held.remove(slot)
        self.buffer[slot].zero_()  # a stale record must never pass for a new room's
        self._free.append(slot)

    def write(self, slot: int, record: bytes) -> None:
        data = torch.frombuffer(bytearray(record), dtype=torch.uint8)
        self.buffer[slot, : len(record)].copy_(data)

    def read(self, slot: int) -> bytes:
        return bytes(self.buffer[slot].cpu().numpy().tobytes())

    def info(self) -> AuxInfo:
        is_cuda = self.buffer.is_cuda
        device = (self.buffer.device.index or 0) if is_cuda else 0
        return AuxInfo(mem="VRAM" if is_cuda else "DRAM", device=device,
                       addr=self.buffer.data_ptr(), item_len=self.item_len, num_slots=self.num_slots)

"""The foundation end to end: a real prefill daemon and a decode side built from the library's
pieces in this process, over real ZeroMQ and real NIXL (UCX, DRAM).

The decode side registers target *and* draft regions, gets the ack (draft ignored: decode-only
speculative decoding), asks for a room on non-contiguous pages, and checks that exactly those
pages changed (everything else was poisoned beforehand), that they hold the prompt's KV, and that
the aux slot carries the room id, the prompt length and the first token.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import torch

from kvferry.common.wire import messages as wire
from kvferry.common.wire.aux_record import AuxRecord
from kvferry.common.wire.aux_slots import AuxSlots
from kvferry.common.models.config import ModelConfig
from kvferry.common.cache.kv_cache import KvCache
from kvferry.common.models.llama import SeqChunk
from kvferry.common.models.loader import load_model
from kvferry.common.daemon.procs import http_json
from kvferry.common.transport.nixl import NixlEngine
from kvferry.common.transport.zmq import BootstrapClient

POISON = 0xAB
PAGE_SIZE = 16
NUM_PAGES = 16
PAGE_IDS = [7, 2, 11]  # token pages 0, 1, 2 of the room land here, out of order on purpose
AUX_SLOT = 3


def _poisoned_cache(model_dir: str, name: str) -> KvCache:
    kv = KvCache(ModelConfig.from_dir(model_dir), NUM_PAGES, PAGE_SIZE, torch.float32, "cpu", model_name=name)
    kv.buffer.view(torch.uint8).fill_(POISON)
    return kv


def _page_is_poisoned(kv: KvCache, page: int) -> bool:
    return all(bool((t[page].contiguous().view(torch.uint8) == POISON).all()) for t in kv.tensors())


async def _register_and_transfer(prefill, engine, target, draft, aux, room, prompt) -> tuple:
    client = BootstrapClient("127.0.0.1", prefill.bootstrap_port)
    client.start()
    try:
        register = wire.Register(
            decode_id="test-decode", agent_name=engine.name, agent_metadata=engine.metadata(),
            model=ModelConfig.from_dir(prefill.model_dir).fingerprint, page_size=PAGE_SIZE,
            kv_dtype=target.kv_dtype, tp_size=1, tp_rank=0, regions=draft.regions() + target.regions(),
            aux=aux.info(), page_order=wire.PAGE_ORDER)
        await client.send(register)
        ack = await client.recv(timeout_s=30)
        await client.send(wire.Transfer(room=room, decode_id="test-decode", page_ids=PAGE_IDS, aux_slot=AUX_SLOT,
                                        num_prompt_tokens=len(prompt)))
        deadline = time.monotonic() + 60
        notifs: list[bytes] = []
        while not notifs and time.monotonic() < deadline:
            for payloads in engine.get_notifs().values():
                notifs.extend(payloads)
            await asyncio.sleep(0.001)
        result = await client.recv(timeout_s=10)
        return ack, notifs, result
    finally:
        client.close()


def test_register_then_write_exactly_the_requested_pages(cluster, tiny_models):
    target_dir, draft_dir = tiny_models
    prefill = cluster.prefill()
    prefill.model_dir = target_dir
    target, draft = _poisoned_cache(target_dir, "target"), _poisoned_cache(draft_dir, "draft")
    aux = AuxSlots(8)
    aux.buffer.fill_(POISON)
    engine = NixlEngine("test-decode")
    try:
        for buf in (target.buffer, draft.buffer, aux.buffer):
            engine.register_tensor(buf)
        rng = random.Random(11)
        prompt = [rng.randrange(5, 512) for _ in range(40)]  # 3 pages, the last one partly filled
        room = rng.getrandbits(63)
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}
        answer: dict = {}
        leg = threading.Thread(target=lambda: answer.update(r=http_json(prefill.url + "/generate", body)))
        leg.start()
        ack, notifs, result = asyncio.run(_register_and_transfer(prefill, engine, target, draft, aux, room, prompt))
        leg.join(60)
    finally:
        engine.close()

    assert isinstance(ack, wire.RegisterAck) and ack.accepted, ack
    assert ack.decode_only_spec_dec
    assert {k[0] for k in ack.written} == {"target"} and {k[0] for k in ack.ignored} == {"draft"}
    assert len(ack.written) == len(target.regions()) and len(ack.ignored) == len(draft.regions())
    status, reply = answer["r"]
    assert status == 200, reply
    assert isinstance(result, wire.TransferResult) and result.ok, result
    # One notification, carrying the room (one WRITE for KV and aux).
    assert [wire.decode(n) for n in notifs] == [wire.Notification(room=room, decode_id="test-decode", ok=True)]

    # Exactly the requested target pages changed; the draft (ignored) and every other page did not.
    for page in range(NUM_PAGES):
        assert _page_is_poisoned(target, page) == (page not in PAGE_IDS), page
        assert _page_is_poisoned(draft, page), page
    # The aux slot carries the room, the prompt length and the first token; other slots are untouched.
    record = AuxRecord.unpack(aux.read(AUX_SLOT))
    assert (record.room, record.num_prompt_tokens) == (room, len(prompt))
    assert record.first_token_id == reply["output_ids"][0]
    for slot in range(8):
        if slot != AUX_SLOT:
            assert bool((aux.buffer[slot] == POISON).all()), slot

    # The written pages hold the prompt's KV: recompute it locally and compare token slots.
    model = load_model(target_dir, dtype="float32")
    reference = KvCache(model.config, NUM_PAGES, PAGE_SIZE, torch.float32, "cpu")
    model.forward([SeqChunk(prompt, 0, [0, 1, 2])], reference)
    for layer in range(model.config.num_hidden_layers):
        for got, want in ((target.k[layer], reference.k[layer]), (target.v[layer], reference.v[layer])):
            for j, page in enumerate(PAGE_IDS):
                filled = min(PAGE_SIZE, len(prompt) - j * PAGE_SIZE)
                torch.testing.assert_close(got[page, :filled], want[j, :filled], rtol=1e-5, atol=1e-5)

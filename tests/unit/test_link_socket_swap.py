"""The decode's ``PrefillLink`` against a real prefill control plane (``tests/unit/control_plane.py``:
real ZeroMQ, real NIXL): a registration whose socket is replaced before its ack is read starts
again on the new socket, so the transfers that follow go out on the connection that registered.

The prefill binds a decode id to the connection its register came on and refuses transfers naming
it from any other. ``_rebuild_socket`` (several pings without a connection, e.g. while a restarted
prefill comes up) can replace the socket between a register and its ack; before, the link then
counted itself registered and its first transfers were refused ("belongs to the connection that
registered it": ``tests/faults/test_restart.py::test_restart_prefill`` failed so, once)."""

from __future__ import annotations

import time

import pytest

from kvferry.common.daemon.metrics import Metrics
from kvferry.common.wire import messages as wire
from kvferry.decode_worker.link import LinkState, PrefillLink
from tests.unit.control_plane import Decode, Prefill, run, until

pytestmark = pytest.mark.timeout(60)


class Owner:
    """What the link asks of its decode: the register message, heartbeat settings, metrics, and a
    list of the room frames it hands over."""

    def __init__(self, decode: Decode) -> None:
        self.register_msg = decode.register_msg
        self.heartbeat_interval_s, self.heartbeat_misses = 0.5, 3
        self.metrics = Metrics("decode")
        self.messages: list[wire.Message] = []

    def on_link_message(self, link, msg: wire.Message) -> None:
        self.messages.append(msg)

    def on_link_lost(self, link, reason: str) -> None:
        raise AssertionError(f"the prefill is up: link lost ({reason})")


def _swap_after_first_register(link: PrefillLink, sent: list[str]) -> None:
    """The socket is replaced right after the first register leaves on it, as the heartbeat loop
    would replace it then (the real send first: ZeroMQ delivers it and the prefill acks it)."""
    first = link.client
    real_send = first.send

    async def send(msg, timeout_s: float = 5.0):
        await real_send(msg, timeout_s=timeout_s)
        if isinstance(msg, wire.Register) and not sent:
            sent.append("first")
            link._rebuild_socket()

    first.send = send


@pytest.mark.parametrize("state", ["new", "registered"])
def test_a_socket_replaced_under_registration_registers_again_on_the_new_one(state):
    async def main():
        prefill = await Prefill().start()
        decode = Decode(prefill.port).start()  # its poller drives its side of UCX progress
        owner = Owner(decode)
        link = PrefillLink("127.0.0.1", prefill.port, owner)
        link.start()
        try:
            sent: list[str] = []
            if state == "registered":  # registered on the first socket, then that socket is replaced
                assert (await link.ensure_registered(5)).accepted
                link._rebuild_socket()
                assert link.state is LinkState.NEW  # the new socket is unknown to the prefill
            else:
                _swap_after_first_register(link, sent)
            assert (await link.ensure_registered(5)).accepted
            assert link.state is LinkState.REGISTERED
            assert state == "registered" or sent == ["first"]
            room = prefill.open_room(2, num_tokens=20)
            await link.send(decode.transfer(2, 20, [8, 9]))
            await prefill.writer.send_room(room, time.monotonic() + 5)
            await until(lambda: any(isinstance(m, wire.TransferResult) and m.room == 2 for m in owner.messages),
                        what="room 2's result")
            result = next(m for m in owner.messages if isinstance(m, wire.TransferResult) and m.room == 2)
            assert result.ok, result
            assert decode.pool[8].equal(prefill.pool[0])  # the WRITE landed in the pages the transfer named
        finally:
            await link.close()
            decode.close()
            await prefill.close()
    run(main())

"""Bootstrap ROUTER/DEALER over real ZeroMQ on 127.0.0.1, on a uvloop loop. No mocks."""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop
import zmq
import zmq.asyncio

from kvferry.common.errors import ConfigError, PeerUnavailableError, ProtocolError
from kvferry.common.transport.zmq import BootstrapClient, BootstrapServer, keygen, load_keys, load_public_keys
from kvferry.common.wire.messages import MAX_FRAME_BYTES, Abort, AuxInfo, Ping, Pong, Region, Register, Transfer, encode

pytestmark = pytest.mark.timeout(30)


def run(coro):
    """Run ``coro`` on a fresh uvloop loop, as the daemons do."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _register() -> Register:
    region = Region(model="target", layer=0, kind="k", mem="DRAM", device=0, addr=1 << 40, item_len=4096,
                    num_pages=64, head_start=0, num_heads=2)
    return Register(decode_id="d-1", agent_name="decode-abc", agent_metadata=b"\x00\xffmeta", model="llama-x",
                    page_size=16, kv_dtype="bfloat16", tp_size=1, tp_rank=0, regions=[region],
                    aux=AuxInfo(mem="DRAM", device=0, addr=1 << 41, item_len=32, num_slots=8))


async def _pair(**client_kwargs) -> tuple[BootstrapServer, BootstrapClient]:
    server = BootstrapServer("127.0.0.1", 0)
    server.start()
    client = BootstrapClient("127.0.0.1", server.port, **client_kwargs)
    client.start()
    return server, client


def test_round_trip_under_uvloop():
    async def main():
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        server, client = await _pair(identity=b"decode-1")
        try:
            for msg in (_register(), Transfer(room=7, decode_id="d-1", page_ids=[3, 1, 2], aux_slot=0,
                                              num_prompt_tokens=40), Ping(t=1.5)):
                await client.send(msg, timeout_s=5)
                got = await server.recv(timeout_s=5)
                assert got == (b"decode-1", msg)
            await server.send(b"decode-1", Pong(t=1.5))
            assert await client.recv(timeout_s=5) == Pong(t=1.5)
        finally:
            client.close()
            server.close()
    run(main())


def test_garbage_frames_come_back_as_protocol_errors_and_server_keeps_serving():
    async def main():
        server = BootstrapServer("127.0.0.1", 0)
        server.start()
        ctx = zmq.asyncio.Context()
        raw = ctx.socket(zmq.DEALER)  # a misbehaving client, bypassing BootstrapClient's codec
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.ROUTING_ID, b"raw")
        raw.connect(f"tcp://127.0.0.1:{server.port}")
        try:
            bad = [[b"\xc1not msgpack"], [encode(Ping(t=1.0)), b"tail"], [b"\x81\xa1v\x63"]]
            for frames in bad:
                await raw.send_multipart(frames)
                identity, got = await server.recv(timeout_s=5)
                assert identity == b"raw"
                assert isinstance(got, ProtocolError), got
            # Oversized: libzmq drops that connection before Python sees a byte; the server lives on.
            await raw.send(b"\x00" * (MAX_FRAME_BYTES + 1))
            assert await server.recv(timeout_s=0.5) is None
            client = BootstrapClient("127.0.0.1", server.port)
            client.start()
            await client.send(Abort(room=1, reason="client gone"), timeout_s=5)
            identity, got = await server.recv(timeout_s=5)
            assert got == Abort(room=1, reason="client gone")
            await server.send(identity, Pong(t=0.0))
            assert await client.recv(timeout_s=5) == Pong(t=0.0)
            client.close()
        finally:
            ctx.destroy(linger=0)
            server.close()
    run(main())


def test_timeouts_and_unreachable_peers():
    async def main():
        server, client = await _pair()
        try:
            start = time.monotonic()
            assert await server.recv(timeout_s=0.2) is None
            assert await client.recv(timeout_s=0.2) is None
            # each recv waited out its own 0.2 s (the loop may wake a little early)
            assert time.monotonic() - start >= 0.35
            with pytest.raises(PeerUnavailableError, match="not connected"):
                await server.send(b"nobody", Pong(t=0.0))
        finally:
            client.close()
            server.close()
        # Nothing listens on that port any more: the DEALER cannot send (IMMEDIATE) and says so.
        lonely = BootstrapClient("127.0.0.1", server.port)
        lonely.start()
        try:
            with pytest.raises(PeerUnavailableError, match="no connection within 0.3 s"):
                await lonely.send(Ping(t=0.0), timeout_s=0.3)
        finally:
            lonely.close()
    run(main())


def test_malformed_reply_raises_protocol_error_on_client():
    async def main():
        server, client = await _pair(identity=b"c")
        try:
            await client.send(Ping(t=0.0), timeout_s=5)
            assert (await server.recv(timeout_s=5))[0] == b"c"
            await server._require_open().send_multipart([b"c", b"\xc1"])
            with pytest.raises(ProtocolError, match="msgpack"):
                await client.recv(timeout_s=5)
        finally:
            client.close()
            server.close()
    run(main())


def test_curve_allows_listed_client_and_shuts_out_others(tmp_path):
    server_pub, server_sec = load_keys(keygen(tmp_path / "server", "prefill")[1])
    keygen(tmp_path / "clients", "decode")
    keygen(tmp_path / "intruder", "intruder")
    client_pub, client_sec = load_keys(tmp_path / "clients" / "decode.key_secret")
    intruder_pub, intruder_sec = load_keys(tmp_path / "intruder" / "intruder.key_secret")
    allowed = load_public_keys(tmp_path / "clients")
    assert allowed == {client_pub} and server_sec is not None and intruder_pub not in allowed
    assert (tmp_path / "server" / "prefill.key_secret").stat().st_mode & 0o077 == 0

    async def main():
        server = BootstrapServer("127.0.0.1", 0, curve_public_key=server_pub, curve_secret_key=server_sec,
                                 allowed_client_keys=allowed)
        server.start()
        good = BootstrapClient("127.0.0.1", server.port, curve_public_key=client_pub, curve_secret_key=client_sec,
                               server_public_key=server_pub, identity=b"good")
        again = BootstrapClient("127.0.0.1", server.port, curve_public_key=client_pub, curve_secret_key=client_sec,
                                server_public_key=server_pub, identity=b"good-reconnected")
        bad = BootstrapClient("127.0.0.1", server.port, curve_public_key=intruder_pub,
                              curve_secret_key=intruder_sec, server_public_key=server_pub, identity=b"bad")
        good.start()
        again.start()
        bad.start()
        try:
            await good.send(Ping(t=2.0), timeout_s=5)
            assert await server.recv(timeout_s=5) == (b"good", Ping(t=2.0))
            # the owner of a connection is its CURVE client key: a second connection with that key
            # (a decode that reconnected) has the same owner, so it keeps its decode ids
            await again.send(Ping(t=4.0), timeout_s=5)
            assert await server.recv(timeout_s=5) == (b"good-reconnected", Ping(t=4.0))
            assert server.owner_of(b"good") == server.owner_of(b"good-reconnected") == client_pub
            await server.send(b"good", Pong(t=2.0))
            assert await good.recv(timeout_s=5) == Pong(t=2.0)
            with pytest.raises(PeerUnavailableError):
                await bad.send(Ping(t=3.0), timeout_s=1.0)
            assert await server.recv(timeout_s=1.0) is None
        finally:
            good.close()
            again.close()
            bad.close()
            server.close()
    run(main())


def test_curve_config_errors(tmp_path):
    public, secret = load_keys(keygen(tmp_path)[1])
    with pytest.raises(ConfigError, match="allow-list"):
        BootstrapServer("127.0.0.1", 0, curve_public_key=public, curve_secret_key=secret)
    with pytest.raises(ConfigError, match="both"):
        BootstrapServer("127.0.0.1", 0, curve_public_key=public, allowed_client_keys=[public])
    with pytest.raises(ConfigError, match="together"):
        BootstrapClient("127.0.0.1", 1, curve_public_key=public, curve_secret_key=secret)
    with pytest.raises(ConfigError, match="40-character"):
        BootstrapServer("127.0.0.1", 0, curve_public_key=b"short", curve_secret_key=secret,
                        allowed_client_keys=[public])
    with pytest.raises(ConfigError, match="cannot load"):
        load_keys(tmp_path / "missing.key")

"""Wire protocol v1: every kind round-trips, and nothing a peer sends raises anything but ProtocolError."""

from __future__ import annotations

import dataclasses
import types
import typing

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.common.wire import messages as wire
from kvferry.common.errors import ProtocolError

KINDS = sorted(wire._REGISTRY.values(), key=lambda cls: cls.KIND)
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1  # what msgpack can carry

TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(INT_MIN, INT_MAX),
                    st.floats(allow_nan=False), TEXT, st.binary(max_size=12))
# Any msgpack value: scalars, arrays and maps with string keys, nested.
ANY_VALUE = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                         | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)


def _is_optional(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _inner(hint):
    return next(a for a in typing.get_args(hint) if a is not type(None))


def value_strategy(hint) -> st.SearchStrategy:
    """A strategy for valid values of one field, derived from its type hint."""
    if _is_optional(hint):
        return st.none() | value_strategy(_inner(hint))
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return st.lists(value_strategy(args[0]), max_size=4)
    if origin is tuple:
        return st.tuples(*(value_strategy(a) for a in args))
    if dataclasses.is_dataclass(hint):
        return message_strategy(hint)
    return {int: st.integers(INT_MIN, INT_MAX), bool: st.booleans(), str: TEXT,
            bytes: st.binary(max_size=64), float: st.floats(allow_nan=False)}[hint]


def message_strategy(cls) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{f.name: value_strategy(hints[f.name]) for f in dataclasses.fields(cls)})


def wrong_value(hint) -> st.SearchStrategy:
    """Values ``decode`` must refuse for a field of type ``hint`` (bools where ints go, and so on)."""
    if _is_optional(hint):
        return wrong_value(_inner(hint)).filter(lambda v: v is not None)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return SCALARS | st.dictionaries(TEXT, SCALARS, max_size=2)
    if origin is tuple:
        return SCALARS | st.lists(SCALARS, max_size=5).filter(lambda v: len(v) != len(args))
    if dataclasses.is_dataclass(hint):
        return SCALARS | st.lists(SCALARS, max_size=2)
    accepted = {int: (int,), bool: (bool,), str: (str,), bytes: (bytes,), float: (int, float)}[hint]

    def refused(v) -> bool:
        if hint in (int, float) and isinstance(v, bool):
            return True
        return not isinstance(v, accepted)

    return (SCALARS | st.lists(SCALARS, max_size=2)).filter(refused)


def plain(msg) -> dict:
    return msgpack.unpackb(wire.encode(msg), raw=False)


def decode_outcome(frame: bytes) -> wire.Message | ProtocolError:
    """The one promise about arbitrary input: a message, or ProtocolError, never anything else."""
    try:
        return wire.decode(frame)
    except ProtocolError as exc:
        return exc


def assert_kept(sent, kept, where: str = "") -> None:
    """``kept`` (a decoded message, encoded again) holds what was ``sent``: same values, same types
    (a bool is no int, an int no float), fields absent from ``sent`` being defaults."""
    if isinstance(kept, dict):
        assert isinstance(sent, dict), where
        assert set(sent) <= set(kept), (where, set(sent) - set(kept))  # unknown fields are refused
        for key in sent:
            assert_kept(sent[key], kept[key], f"{where}.{key}")
    elif isinstance(kept, list):
        assert isinstance(sent, list) and len(sent) == len(kept), where
        for i, (a, b) in enumerate(zip(sent, kept)):
            assert_kept(a, b, f"{where}[{i}]")
    else:
        assert type(sent) is type(kept) and sent == kept, (where, sent, kept)


def assert_decoded_faithfully(frame: bytes, outcome: wire.Message | ProtocolError) -> None:
    """A refusal says why; a message has the frame's kind and keeps every value the frame sent."""
    if isinstance(outcome, ProtocolError):
        assert str(outcome)
        return
    assert isinstance(outcome, wire.Message), type(outcome)
    sent = msgpack.unpackb(frame, raw=False)
    assert sent["v"] == wire.PROTOCOL_VERSION and sent["kind"] == outcome.KIND
    assert_kept(sent, msgpack.unpackb(wire.encode(outcome), raw=False))


def decodes_or_refuses(frame: bytes) -> None:
    assert_decoded_faithfully(frame, decode_outcome(frame))


@pytest.mark.parametrize("cls", KINDS, ids=lambda c: c.KIND)
@given(data=st.data())
def test_every_kind_round_trips(cls, data):
    msg = data.draw(message_strategy(cls))
    frame = wire.encode(msg)
    back = wire.decode(frame)
    assert back == msg
    assert type(back) is cls
    assert wire.encode(back) == frame
    body = msgpack.unpackb(frame, raw=False)
    assert body["v"] == wire.PROTOCOL_VERSION and body["kind"] == cls.KIND


def test_registry_covers_every_message_class():
    subclasses = {c for c in vars(wire).values()
                  if isinstance(c, type) and issubclass(c, wire.Message) and c is not wire.Message}
    assert subclasses == set(KINDS)
    assert len({c.KIND for c in KINDS}) == len(KINDS)


@given(st.binary(max_size=256))
def test_random_bytes_only_raise_protocol_error(frame):
    decodes_or_refuses(frame)


@given(ANY_VALUE)
def test_random_msgpack_values_only_raise_protocol_error(value):
    frame = msgpack.packb(value, use_bin_type=True)
    outcome = decode_outcome(frame)
    assert_decoded_faithfully(frame, outcome)
    if not isinstance(value, dict):
        assert isinstance(outcome, ProtocolError) and "must be a msgpack map" in str(outcome)


@given(kind=st.sampled_from([c.KIND for c in KINDS]), fields=st.dictionaries(TEXT, ANY_VALUE, max_size=6))
def test_random_maps_with_valid_envelope_only_raise_protocol_error(kind, fields):
    frame = msgpack.packb({**fields, "v": 1, "kind": kind}, use_bin_type=True)
    outcome = decode_outcome(frame)
    assert_decoded_faithfully(frame, outcome)
    if isinstance(outcome, ProtocolError):
        assert str(outcome).startswith(kind), outcome  # the envelope was valid: the kind's fields are named


@pytest.mark.parametrize("cls", KINDS, ids=lambda c: c.KIND)
@given(data=st.data())
def test_wrong_type_in_any_field_is_refused_naming_it(cls, data):
    body = plain(data.draw(message_strategy(cls)))
    hints = typing.get_type_hints(cls)
    name = data.draw(st.sampled_from([f.name for f in dataclasses.fields(cls)]))
    body[name] = data.draw(wrong_value(hints[name]))
    with pytest.raises(ProtocolError, match=f"{cls.KIND}.{name}"):
        wire.decode(msgpack.packb(body, use_bin_type=True))


@pytest.mark.parametrize("cls", KINDS, ids=lambda c: c.KIND)
@given(data=st.data())
def test_missing_required_field_is_refused_naming_it(cls, data):
    body = plain(data.draw(message_strategy(cls)))
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    name = data.draw(st.sampled_from(required))
    del body[name]
    with pytest.raises(ProtocolError, match=f"missing field '{name}'"):
        wire.decode(msgpack.packb(body, use_bin_type=True))


@pytest.mark.parametrize("cls", KINDS, ids=lambda c: c.KIND)
@given(data=st.data())
def test_extra_field_is_refused_naming_it(cls, data):
    body = plain(data.draw(message_strategy(cls)))
    extra = data.draw(st.from_regex(r"\Ax_[a-z]{1,8}\Z"))
    body[extra] = data.draw(ANY_VALUE)
    with pytest.raises(ProtocolError, match=f"unknown field.*{extra}"):
        wire.decode(msgpack.packb(body, use_bin_type=True))


def test_optional_field_with_default_may_be_absent():
    body = plain(wire.Error(reason="bad frame", room=7))
    del body["room"]
    assert wire.decode(msgpack.packb(body)) == wire.Error(reason="bad frame", room=None)


NESTED = {"regions": wire.Region, "aux": wire.AuxInfo}


@given(data=st.data())
def test_broken_nested_region_or_aux_is_refused_naming_the_path(data):
    reg = data.draw(message_strategy(wire.Register).filter(lambda r: r.regions))
    body = plain(reg)
    where = data.draw(st.sampled_from(["regions", "aux"]))
    target = body["regions"][data.draw(st.integers(0, len(reg.regions) - 1))] if where == "regions" else body["aux"]
    cls = NESTED[where]
    names = [f.name for f in dataclasses.fields(cls)]
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    how = data.draw(st.sampled_from(["missing", "extra", "wrong"]))
    if how == "missing":
        del target[data.draw(st.sampled_from(required))]
    elif how == "extra":
        target[data.draw(st.sampled_from(["v", "x", "key", "room"]))] = data.draw(SCALARS)
    else:
        name = data.draw(st.sampled_from(names))
        target[name] = data.draw(wrong_value(typing.get_type_hints(cls)[name]))
    with pytest.raises(ProtocolError, match=f"register.{where}"):
        wire.decode(msgpack.packb(body, use_bin_type=True))


REGION_V01_FIELDS = {"model", "layer", "kind", "mem", "device", "addr", "item_len", "num_pages", "head_start",
                     "num_heads"}


def _register(regions) -> wire.Register:
    return wire.Register(decode_id="d", agent_name="a", agent_metadata=b"m", model="m", page_size=16,
                         kv_dtype="bf16", tp_size=1, tp_rank=0, regions=regions,
                         aux=wire.AuxInfo(mem="DRAM", device=0, addr=0, item_len=32, num_slots=1))


def test_region_stride_travels_only_when_set():
    """A layer-major region (stride 0) is the 0.1 frame, field for field, so a 0.1 prefill reads it; a
    page-major one carries stride, which a 0.1 peer refuses by name instead of writing to wrong pages."""
    layer_major = wire.Region(model="target", layer=3, kind="v", mem="VRAM", device=0, addr=0x7F00_0000,
                              item_len=32768, num_pages=4096, head_start=0, num_heads=8)
    page_major = dataclasses.replace(layer_major, stride=64 * 32768)
    assert layer_major.stride == 0 and layer_major.page_stride == 32768 and page_major.page_stride == 64 * 32768
    body = plain(_register([layer_major, page_major]))
    assert set(body["regions"][0]) == REGION_V01_FIELDS
    assert body["regions"][1] == {**body["regions"][0], "stride": 64 * 32768}
    assert wire.decode(wire.encode(_register([layer_major, page_major]))).regions == [layer_major, page_major]
    body["regions"][1]["stride"] = True  # a bool is not the int 0 or 1
    with pytest.raises(ProtocolError, match=r"register.regions\[1\].stride: expected an int"):
        wire.decode(msgpack.packb(body))


def test_fields_holding_their_default_are_left_out_of_the_frame():
    assert "room" not in plain(wire.Error(reason="x")) and plain(wire.Error(reason="x", room=0))["room"] == 0
    for msg in (wire.Error(reason="x"), wire.Error(reason="x", room=5)):
        assert wire.decode(wire.encode(msg)) == msg


def test_register_regions_not_a_list_of_maps_is_refused():
    body = plain(wire.Register(decode_id="d", agent_name="a", agent_metadata=b"m", model="m", page_size=16,
                               kv_dtype="bf16", tp_size=1, tp_rank=0, regions=[],
                               aux=wire.AuxInfo(mem="DRAM", device=0, addr=0, item_len=32, num_slots=1)))
    for broken in ({"model": "target"}, [1, 2], "regions", [[1]]):
        body["regions"] = broken
        with pytest.raises(ProtocolError, match="register.regions"):
            wire.decode(msgpack.packb(body))


@pytest.mark.parametrize("field,value", [("room", True), ("room", 1.5), ("room", "7"), ("room", None),
                                         ("page_ids", [1, True]), ("page_ids", [1, 2.0]), ("aux_slot", False)])
def test_bools_floats_and_strings_are_not_ints(field, value):
    body = plain(wire.Transfer(room=1, decode_id="d", page_ids=[0, 1], aux_slot=0, num_prompt_tokens=20))
    body[field] = value
    with pytest.raises(ProtocolError, match=f"transfer.{field}"):
        wire.decode(msgpack.packb(body))


def test_register_ack_keys_decode_as_tuples_and_are_checked():
    ack = wire.RegisterAck(prefill_id="p", accepted=True, error=None, written=[("target", 0, "k")],
                           ignored=[("draft", 1, "v")], decode_only_spec_dec=True)
    assert wire.decode(wire.encode(ack)) == ack
    for bad in (["target", 0], ["target", "0", "k"], ["target", 0, "k", 1], "target layer 0 k"):
        body = plain(ack)
        body["written"] = [bad]
        with pytest.raises(ProtocolError, match=r"register_ack.written\[0\]"):
            wire.decode(msgpack.packb(body))


@pytest.mark.parametrize("version", [0, 2, -1, 1 << 40, "1", 1.0, True, None, [1]])
def test_unknown_version_is_refused_naming_it(version):
    frame = msgpack.packb({"v": version, "kind": "ping", "t": 0.0})
    with pytest.raises(ProtocolError, match="unsupported protocol version") as err:
        wire.decode(frame)
    assert repr(version) in str(err.value)


def test_missing_version_is_refused():
    with pytest.raises(ProtocolError, match="unsupported protocol version None"):
        wire.decode(msgpack.packb({"kind": "ping", "t": 0.0}))


@pytest.mark.parametrize("kind", ["bogus", "Register", "", 7, None, b"ping"])
def test_unknown_kind_is_refused_naming_it(kind):
    with pytest.raises(ProtocolError, match="unknown message kind") as err:
        wire.decode(msgpack.packb({"v": 1, "kind": kind, "t": 0.0}, use_bin_type=True))
    assert repr(kind) in str(err.value)


@pytest.mark.parametrize("value", [[1, 2], "text", 3, None, True, b"\x01"])
def test_frame_that_is_not_a_map_is_refused(value):
    with pytest.raises(ProtocolError, match="must be a msgpack map"):
        wire.decode(msgpack.packb(value, use_bin_type=True))


@pytest.mark.parametrize("frame", [b"", b"\xc1", b"\x81", b"\xdd\xff\xff\xff\xff", b"\x92\x01"])
def test_truncated_or_invalid_msgpack_is_refused(frame):
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        wire.decode(frame)


@pytest.mark.parametrize("frame", ["text", None, 12, [1]])
def test_non_bytes_frame_is_refused(frame):
    with pytest.raises(ProtocolError, match="frame must be bytes"):
        wire.decode(frame)


def test_frame_size_cap():
    big = wire.Register(decode_id="d", agent_name="a", agent_metadata=b"x" * (wire.MAX_FRAME_BYTES - 512),
                        model="m", page_size=16, kv_dtype="bf16", tp_size=1, tp_rank=0, regions=[],
                        aux=wire.AuxInfo(mem="DRAM", device=0, addr=0, item_len=32, num_slots=1))
    frame = wire.encode(big)
    assert len(frame) <= wire.MAX_FRAME_BYTES
    assert wire.decode(frame) == big
    with pytest.raises(ProtocolError, match=f"frame of {len(frame)} bytes exceeds the limit of 100 bytes"):
        wire.decode(frame, max_bytes=100)
    over = b"\x00" * (wire.MAX_FRAME_BYTES + 1)
    with pytest.raises(ProtocolError, match=f"exceeds the limit of {wire.MAX_FRAME_BYTES} bytes"):
        wire.decode(over)
    at_limit = wire.encode(wire.Ping(t=1.0))
    assert wire.decode(at_limit, max_bytes=len(at_limit)) == wire.Ping(t=1.0)

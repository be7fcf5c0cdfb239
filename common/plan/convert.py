"""KV dtype conversion in transit (issue 28): which pairs of KV dtypes a room may be converted
between, and what a converted room's runs hold. Pure: values in, values out.

A prefill and a decode whose pools hold different dtypes can be paired when the decode's dtype is
FP8 (e4m3) and the prefill's a wider float: the room travels in the decode's dtype. The prefill
gathers its pages, converts each element with the decode's scale of its region
(``stored = saturate(x / scale)``, the same rounding the decode's own K/V store uses), and WRITEs
the converted bytes, so the wire carries half (bf16) or a quarter (fp32) of the bytes::

    prefill pages (bf16) ──gather + convert──> prefill chunk buffer (e4m3) ──WRITE──> decode

From the chunk buffer the room goes into the decode's staging slot (one descriptor per chunk; the
decode scatters it byte for byte) or, when the decode offered no slot, straight into the decode's
pages (one descriptor per run). Never direct from the prefill's pages: those hold the other dtype.

Byte bookkeeping: a matched region pair holds the same elements on both sides, so the prefill's
``item_len`` is the decode's times ``ratio`` (prefill bytes per element over the decode's). The
stream (``common/plan/staging.py``) counts the decode's bytes; a segment's prefill runs are
``ratio`` times longer. A fused run (regions back to back in a page block, ``fuse_pairs``) holds
its member regions' items in turn, each with its own scale: ``run_scales`` lists them.

Nothing else converts: a pair of other dtypes is refused at registration naming both, and so is
an FP8 prefill feeding a wider decode (it would only widen rounded values), and a converting pair
of unequal TP sizes (the per-rank feed moves head slices directly).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.common.errors import GeometryMismatchError

# torch dtype names as pools report them (``KvCache.kv_dtype``) -> bytes per element
ELEM_NBYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
# (prefill dtype, decode dtype) pairs converted in transit
CONVERSIONS = frozenset((src, "float8_e4m3fn") for src in ("float32", "bfloat16", "float16"))


@dataclass(frozen=True, slots=True)
class Conversion:
    """A room converted from the prefill's ``src`` dtype to the decode's ``dst`` dtype."""

    src: str
    dst: str

    @property
    def ratio(self) -> int:
        """Prefill bytes per decode byte (per element: both sides hold the same elements)."""
        return ELEM_NBYTES[self.src] // ELEM_NBYTES[self.dst]


def conversion(prefill_dtype: str, decode_dtype: str) -> Conversion | None:
    """None for equal dtypes (bytes move as they are), the conversion for a pair in ``CONVERSIONS``;
    raises ``GeometryMismatchError`` naming both dtypes for any other pair."""
    if prefill_dtype == decode_dtype:
        return None
    if (prefill_dtype, decode_dtype) in CONVERSIONS:
        return Conversion(prefill_dtype, decode_dtype)
    known = ", ".join(f"{s} -> {d}" for s, d in sorted(CONVERSIONS))
    raise GeometryMismatchError(
        f"kv_dtype mismatch: prefill has {prefill_dtype!r}, decode has {decode_dtype!r}, and kvferry converts "
        f"only {known} in transit; start both sides with the same --kv-cache-dtype (and --dtype), or give the "
        f"decode --kv-cache-dtype fp8_e4m3")


def check_scale(scale: float, where: str) -> None:
    """A decode region's FP8 scale must be a positive finite number (it divides every element)."""
    if not (scale > 0.0 and scale != float("inf")):
        raise GeometryMismatchError(f"{where}: FP8 scale {scale!r} must be a positive finite number")

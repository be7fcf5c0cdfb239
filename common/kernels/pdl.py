"""Programmatic dependent launch (PDL) for the Triton kernels of a step.

A decode step is a few hundred small launches replayed from a CUDA graph; between two of them the
GPU drains one grid, then starts the next. On Hopper (sm_90+) a kernel launched with PDL may be
scheduled while the kernel before it in the stream is still running: its programs start, then wait
in ``griddepcontrol.wait`` until that kernel has finished and its writes are visible, so the
launch and the ramp of one grid overlap the tail of the other.

The rule that keeps this safe: every kernel launched with PDL calls ``enter(PDL)`` as its first
statement, in every program, before it reads or writes any tensor. ``enter`` waits for the kernel
before (and so, transitively, for everything before that), then lets the next kernel be scheduled.
Kernels launched without PDL (torch's, cuBLAS's) wait for their predecessor as usual.

``kw()`` is what a launch site adds: ``PDL=True`` (the kernel's constexpr) and ``launch_pdl=True``
(Triton's launch option) where PDL is on, nothing otherwise. It is on where the current CUDA device
is sm_90 or newer, Triton has the option, Triton's interpreter is not running, and neither
``set_enabled(False)`` (``--disable-pdl``) nor ``KVFERRY_PDL=0`` turned it off.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

_state: dict = {"enabled": None, "kw": None}  # enabled: None = decide on first use (available())


def available() -> bool:
    """Whether this process can launch with PDL: CUDA sm_90+, Triton's ``launch_pdl`` option and
    ``gdc_wait``, no interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("KVFERRY_PDL") == "0":
        return False
    try:
        import torch
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def set_enabled(flag: bool | None) -> bool:
    """Turns PDL on (where ``available()``), off, or back to the default (None); returns whether
    it is on. Graphs captured before keep the launches they were captured with."""
    _state["enabled"] = None if flag is None else bool(flag and available())
    _state["kw"] = None
    return enabled()


def enabled() -> bool:
    if _state["enabled"] is None:
        _state["enabled"] = available()
    return _state["enabled"]


def kw() -> dict:
    """The launch keywords: ``{"PDL": True, "launch_pdl": True}`` when PDL is on, else ``{}``."""
    if _state["kw"] is None:
        _state["kw"] = {"PDL": True, "launch_pdl": True} if enabled() else {}
    return _state["kw"]


@triton.jit
def enter(PDL: tl.constexpr):
    """A PDL-launched kernel's first statement: wait until the kernel before it has finished and its
    writes are visible, then let the kernel after it be scheduled (its programs wait the same way)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

"""Programmatic dependent launch (PDL) for the Triton kernels of a step.

A decode step is a few hundred small launches replayed from a CUDA graph; between two of them the
GPU drains one grid, then starts the next. On Hopper (sm_90+) a kernel launched with PDL may be
scheduled while the kernel before it in the stream is still running: its programs start, then wait
in ``griddepcontrol.wait`` until that kernel has finished and its writes are visible, so the
launch and the ramp of one grid overlap the tail of the other.

The rule that keeps this safe: every kernel launched with PDL waits (``griddepcontrol.wait``) for
the kernel before it has finished, and its writes are visible, before it reads or writes any tensor
another kernel makes or reads. Its first statement is ``enter(PDL)``, in every program; or, for a
weight-streaming GEMM whose weights no kernel writes, ``enter_prefetching(...)``, which may first
ask L2 for the program's first weight tiles. Since each kernel waits for the one before it, which
waited for its own, a kernel's wait covers everything before it in the stream. Kernels launched
without PDL (torch's, cuBLAS's) wait for their predecessor as usual.

Two orders (``PDL``, a constexpr; 0 is off):
- 1 (the default): wait, then let the next kernel be scheduled (``gdc_launch_dependents``): at
  most two grids are resident at once, the running one and the next, waiting;
- 2 (``set_enabled(True, early=True)``, for A/B runs: ``bench/engine.py --pdl-ab``): let the next
  kernel be scheduled first, then wait, and a GEMV asks L2 for its first weight tiles meanwhile.
  Still safe: a kernel finishes only after its own wait, so waiting for the kernel before covers
  every kernel before that. On an H100 it was slower than order 1 at FP8 batch 1 (3.86 against
  3.53 ms; bench/RESULTS.md, "Programmatic dependent launch").

``kw()`` is what a launch site adds: ``PDL`` and ``launch_pdl=True`` (Triton's launch option) where
PDL is on, nothing otherwise. It is on where the current CUDA device is sm_90 or newer, Triton has
the option, Triton's interpreter is not running, and neither ``set_enabled(False)``
(``--disable-pdl``) nor ``KVFERRY_PDL=0`` turned it off.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

_state: dict = {"enabled": None, "early": False, "kw": None}  # enabled None: decide on first use (available())


def available() -> bool:
    """Whether this process can launch with PDL: CUDA sm_90+, Triton's ``launch_pdl`` option and
    ``gdc_wait``, no interpreter, ``KVFERRY_PDL`` not 0."""
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


def set_enabled(flag: bool | None, early: bool = False) -> bool:
    """Turns PDL on (where ``available()``), off, or back to the default (None), in order 2
    (``early``) or 1; returns whether it is on. Graphs captured before keep their launches."""
    _state["enabled"] = None if flag is None else bool(flag and available())
    _state["early"] = early
    _state["kw"] = None
    return enabled()


def enabled() -> bool:
    if _state["enabled"] is None:
        _state["enabled"] = available()
    return _state["enabled"]


def mode() -> int:
    """The ``PDL`` constexpr launches get: 0 off, 1 wait first, 2 schedule the next kernel first."""
    return (2 if _state["early"] else 1) if enabled() else 0


def prefetching() -> bool:
    """Whether a GEMV asks L2 for weights before its wait (order 2)."""
    return mode() == 2


def kw() -> dict:
    """The launch keywords: ``{"PDL": mode(), "launch_pdl": True}`` when PDL is on, else ``{}``."""
    if _state["kw"] is None:
        _state["kw"] = {"PDL": mode(), "launch_pdl": True} if enabled() else {}
    return _state["kw"]


@triton.jit
def enter(PDL: tl.constexpr):
    """A PDL-launched kernel's first statement: wait until the kernel before it has finished and its
    writes are visible, and let the kernel after it be scheduled (its programs wait the same way)."""
    if PDL == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    elif PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _prefetch_l2(ptrs):
    """Asks L2 for the 128-byte lines at ``ptrs`` (no registers loaded, nothing waited for)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def enter_prefetching(PDL: tl.constexpr, w, stride_wn, N, K, K_PER, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      STEPS: tl.constexpr, LINE: tl.constexpr):
    """``enter`` for a GEMM streaming a weight [N, K] that no kernel writes: in order 2, after the
    next kernel is scheduled and before the wait, L2 is asked for this program's first ``STEPS``
    BLOCK_K-wide steps of its BLOCK_N rows (program 0 of axis 0 over N, axis 2 over K parts of
    K_PER), one prefetch per ``LINE`` elements (128 bytes), so the weight stream starts while the
    kernels before it finish."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        k_start = tl.program_id(2) * K_PER
        lines = tl.arange(0, BLOCK_K // LINE) * LINE
        for s in tl.static_range(STEPS):
            k = k_start + s * BLOCK_K + lines
            ok = (rows[:, None] < N) & (k[None, :] < tl.minimum(K, k_start + K_PER))
            _prefetch_l2(tl.where(ok, w + rows[:, None] * stride_wn + k[None, :], w))  # masked lines: w's first
        tl.extra.cuda.gdc_wait()
    else:
        enter(PDL)

"""Programmatic dependent launch (``common/kernels/pdl.py``): off where it cannot run, and the rule
that makes it safe holds in the source: a kernel launched with ``pdl_kw()`` waits for the kernel
before it (``pdl_enter(PDL)``) before it touches any tensor.

The GPU side (a step's logits with PDL equal those without, bit for bit) is ``tests/gpu/test_pdl.py``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvferry.common.kernels import pdl

KERNELS = Path(__file__).resolve().parents[2] / "common" / "kernels"


def test_off_on_cpu_and_under_the_interpreter():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: tests/gpu/test_pdl.py covers PDL on")
    # the CPU suite has no CUDA device (and tests/conftest.py sets TRITON_INTERPRET=1)
    assert not pdl.available()
    assert pdl.set_enabled(True) is False
    assert pdl.kw() == {}
    assert pdl.set_enabled(None) is False and pdl.kw() == {}


def test_env_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("KVFERRY_PDL", "0")
    assert not pdl.available()


def _jit_kernels(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    def jitted(fn: ast.FunctionDef) -> bool:
        for d in fn.decorator_list:
            target = d.func if isinstance(d, ast.Call) else d
            if isinstance(target, ast.Attribute) and target.attr == "jit":
                return True
        return False

    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and jitted(n)}


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        body = body[1:]
    return body[0]


ENTRIES = ("pdl_enter", "pdl_enter_prefetching")  # pdl.enter, and pdl.enter_prefetching for a weight-streaming GEMM


def _is_entry(stmt: ast.stmt) -> bool:
    """``pdl_enter(PDL)`` / ``pdl_enter_prefetching(PDL, ...)``, or an ``if`` on a constexpr whose
    branches each begin with one."""
    if isinstance(stmt, ast.If):
        return bool(stmt.orelse) and _is_entry(stmt.body[0]) and _is_entry(stmt.orelse[0])
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id in ENTRIES
            and isinstance(stmt.value.args[0], ast.Name) and stmt.value.args[0].id == "PDL")


def _enters_first(fn: ast.FunctionDef) -> bool:
    return _is_entry(_first_statement(fn))


def _pdl_launches(tree: ast.Module) -> list[tuple[str, int]]:
    """(kernel name, line) of every ``kernel[grid](..., **pdl_kw())``."""
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
            continue
        spread = [k.value for k in node.keywords if k.arg is None]
        if any(isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "pdl_kw" for v in spread):
            out.append((node.func.value.id if isinstance(node.func.value, ast.Name) else ast.unparse(node.func.value),
                        node.lineno))
    return out


def test_every_kernel_launched_with_pdl_waits_first():
    """A kernel launched with PDL may start while the kernel before it still runs: it must wait
    (``pdl_enter(PDL)``, its first statement, in every program) before reading or writing anything.
    Any kernel here launched with ``pdl_kw()`` that does not is a race on the GPU."""
    kernels: dict[str, ast.FunctionDef] = {}
    launches = []
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        kernels.update(_jit_kernels(tree))
        launches += [(name, f"{path.name}:{line}") for name, line in _pdl_launches(tree)]
    assert len(launches) >= 20, launches  # the step's kernels: norms, rope, attention, GEMV, MoE, MLA, quant
    for name, where in launches:
        assert name in kernels, f"{where}: {name} launched with pdl_kw() is not a @triton.jit kernel here"
        fn = kernels[name]
        params = [a.arg for a in fn.args.args]
        assert "PDL" in params, f"{where}: {name} launched with pdl_kw() takes no PDL constexpr"
        assert _enters_first(fn), f"{where}: {name} launched with pdl_kw() does not call pdl_enter(PDL) first"


def test_the_rule_check_catches_a_kernel_that_does_not_wait():
    src = '''
import triton
@triton.jit
def _k(x, PDL: tl.constexpr = False):
    """doc"""
    y = tl.load(x)
    pdl_enter(PDL)
def launch(x):
    _k[(1,)](x, **pdl_kw())
'''
    tree = ast.parse(src)
    fn = _jit_kernels(tree)["_k"]
    assert _pdl_launches(tree) == [("_k", 9)]
    assert not _enters_first(fn)
    branch = ast.parse("if E:\n    pdl_enter(PDL)\nelse:\n    y = tl.load(x)\n").body[0]
    assert not _is_entry(branch)  # a branch that touches memory before it waits
    assert _is_entry(ast.parse("if E:\n    pdl_enter(PDL)\nelse:\n    pdl_enter_prefetching(PDL, w)\n").body[0])


def test_prefetch_stays_within_its_budget(monkeypatch):
    from kvferry.common.kernels import triton_gemv

    assert triton_gemv.prefetch_steps(8, 1024, 4096, 1) == 0  # only in order 2 (off on CPU; order 1 by default)
    monkeypatch.setattr(triton_gemv, "pdl_prefetching", lambda: True)
    assert triton_gemv.prefetch_steps(8, 1024, 4096, 1) == 2  # FP8 qkv at one row: 16 KiB of its 32
    assert triton_gemv.prefetch_steps(64, 256, 3584, 1) == 1
    assert triton_gemv.prefetch_steps(64, 256, 256, 2) == 1  # at least one step
    assert triton_gemv.prefetch_steps(4, 1024, 1024, 1) == 1  # at most its part of K


def test_disable_pdl_flag_turns_it_off_here_and_for_tp_ranks(monkeypatch, tmp_path):
    from kvferry.common.daemon.flags import parse_config
    from kvferry.common.daemon.start import apply_kernel_options
    from kvferry.decode_worker.config import DecodeConfig

    monkeypatch.setenv("KVFERRY_PDL", "1")  # restored after the test, whatever apply_kernel_options sets
    config = parse_config(DecodeConfig, ["--model", str(tmp_path)], env={})
    assert config.disable_pdl is False
    apply_kernel_options(config)
    assert __import__("os").environ["KVFERRY_PDL"] == "1"
    config = parse_config(DecodeConfig, ["--model", str(tmp_path), "--disable-pdl"], env={})
    try:
        apply_kernel_options(config)
        assert __import__("os").environ["KVFERRY_PDL"] == "0"  # inherited by the TP worker processes
        assert not pdl.enabled() and pdl.kw() == {}
    finally:
        pdl.set_enabled(None)

"""The shape of the house, checked: imports go one way and form no circle (TYPE_CHECKING imports
included), the model side knows nothing of serving, every package says what it owns, and no
production file or class outgrows what one reader holds in their head."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "prefill_worker", "decode_worker")
MAX_FILE_LINES, MAX_CLASS_LINES = 400, 250
# The model side (what a new architecture, layer, kernel or cache structure touches) imports nothing
# of the serving side; the wire and the kernels sit below everything that uses them.
MODEL_SIDE = ("models", "layers", "kernels", "cache", "sampling", "text")
SERVING_SIDE = ("engine", "api", "daemon", "transport", "up", "up_model", "cli")
MAY_IMPORT = {"wire": ("wire", "errors"), "plan": ("plan", "wire", "errors"), "kernels": ("kernels", "plan", "errors")}


def _modules() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(("kvferry",) + path.relative_to(REPO).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Project modules the module ``name`` (at ``path``) imports, anywhere in it (functions and
    TYPE_CHECKING blocks too), relative imports resolved."""
    found = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            parts = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(parts + ([node.module] if node.module else []))
            subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in mods]
            found.update(subs or ([module] if module in mods else []))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in mods)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack, on_stack, out = [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_circle():
    mods = _modules()
    graph = {name: _imports(name, path, mods) - {name} for name, path in mods.items()}
    assert _cycles(graph) == []


def test_imports_go_one_way():
    mods = _modules()
    for name, path in mods.items():
        imported = _imports(name, path, mods)
        if name.startswith("kvferry.common"):
            assert not [m for m in imported if not m.startswith("kvferry.common")], f"{name} imports a worker"
        for worker, other in (("prefill_worker", "decode_worker"), ("decode_worker", "prefill_worker")):
            if name.startswith(f"kvferry.{worker}"):
                assert not [m for m in imported if m.startswith(f"kvferry.{other}")], f"{name} imports {other}"


def _under(name: str, packages: tuple[str, ...]) -> bool:
    """``name`` is one of ``common.<package>`` for ``packages``, or a module inside one."""
    return any(name == f"kvferry.common.{p}" or name.startswith(f"kvferry.common.{p}.") for p in packages)


def test_imports_go_down_the_layers():
    mods = _modules()
    wrong = []
    for name, path in mods.items():
        imported = _imports(name, path, mods)
        if _under(name, MODEL_SIDE):
            wrong += [f"{name} imports {m}" for m in imported if _under(m, SERVING_SIDE)]
        for package, allowed in MAY_IMPORT.items():
            if _under(name, (package,)):
                wrong += [f"{name} imports {m}" for m in imported if not _under(m, allowed)]
    assert wrong == []


def test_every_package_says_what_it_owns():
    """Each package of common/ has a README, and common/README.md's table names it (``name/``)."""
    table = (REPO / "common" / "README.md").read_text()
    packages = sorted(p.parent for p in (REPO / "common").glob("*/*.py"))
    missing = [f"{p.name}/" for p in set(packages) if f"`{p.name}/`" not in table]
    no_readme = [p.name for p in set(packages) if not (p / "README.md").is_file()]
    assert (sorted(missing), sorted(no_readme)) == ([], [])
    # ... and is installed: pyproject.toml lists every package under kvferry.
    listed = set(re.findall(r'^    "(kvferry[\w.]*)",$', (REPO / "pyproject.toml").read_text(), re.M))
    folders = {"kvferry", "kvferry.common", "kvferry.prefill_worker", "kvferry.decode_worker"}
    assert listed == folders | {f"kvferry.common.{p.name}" for p in packages}


def test_files_and_classes_stay_small():
    too_long = []
    for name, path in _modules().items():
        source = path.read_text()
        if len(source.splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []


def test_waits_go_through_the_cancel_safe_wait_for():
    """Every bounded wait of the daemons is ``common/daemon/aio.py::wait_for``: Python 3.11's
    ``asyncio.wait_for`` loses a cancel that comes with the awaited result (a poller it ran in
    outlived its ``close``)."""
    calls = []
    for name, path in _modules().items():
        if name == "kvferry.common.daemon.aio":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "wait_for" and \
                    isinstance(node.value, ast.Name) and node.value.id == "asyncio":
                calls.append(f"{name}:{node.lineno}")
    assert calls == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_import_finder_sees_type_checking_function_and_relative_imports(tmp_path):
    source = tmp_path / "a.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from kvferry.common.wire.messages import Message\n"
                      "def f():\n    import kvferry.common.errors\n"
                      "from . import rooms\nfrom .peers import PeerTable\n")
    mods = {m: source for m in ("kvferry.common.wire.messages", "kvferry.common.errors", "kvferry.common.wire.aux_slots", "kvferry.prefill_worker.rooms",
                                "kvferry.prefill_worker.peers")}
    assert _imports("kvferry.prefill_worker.a", source, mods) == {"kvferry.common.wire.messages", "kvferry.common.errors", "kvferry.prefill_worker.rooms",
                                                          "kvferry.prefill_worker.peers"}

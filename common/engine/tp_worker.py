"""Rank K (1..N-1) of a tensor-parallel engine; rank 0 (``tp_group.TpGroup``) starts it as::

    python -m kvferry.common.engine.tp_worker --rank K --tp-size N --init-method tcp://127.0.0.1:PORT \\
        --model DIR --device cpu --page-size 16 --num-pages 4096 ...

It joins the group (``joined/K`` in rank 0's store), loads its shard of the model and a KV pool of
its own KV heads (``loaded/K``), then runs the steps rank 0 sends: a ``StepHeader`` on stdin, then
for a forward the payload broadcast. It exits 0 on CLOSE or end of file on stdin (rank 0 closed
or exited), and 1 when anything fails (a collective whose peer died, a bad header), which closes
its sockets so that rank 0's step raises instead of waiting.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import sys

import torch

from kvferry.common.daemon import log
from kvferry.common.engine.tp_comm import TpComm, open_store, parse_init_method, rank_device
from kvferry.common.engine.tp_step import HEADER_BYTES, StepHeader, StepKind, decode_forward
from kvferry.common.cache.kv_cache import KV_LAYOUTS
from kvferry.common.cache.pool import KvPool
from kvferry.common.engine.factory import build_kv_cache
from kvferry.common.kernels.kv_quant import KV_CACHE_DTYPES
from kvferry.common.models.loader import load_model
from kvferry.common.transport.rank_agent import RankAgentServer

logger = logging.getLogger(__name__)

_POLL_S = 1.0  # each wait for rank 0's next step; the loop ends on end of file


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvferry.common.engine.tp_worker", description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--tp-size", type=int, required=True)
    p.add_argument("--init-method", required=True, help="tcp://HOST:PORT of rank 0's store")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu", help="rank 0's device; this rank runs on cuda:(N + rank)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--page-size", type=int, required=True)
    p.add_argument("--num-pages", type=int, required=True)
    p.add_argument("--kv-layout", default="page-major", choices=KV_LAYOUTS)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--num-threads", type=int, default=0)
    p.add_argument("--agent-endpoint", default="", help="rank 0's tcp://HOST:PORT for this rank's NIXL agent")
    p.add_argument("--agent-prefix", default="tp", help="this rank's NIXL agent name prefix")
    return p.parse_args(argv)


def read_header(fd: int, parent_pid: int, poll_s: float = _POLL_S) -> StepHeader | None:
    """The next header from ``fd``; None at end of file or once this process has another parent
    than ``parent_pid`` (rank 0 is gone, even if a process it forked still holds the pipe open)."""
    data = b""
    while len(data) < HEADER_BYTES:
        ready, _, _ = select.select([fd], [], [], poll_s)
        if not ready:
            if os.getppid() != parent_pid:
                return None
            continue  # rank 0 is idle
        more = os.read(fd, HEADER_BYTES - len(data))
        if not more:
            return None
        data += more
    return StepHeader.decode(data)


def serve(fd: int, comm: TpComm, model, kv: KvPool, parent_pid: int) -> int:
    """Run rank 0's steps until CLOSE or end of file; returns the number of steps run."""
    num_steps = 0
    while True:
        header = read_header(fd, parent_pid)
        if header is None or header.kind == StepKind.CLOSE:
            return num_steps
        if header.kind == StepKind.FORWARD:
            payload = torch.empty(header.payload_len, dtype=torch.int64, device=comm.device)
            chunks = decode_forward(header, comm.broadcast(payload).cpu().numpy())
            model.forward(chunks, kv)
        elif header.kind == StepKind.COPY_PAGE:
            kv.copy_page(header.src_page, header.dst_page)
        num_steps += 1


def main(argv: list[str] | None = None) -> int:
    parent_pid = os.getppid()  # rank 0, which started this process
    args = parse_args(argv)
    log.configure("info")
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    rank, device = args.rank, rank_device(args.device, args.rank)
    try:
        host, port = parse_init_method(args.init_method)
        store = open_store(host, port, args.tp_size, is_master=False, timeout_s=args.timeout_s)
        store.set(f"joined/{rank}", "1")
        comm = TpComm(store, host, rank, args.tp_size, device, args.timeout_s)
        model = load_model(args.model, dtype=args.dtype, device=device, tp_size=args.tp_size, tp_rank=rank)
        model.set_attention_backend(args.attention_backend)
        model.attach_tp(comm.all_reduce)
        heads = model.shard.kv_heads
        kv = build_kv_cache(model, args.model, args.kv_cache_dtype, args.num_pages, args.page_size, device,
                            layout=args.kv_layout, head_start=heads.start, num_kv_heads=heads.count)
        agent = None
        if args.agent_endpoint:  # this rank's KV pool, registered with its own NIXL agent
            agent = RankAgentServer(rank, args.agent_endpoint, args.agent_prefix, kv.buffer)
            agent.start(kv.regions())
        store.set(f"loaded/{rank}", "1")
        logger.info("TP worker ready tp_rank=%d tp_size=%d device=%s kv_heads=%d..%d", rank, args.tp_size, device,
                    heads.start, heads.stop - 1)
        num_steps = serve(sys.stdin.fileno(), comm, model, kv, parent_pid)
        if agent is not None:
            agent.stop()
    except Exception:
        logger.exception("TP worker failed tp_rank=%d tp_size=%d", rank, args.tp_size)
        # Exit now, not after the interpreter's teardown: the sockets close at once, so rank 0's
        # step raises and finds this exit code instead of waiting for its collective's timeout.
        logging.shutdown()
        os._exit(1)
    comm.close()
    logger.info("TP worker exits tp_rank=%d steps=%d", rank, num_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Runs per room after churn: the decode's PageAllocator (best fit over free runs) against the
lowest-ids-first allocator it replaced, on the same random history (bench/transfer.py's churned case:
rooms of 1..n pages come and go at random, the pool kept at most three quarters full, then one n-page
room). Both allocators see the same sizes and frees: the decisions depend only on counts of free pages.
One JSON line per (n, steps): runs of the final room (mean, max over --seeds) and runs per room over
the whole history (mean, max). Fewer runs = fewer NIXL descriptors (and fewer rooms to stage)."""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, git_hash  # noqa: E402
from kvferry.common.cache.kv_cache import PageAllocator  # noqa: E402


class LowestFirst:
    """The allocator before best fit: a heap of free ids, lowest first."""

    def __init__(self, num_pages: int) -> None:
        self.heap = list(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self.heap)

    def allocate(self, n: int) -> list[int]:
        return [heapq.heappop(self.heap) for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        for p in pages:
            heapq.heappush(self.heap, p)


def num_runs(pages: list[int]) -> int:
    return 1 + sum(b != a + 1 for a, b in zip(pages, pages[1:])) if pages else 0


def churn(alloc, num_pages: int, n: int, seed: int, steps: int) -> tuple[int, list[int]]:
    rng, live, history = random.Random(seed), [], []
    for _ in range(steps):
        size = rng.randint(1, n)
        if live and (rng.random() < 0.5 or alloc.num_free - size < num_pages // 4):
            alloc.free(live.pop(rng.randrange(len(live))))
        elif alloc.num_free - size >= num_pages // 4:
            live.append(alloc.allocate(size))
            history.append(num_runs(live[-1]))
    while alloc.num_free < n:
        alloc.free(live.pop(rng.randrange(len(live))))
    return num_runs(alloc.allocate(n)), history


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", default="64,256,1024", help="room sizes n (pool: 4n pages), comma-separated")
    ap.add_argument("--steps", default="400,4000", help="churn steps, comma-separated")
    ap.add_argument("--seeds", type=int, default=20)
    args = ap.parse_args()
    for n in (int(p) for p in args.pages.split(",")):
        for steps in (int(s) for s in args.steps.split(",")):
            record = {"bench": "alloc_churn", "pages": n, "pool_pages": 4 * n, "steps": steps, "seeds": args.seeds}
            for name, cls in (("lowest_first", LowestFirst), ("best_fit", PageAllocator)):
                runs = [churn(cls(4 * n), 4 * n, n, seed, steps) for seed in range(args.seeds)]
                history = [r for _, h in runs for r in h]
                record |= {f"{name}_final_runs_mean": round(statistics.mean(f for f, _ in runs), 2),
                           f"{name}_final_runs_max": max(f for f, _ in runs),
                           f"{name}_runs_per_room_mean": round(statistics.mean(history), 3),
                           f"{name}_runs_per_room_max": max(history)}
            emit(record | {"git": git_hash()})


if __name__ == "__main__":
    main()

"""The router a stock-vLLM composition runs beside its servers (routing_vs_vllm.py `--charge-router`).

R2R, CITER and Co-LLM decide from the small model's hidden state, which a stock server does not return; a composition
of stock servers therefore runs the algorithm's router itself after every small-model token, then asks the next
server. The decisions the baseline replays are the reference router's (routing_decisions.py); this module charges
their compute: one worker process, pinned to the small model's core with one thread (where the runtime runs the
same router, inside the small model's sub-server step), runs the algorithm's own code (`prepare_step` + `signal`,
the runtime's path: R2R's ~50M-parameter router over the hidden state, the sampled token's embedding and the top-100
logits) on rows of the small model's shapes. Rows that arrive while a batch runs are taken together in the next one
(the batching a single client process driving every request could do: generous to the baseline); a composition of
independent clients would pay one row per call.

Worker protocol (JSON lines, no pickle): the driver writes `{"id": n}` per row; the worker answers `@@DONE n` after
the batch holding that row ran; `@@READY` once the router is built and warmed.

  python benchmarks/peers/router_charge.py --worker --alg r2r --kwargs '{...}' --hidden 576 --vocab 49152
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import sys
import time
from pathlib import Path
from typing import Any

import line_worker

ROOT = Path(__file__).resolve().parents[2]
CHARGED = ("r2r", "citer", "co_llm")
POOL = 64                                 # rows per router batch at most (the runtime's largest step here)      # hidden-state routers; R-Stitch's entropy comes with the streamed logprobs


class RouterCharge:
    """Driver side: `await charge()` returns once the worker ran the router on one more row."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.waiting: dict[int, asyncio.Future] = {}
        self.next_id = 0
        self.rows = 0
        self.batches = 0
        self.reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def start(cls, alg: str, kwargs: dict[str, Any], hidden: int, vocab: int, core: int,
                    log: Path) -> RouterCharge:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        proc, _ = await line_worker.start(
            ["taskset", "-c", str(core), sys.executable, __file__, "--worker", "--alg", alg,
             "--kwargs", json.dumps(kwargs), "--hidden", str(hidden), "--vocab", str(vocab)], env, log, "router worker")
        return cls(proc)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while True:
            line = (await self.proc.stdout.readline()).decode()
            if not line:
                for fut in self.waiting.values():
                    if not fut.done():
                        fut.set_exception(RuntimeError("the router worker exited"))
                return
            if line.startswith("@@BATCH "):
                self.batches += 1
                self.rows += int(line.split()[1])
            elif line.startswith("@@DONE "):
                fut = self.waiting.pop(int(line.split()[1]), None)
                if fut is not None:
                    fut.set_result(None)

    async def charge(self) -> None:
        assert self.proc.stdin is not None
        n = self.next_id
        self.next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self.waiting[n] = fut
        self.proc.stdin.write((json.dumps({"id": n}) + "\n").encode())
        await fut

    async def close(self) -> None:
        await line_worker.stop(self.proc, self.reader)


def worker(args: argparse.Namespace) -> None:
    import torch

    from tokenplane.route.algorithms import make_algorithm
    from tokenplane.route.api import StepResult

    torch.set_num_threads(1)
    kwargs = json.loads(args.kwargs)
    kwargs.pop("algorithm", None)
    alg = make_algorithm(args.alg, **kwargs)
    gate = alg.gates[0]
    gen = torch.Generator().manual_seed(0)

    # rows of the small model's shapes, made once (the runtime's rows come from the step at no extra cost)
    pool = [StepResult(f"charge-{k}", 0, 0, int(torch.randint(0, args.vocab, (1,), generator=gen)),
                       torch.randn(args.vocab, generator=gen), torch.randn(args.hidden, generator=gen))
            for k in range(POOL)]

    def run(n: int) -> None:
        for lo in range(0, n, POOL):
            rows = pool[:min(POOL, n - lo)]
            prepare = getattr(alg, "prepare_step", None)
            if prepare is not None:
                prepare(rows)
            for r in rows:
                alg.signal(gate, r)

    for n in (1, 2, 4):     # build the router, warm the one-row and batched paths
        run(n)
    out = sys.stdout
    out.write("@@READY\n")
    out.flush()
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return
            buf += chunk
        while select.select([0], [], [], 0)[0]:       # every row already waiting joins this batch
            chunk = os.read(0, 1 << 16)
            if not chunk:
                break
            buf += chunk
        *lines, buf = buf.split(b"\n")
        ids = [json.loads(line)["id"] for line in lines if line.strip()]
        t0 = time.perf_counter()
        run(len(ids))
        out.write(f"@@BATCH {len(ids)} {time.perf_counter() - t0:.6f}\n")
        out.write("".join(f"@@DONE {i}\n" for i in ids))
        out.flush()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--alg", required=True)
    ap.add_argument("--kwargs", default="{}")
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--vocab", type=int, required=True)
    worker(ap.parse_args())

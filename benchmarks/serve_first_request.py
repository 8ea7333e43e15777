"""A server's start-up and first requests, as users start it: `tokenplane serve` (the default config: SmolLM2-135M-
Instruct through one sub-server) from a given commit, /health polled until 200, then two chat completions.

Each commit is extracted with `git archive` into a fresh folder, so its first start finds no numba cache next to the
sources (a fresh install); the same folder is then started again (`cached`: numba's disk cache from the first start).
What it shows: where the compile of the engine's CPU kernels lands (since `ModelRunner.warm_kernels`: in the start-up,
before /health answers 200; before: on the first requests). Commits alternate in order from repeat to repeat.

    flock /tmp/bench.lock python benchmarks/serve_first_request.py --revs a640b23 HEAD --repeats 2

Writes benchmarks/results/serve_first_request.{json,md,png} (--out PREFIX to change).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_files import write_record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHAT = {"model": "smollm2-135m-instruct", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence, then list "
                                                 "three more European capitals with one fact each."}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def extract(rev: str, root: Path) -> Path:
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    tree = Path(tempfile.mkdtemp(prefix=f"serve-{sha}-", dir=root))
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def start_and_ask(tree: Path, timeout_s: float) -> dict:
    """Seconds to /health 200 from the process start, then each chat's latency (and its answer's text)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(tree))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tokenplane.cli", "serve", "--port", str(port)], cwd=tree, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=timeout_s) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
                if time.perf_counter() - t0 > timeout_s:
                    raise TimeoutError(f"not ready after {timeout_s} s")
                try:
                    if client.get(base + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            ready = time.perf_counter() - t0
            chats, text = [], ""
            for _ in range(2):
                t = time.perf_counter()
                r = client.post(base + "/v1/chat/completions", json=CHAT)
                r.raise_for_status()
                chats.append(time.perf_counter() - t)
                text = r.json()["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"ready_s": ready, "first_chat_s": chats[0], "second_chat_s": chats[1], "answer": text}


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# `tokenplane serve`: start-up and first requests ({meta['date']})", "",
             f"Command: `{meta['command']}`  ", f"{meta['machine']}; load average {meta['load_before']} -> "
             f"{meta['load_after']}; {meta['repeats']} repeats, commits alternated; medians (min-max).", "",
             "fresh = a new `git archive` of the commit (no numba cache next to its sources); cached = the same folder "
             "started again. ready = process start to /health 200; chats: two chat completions of 8 tokens.", "",
             "| commit | start | ready s | first chat s | second chat s | answer |", "|---|---|---:|---:|---:|---|"]

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"
    for r in rows:
        lines.append(f"| {r['rev']} | {r['start']} | {cell(r['ready_s'])} | {cell(r['first_chat_s'])} | "
                     f"{cell(r['second_chat_s'])} | {r['answer'][:40]!r} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    labels = [f"{r['rev']}\n{r['start']}" for r in rows]
    ready = [statistics.median(r["ready_s"]) for r in rows]
    first = [statistics.median(r["first_chat_s"]) for r in rows]
    ax.bar(labels, ready, label="start-up to /health 200")
    ax.bar(labels, first, bottom=ready, label="first chat completion")
    ax.set_ylabel("seconds (median)")
    ax.set_title("tokenplane serve: where the kernels' compilation lands")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--revs", nargs="+", default=["HEAD"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve_first_request"))
    args = ap.parse_args()
    meta = {"command": "python benchmarks/serve_first_request.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "repeats": args.repeats,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "load_before": os.getloadavg()[0]}
    samples: dict[tuple[str, str], list[dict]] = {}
    work = Path(tempfile.mkdtemp(prefix="serve-first-"))
    try:
        for rep in range(args.repeats):
            for rev in (args.revs if rep % 2 == 0 else list(reversed(args.revs))):
                tree = extract(rev, work)
                for start in ("fresh", "cached"):
                    res = start_and_ask(tree, args.timeout)
                    samples.setdefault((rev, start), []).append(res)
                    print(f"{rev} {start}: ready {res['ready_s']:.2f} s, chats {res['first_chat_s']:.2f} / "
                          f"{res['second_chat_s']:.2f} s", flush=True)
                shutil.rmtree(tree, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    meta["load_after"] = os.getloadavg()[0]
    rows = [{"rev": rev, "start": start, "answer": s[-1]["answer"],
             **{k: [x[k] for x in s] for k in ("ready_s", "first_chat_s", "second_chat_s")}}
            for (rev, start), s in samples.items()]
    print(write_record(Path(args.out), meta, rows, markdown, plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

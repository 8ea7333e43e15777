"""vLLM's own time for a long cached prompt given as token IDs: its HTTP server (`--skip-tokenizer-init`, the prompt
as a JSON array on /v1/completions), its gRPC engine service (`launchers.grpc_server`, packed varints), or (`--mode
session`) tokenplane's session middleware in the HTTP server (serve/vllm_plugin: one live request, each turn sends
only its new IDs), one after the other on the same files. A first request prefills N random IDs; then each turn appends 400 new IDs and is timed to
its first answer (max_tokens 4, greedy), after a 1.2 s idle gap (vLLM's CPU worker busy-loops 1 s after each
message). With --py-spy the server's processes are sampled during the turns (`py-spy record --subprocesses -f raw`)
and the top frames are printed.

    flock /tmp/bench.lock /work/peers/vllm-cpu/bin/python benchmarks/peers/vllm_id_floor.py --mode grpc --tokens 334000

Runs in the vLLM venv (it needs grpcio and smg-grpc-proto, which the peers build installs)."""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/tokenplane-peer-models/tiny-qwen3-long-sw4096")
    ap.add_argument("--mode", choices=["http", "grpc", "session"], required=True)
    ap.add_argument("--tokens", type=int, default=334_000)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--core", default="0")
    ap.add_argument("--py-spy", default=None, metavar="RAW_OUT")
    args = ap.parse_args()
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_NUM_OF_RESERVED_CPU="0", OMP_NUM_THREADS="1",
               VLLM_LOGGING_LEVEL="WARNING", VLLM_CPU_OMP_THREADS_BIND=args.core, TOKENIZERS_PARALLELISM="false")
    common = ["--model", args.model, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
              "--block-size", "32", "--max-model-len", str(args.tokens + 20_000), "--max-num-batched-tokens", "8192",
              "--max-num-seqs", "8", "--enforce-eager", "--enable-prefix-caching", "--disable-log-stats", "--seed",
              "0", "--served-model-name", "m"]
    if args.mode == "grpc":
        cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.grpc_server", *common]
    else:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *common, "--skip-tokenizer-init",
               "--uvicorn-log-level", "warning"]
    if args.mode == "session":
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "tokenplane" / "serve" / "vllm_plugin")
        cmd += ["--middleware", "tokenplane_vllm_sessions.session_turns"]
    proc = subprocess.Popen(cmd, stdout=open(f"/tmp/vllm_id_floor_{args.mode}.log", "w"), stderr=subprocess.STDOUT,
                            env=env, cwd="/tmp", start_new_session=True)
    rng = np.random.default_rng(0)
    try:
        if args.mode == "grpc":
            import grpc
            from smg_grpc_proto import vllm_engine_pb2 as pb
            ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)])
            generate = ch.unary_stream("/vllm.grpc.engine.VllmEngine/Generate",
                                       response_deserializer=pb.GenerateResponse.FromString)

            def first(ids: list[int]) -> float:
                req = pb.GenerateRequest(request_id=uuid.uuid4().hex, tokenized=pb.TokenizedInput(input_ids=ids),
                                         sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=4),
                                         stream=True).SerializeToString()
                t0, got = time.perf_counter(), None
                for _ in generate(req, timeout=900):
                    got = got or time.perf_counter() - t0
                return got or 0.0
            up = lambda: first([1, 2, 3]) >= 0   # noqa: E731
        elif args.mode == "session":
            client = httpx.Client(timeout=900)
            held = {"context": 0, "sent": 0}

            def first(ids: list[int]) -> float:   # the IDs past what the session was sent
                new = ids[held["sent"]:]
                body = {"model": "m", "prompt": new, "max_tokens": 4, "temperature": 0,
                        "tokenplane_session": {"id": "floor", "context": held["context"]}}
                t0, got = time.perf_counter(), None
                with client.stream("POST", f"http://127.0.0.1:{port}/tokenplane/v1/session_completions",
                                   json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            got = got or time.perf_counter() - t0
                            report = json.loads(line[6:]).get("tokenplane_session")
                            if report:
                                held["context"] = report["context"]
                held["sent"] = len(ids)
                return got or 0.0
            up = lambda: client.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200   # noqa: E731
        else:
            client = httpx.Client(timeout=900)

            def first(ids: list[int]) -> float:
                body = {"model": "m", "prompt": ids, "max_tokens": 4, "temperature": 0, "stream": True}
                t0, got = time.perf_counter(), None
                with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            got = got or time.perf_counter() - t0
                return got or 0.0
            up = lambda: client.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200   # noqa: E731
        deadline = time.monotonic() + 600
        while True:
            try:
                if up():
                    break
            except Exception:   # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("vLLM did not come up")
            time.sleep(1)
        ctx = rng.integers(1000, 100_000, args.tokens).tolist()
        print(f"{args.mode}: first (uncached) {first(ctx):.2f} s", flush=True)
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(proc.pid), "--subprocesses", "-r", "200", "-f",
                                "raw", "-o", args.py_spy, "-d", str(int(args.turns * 1.6) + 2), "--nonblocking"]) \
            if args.py_spy else None
        times = []
        for _ in range(args.turns):
            time.sleep(1.2)
            ctx += rng.integers(1000, 100_000, 400).tolist()
            times.append(first(ctx) * 1e3)
        print(f"{args.mode} {args.tokens} cached + 400 new: TTFT P50 {statistics.median(times):.1f} ms "
              f"(turns: {', '.join(f'{t:.0f}' for t in times)}); load {os.getloadavg()[0]:.2f}", flush=True)
        if spy is not None:
            spy.wait()
            frames: collections.Counter[str] = collections.Counter()
            for line in open(args.py_spy):
                stack, n = line.rstrip().rsplit(" ", 1)
                for f in set(stack.split(";")[1:]):
                    if any(k in f for k in ("Request.", "Decoder.decode", "validate_token_ids", "Generate",
                                            "execute_model", "process_inputs", "hash", "schedule",
                                            "session", "computed_blocks", "allocate", "NewRequestData")):
                        frames[f[:110]] += int(n)
            for f, n in frames.most_common(12):
                print(f"{n / 200 / args.turns * 1e3:7.1f} ms/turn  {f}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

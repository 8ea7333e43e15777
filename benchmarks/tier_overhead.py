"""The tokenization tier's own added latency per turn, isolated from any engine.

An upstream stub (this script with --stub: an OpenAI-shaped /v1/completions that parses the JSON body, as vLLM's
front end does, and streams one chunk at once) stands in for the engine, so what remains is the tier. The stub parses
with orjson and runs on uvicorn's pure-Python stack (h11, asyncio loop) whatever is installed: its own time is in both
arms of the difference below, and a stdlib parse of a 4M-character context's 8 MB body (~100-150 ms, varying by tens
of ms with the machine's load) buried the tier's few ms in noise. Per turn:
  tier:   the chat (text) to `tokenplane serve --upstream stub`, which renders, repairs the conversation's session and
          forwards token IDs to the stub;
  direct: the very bytes the tier forwarded (the stub keeps the last body it received), sent straight to the stub.
tier added = TTFT(tier) - TTFT(direct), paired per turn: the tier's receive + parse + render + tokenize + serialize +
extra hop + relay. Both request bodies are serialized before the clock starts (the client's JSON encoder is neither
side's cost). Where a tier reports its phases (`tokenization.phases_ms` on the final usage chunk), their P50s are
written too: receive (body in), prepare (parse + validate + render + repair + upstream body), upstream (the upstream
hop to its first chunk: the stub's own time is in it), relay (that chunk out to the server).

Workloads: real mini-swe-agent trajectories (tests/fixtures/traces; each call's prompt = every message before it) and
synthetic conversations of real text grown to 100K / 1M / 4M characters in a first (unmeasured) turn, then appended
with sizes from real Claude Code request shapes (../shared/data/traces/claude-code-shapes.jsonl when present).

    python benchmarks/tier_overhead.py [--sizes 100000 1000000 4000000] [--turns 8] [--trajectories 4]
        [--out PREFIX] [--baseline-tree DIR]

--grpc puts a gRPC stub (vLLM's engine service, smg vllm_engine.proto: GetModelInfo and a streamed Generate that
parses the request with the official classes, as vLLM's servicer does, and answers one token) in the stub's place,
the tier in front of it with `--upstream grpc://...`; direct = the very request bytes the tier sent, as a Generate
call from this process (a kept channel).

--sessions gives the stub the session route of tokenplane's vLLM middleware (serve/vllm_plugin: a stateless stand-in
that parses the body and reports the session's new context as the middleware would for a one-token answer) and
starts the tier with --upstream-sessions: each turn then forwards only the IDs the upstream session lacks, and direct
sends those same bytes to the route.

--null-proxy also times a pass-through proxy on the tier's own HTTP stack (uvicorn as `tokenplane serve` runs it,
the tier's HTTP client or a grpc.aio channel upstream): it reads the chat request's body whole, sends the bytes the
tier forwarded for that turn (handed to it before the clock starts) to the stub, and relays the answer. It renders,
parses and tokenizes nothing, so `null added` is what receiving the client's bytes and one more hop cost on this
stack, a floor under any proxy's added latency; tier added - null added is the tier's own work.

--baseline-tree runs a second tier from another checkout (cells prefixed "baseline"), every turn measured on both,
alternating which goes first: a change and its baseline side by side under the same load.

Writes benchmarks/results/tier_overhead.{json,md,png}. Target (the tier issue): added latency P50 < 2 ms at every size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))

from serve_agent import append_sizes, load_trajectories, real_text  # noqa: E402

STUB_MODEL = "stub"
SESSION_PATH = "/tokenplane/v1/session_completions"   # serve/upstream_sessions.PATH
PHASES = ("receive_ms", "prepare_ms", "upstream_ms", "relay_ms")


# -- the upstream stub --------------------------------------------------------------------------------------------
def run_stub(port: int) -> None:
    import orjson
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    last: dict[str, bytes] = {"body": b""}

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": STUB_MODEL, "object": "model",
                                                         "max_model_len": 1 << 24}]})

    def chunk(choices: list[Any], **extra: Any) -> str:
        return "data: " + json.dumps({"id": "cmpl-stub", "object": "text_completion", "created": 0,
                                      "model": STUB_MODEL, "choices": choices, **extra}) + "\n\n"

    async def completions(request: Request) -> StreamingResponse:
        raw = await request.body()
        last["body"] = raw
        n = len(orjson.loads(raw)["prompt"])

        async def gen() -> Any:
            yield chunk([{"index": 0, "text": "ok", "finish_reason": "length"}])
            yield chunk([], usage={"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1})
            yield "data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    async def last_body(request: Request) -> Response:
        return Response(last["body"], media_type="application/json")

    async def session_turn(request: Request) -> StreamingResponse:
        raw = await request.body()
        last["body"] = raw
        body = orjson.loads(raw)
        n, spec = len(body["prompt"]), body["tokenplane_session"]
        report = {"id": spec["id"], "context": spec["context"] + n, "kept": []}   # one answer token: none kept

        async def gen() -> Any:
            yield chunk([{"index": 0, "text": "", "token_ids": [1035], "finish_reason": "length"}])
            yield chunk([], usage={"prompt_tokens": report["context"], "completion_tokens": 1,
                               "total_tokens": report["context"] + 1}, tokenplane_session=report)
            yield "data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"]),
                            Route(SESSION_PATH, session_turn, methods=["POST"]), Route("/last", last_body)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop="asyncio", http="h11")


def run_grpc_stub(port: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from smg_grpc_proto import vllm_engine_pb2 as pb

    last: dict[str, bytes] = {"body": b""}

    def generate(raw: bytes, context: Any) -> Any:
        last["body"] = raw
        n = len(pb.GenerateRequest.FromString(raw).tokenized.input_ids)
        yield pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[9], prompt_tokens=n, completion_tokens=1))
        yield pb.GenerateResponse(complete=pb.GenerateComplete(output_ids=[9], finish_reason="length",
                                                               prompt_tokens=n, completion_tokens=1))

    def model_info(raw: bytes, context: Any) -> bytes:
        return pb.GetModelInfoResponse(served_model_name=STUB_MODEL, max_context_length=1 << 24).SerializeToString()

    def last_body(raw: bytes, context: Any) -> bytes:
        return last["body"]

    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=[("grpc.max_receive_message_length", -1),
                                                                     ("grpc.max_send_message_length", -1)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("vllm.grpc.engine.VllmEngine", {
        "Generate": grpc.unary_stream_rpc_method_handler(
            generate, response_serializer=pb.GenerateResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(model_info),
        "Last": grpc.unary_unary_rpc_method_handler(last_body)})])
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def run_null_proxy(port: int, upstream: str, path: str = "/v1/completions") -> None:
    """A proxy that does no work of its own (see --null-proxy): PUT /next sets the upstream bytes of the next chat."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    from tokenplane.serve.http_client import HTTPClient

    nxt: dict[str, bytes] = {"body": b""}
    client = HTTPClient()
    channel: Any = None

    async def put_next(request: Request) -> Response:
        nxt["body"] = await request.body()
        return Response(b"")

    async def health(request: Request) -> Response:
        return Response(b"ok")

    async def chat(request: Request) -> StreamingResponse:
        nonlocal channel
        await request.body()
        if upstream.startswith("grpc://"):
            import grpc.aio
            if channel is None:
                channel = grpc.aio.insecure_channel(upstream.removeprefix("grpc://"), options=[
                    ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
            call = channel.unary_stream("/vllm.grpc.engine.VllmEngine/Generate")(nxt["body"])

            async def relay_grpc() -> Any:
                async for _ in call:
                    yield b'data: {"choices": [{"index": 0, "delta": {"content": "ok"}}]}\n\n'
                yield b"data: [DONE]\n\n"
            return StreamingResponse(relay_grpc(), media_type="text/event-stream")
        resp = await client.request("POST", upstream + path, nxt["body"])

        async def relay() -> Any:
            async for data in resp.chunks():
                yield data
            await resp.aclose()
        return StreamingResponse(relay(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/next", put_next, methods=["PUT"]), Route("/health", health),
                            Route("/v1/chat/completions", chat, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


class GrpcStub:
    """This process's side of the gRPC stub: the last request the tier sent, and the same bytes as a timed call."""

    def __init__(self, port: int) -> None:
        import grpc
        self.grpc = grpc
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", -1),
                                                                          ("grpc.max_send_message_length", -1)])
        self.generate = self.channel.unary_stream("/vllm.grpc.engine.VllmEngine/Generate")
        self.last = self.channel.unary_unary("/vllm.grpc.engine.VllmEngine/Last")

    def ready(self) -> bool:
        try:
            self.channel.unary_unary("/vllm.grpc.engine.VllmEngine/GetModelInfo")(b"", timeout=2)
            return True
        except self.grpc.RpcError:
            return False

    def ttft(self, raw: bytes) -> float:
        t0 = time.perf_counter()
        first = None
        for _ in self.generate(raw, timeout=600):
            if first is None:
                first = time.perf_counter() - t0
        return (first if first is not None else time.perf_counter() - t0) * 1e3

    @staticmethod
    def tokens(raw: bytes) -> int:
        from smg_grpc_proto import vllm_engine_pb2 as pb
        return len(pb.GenerateRequest.FromString(raw).tokenized.input_ids)


# -- processes ----------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


# -- one request --------------------------------------------------------------------------------------------------
def ttft(client: httpx.Client, url: str, raw: bytes) -> tuple[float, dict[str, Any]]:
    """Client-side time to the first chunk that carries a choice; and the tokenization report, if any."""
    t0 = time.perf_counter()
    first = None
    report: dict[str, Any] = {}
    with client.stream("POST", url, content=raw, headers={"content-type": "application/json"}, timeout=600) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - t0
            report = chunk.get("tokenization") or report
    return (first if first is not None else time.perf_counter() - t0) * 1e3, report


def chat_body(messages: list[dict[str, str]], key: str) -> bytes:
    return json.dumps({"model": STUB_MODEL, "messages": messages, "max_tokens": 1, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, "prompt_cache_key": key}).encode()


def measure_turn(client: httpx.Client, tier: str, stub: str | GrpcStub, messages: list[dict[str, str]],
                 key: str, null_proxy: str | None = None, path: str = "/v1/completions") -> dict[str, Any]:
    """The turn through the tier (a real new turn: its session holds the previous one), then the bytes the tier
    forwarded straight to the stub. The order is fixed: the direct request needs the tier's output, and sending the
    turn through the tier twice would time a resend instead of a turn."""
    body = chat_body(messages, key)
    t_tier, rep = ttft(client, tier + "/v1/chat/completions", body)
    if isinstance(stub, GrpcStub):
        forwarded = stub.last(b"", timeout=30)
        t_direct, n = stub.ttft(forwarded), stub.tokens(forwarded)
    else:
        forwarded = client.get(stub + "/last").content
        t_direct, _ = ttft(client, stub + path, forwarded)
        n = len(json.loads(forwarded)["prompt"])
    null = {}
    if null_proxy is not None:
        client.put(null_proxy + "/next", content=forwarded, timeout=60)
        t_null, _ = ttft(client, null_proxy + "/v1/chat/completions", body)
        null = {"null_ms": t_null, "null_added_ms": t_null - t_direct, "tier_over_null_ms": t_tier - t_null}
    marks = rep.get("phases_ms") or {}
    phases = {}
    if all(k in marks for k in ("received", "prepared", "upstream_first", "first_sent")):
        phases = {"receive_ms": marks["received"], "prepare_ms": marks["prepared"] - marks["received"],
                  "upstream_ms": marks["upstream_first"] - marks["prepared"],
                  "relay_ms": marks["first_sent"] - marks["upstream_first"]}
    return {"chars": sum(len(m["content"]) for m in messages), "tokens": n,
            "tier_ms": t_tier, "direct_ms": t_direct, "added_ms": t_tier - t_direct,
            "tok_ms": rep.get("time_ms"), "path": rep.get("path"), **phases, **null}


# -- workloads ----------------------------------------------------------------------------------------------------
def synthetic(size: int, turns: int, rng: random.Random, text: str) -> list[list[dict[str, str]]]:
    while len(text) < size + 200_000:
        text += text
    pos = rng.randrange(0, 1000)
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": text[pos:pos + size]}]
    pos += size
    calls = [list(messages)]
    for n in append_sizes(rng, turns):
        messages += [{"role": "assistant", "content": "Running the next command."},
                     {"role": "user", "content": text[pos:pos + n]}]
        pos += n
        calls.append(list(messages))
    return calls


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def write(res: dict[str, Any], prefix: Path) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines = ["# The tokenization tier's own added latency (an upstream stub instead of an engine)", "",
             f"`{res['command']}` at {res['started']}, load average {res['load_before']} -> {res['load_after']} on "
             f"{os.cpu_count()} CPUs (shared). "
             + ("Upstream: a gRPC stub of vLLM's engine service (the tier's `--upstream grpc://`); direct = the same "
                "request bytes as a Generate call. " if res.get("grpc") else "")
             + ("Upstream sessions (`--sessions`): the stub serves the session route of tokenplane's vLLM "
                "middleware and the tier runs with `--upstream-sessions`, so each turn forwards only the IDs the "
                "upstream session lacks (tokens P50 below counts those IDs); direct = the same bytes to that route. "
                if res.get("sessions") else "")
             + "tier added = TTFT(chat through the tier) - TTFT(the bytes the tier "
             "forwarded, sent straight to the stub), paired per turn; tier tokenize = the response's "
             "`tokenization.time_ms` (render + session lookup + repair).", "",
             "| workload | turns | context chars P50 | tokens P50 | tier TTFT P50 ms | direct TTFT P50 ms | "
             "tier added P50 / P90 ms | tier tokenize P50 / P90 ms | target added < 2 ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in res["cells"]:
        lines.append(f"| {c['workload']} | {c['turns']} | {c['chars_p50']:,} | {c['tokens_p50']:,} | "
                     f"{c['tier_ms_p50']:.2f} | {c['direct_ms_p50']:.2f} | {c['added_ms_p50']:.2f} / "
                     f"{c['added_ms_p90']:.2f} | {c['tok_ms_p50']:.2f} / {c['tok_ms_p90']:.2f} | "
                     f"{'met' if c['added_ms_p50'] < 2 else 'NOT met'} |")
    lines += ["", "Phases inside the tier, P50 ms (from the tier's own `tokenization.phases_ms`; a tier that does not "
              "report them is left out). upstream = the hop to the upstream and back to its first chunk, the stub's "
              "own time included (the direct arm pays that too); what the tier adds outside these phases is the "
              "client-side hop (uvicorn's request head, the response's way back).", "",
              "| workload | receive | prepare (of it tokenize) | upstream | relay | tier TTFT - phases |",
              "|---|---:|---:|---:|---:|---:|"]
    for c in res["cells"]:
        if c.get("receive_ms_p50") is None:
            continue
        lines.append(f"| {c['workload']} | {c['receive_ms_p50']:.2f} | {c['prepare_ms_p50']:.2f} "
                     f"({c['tok_ms_p50']:.2f}) | {c['upstream_ms_p50']:.2f} | {c['relay_ms_p50']:.2f} | "
                     f"{c['outside_ms_p50']:.2f} |")
    if any("null_added_ms_p50" in c for c in res["cells"]):
        lines += ["", "A pass-through proxy on the same stack (--null-proxy: reads the chat body, sends the bytes the "
                  "tier forwarded to the stub, relays the answer; no parse, render or tokenization): its added "
                  "latency is the floor of receiving the client's bytes plus one hop here. tier over null = TTFT(tier) "
                  "- TTFT(null proxy), paired per turn: the tier's own work.", "",
                  "| workload | tier added P50 / P90 ms | null proxy added P50 / P90 ms | tier over null P50 / P90 ms |",
                  "|---|---:|---:|---:|"]
        for c in res["cells"]:
            if "null_added_ms_p50" in c:
                lines.append(f"| {c['workload']} | {c['added_ms_p50']:.2f} / {c['added_ms_p90']:.2f} | "
                             f"{c['null_added_ms_p50']:.2f} / {c['null_added_ms_p90']:.2f} | "
                             f"{c['tier_over_null_ms_p50']:.2f} / {c['tier_over_null_ms_p90']:.2f} |")
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [c["workload"] for c in res["cells"]]
    ax.bar([i - 0.2 for i in range(len(names))], [c["added_ms_p50"] for c in res["cells"]], 0.4, label="tier added")
    ax.bar([i + 0.2 for i in range(len(names))], [c["tok_ms_p50"] for c in res["cells"]], 0.4, label="of it: tokenize")
    ax.axhline(2.0, color="red", ls="--", lw=1, label="target 2 ms")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("ms per turn (P50)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(prefix.with_suffix(".png"), dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stub", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--grpc-stub", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--grpc", action="store_true", help="a gRPC stub and the tier's grpc:// upstream (see above)")
    p.add_argument("--null-proxy", action="store_true", help="also time a pass-through proxy (see above)")
    p.add_argument("--sessions", action="store_true", help="the tier on upstream sessions (see above)")
    p.add_argument("--null-path", default="/v1/completions", help=argparse.SUPPRESS)
    p.add_argument("--null-proxy-port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--null-upstream", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sizes", type=int, nargs="*", default=[100_000, 1_000_000, 4_000_000])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--trajectories", type=int, default=4)
    p.add_argument("--tokenizer", default="qwen3")
    p.add_argument("--out", default=str(RESULTS / "tier_overhead"))
    p.add_argument("--baseline-tree", default=None, metavar="DIR",
                   help="also run a second tier from this source tree (e.g. a checkout of main), turns alternating "
                        "between the two, so that a change is measured side by side under the same load")
    args = p.parse_args()
    if args.stub is not None:
        run_stub(args.stub)
        return 0
    if args.grpc_stub is not None:
        run_grpc_stub(args.grpc_stub)
        return 0
    if args.null_proxy_port is not None:
        run_null_proxy(args.null_proxy_port, args.null_upstream, args.null_path)
        return 0
    logs = Path(args.out).parent / "tier_overhead_logs"
    logs.mkdir(parents=True, exist_ok=True)
    sp, tp = free_port(), free_port()
    stub_url, tier_url = f"{'grpc' if args.grpc else 'http'}://127.0.0.1:{sp}", f"http://127.0.0.1:{tp}"
    stub = spawn([sys.executable, __file__, "--grpc-stub" if args.grpc else "--stub", str(sp)], logs / "stub.log")
    direct: str | GrpcStub = GrpcStub(sp) if args.grpc else stub_url
    def tier_cmd(port: int) -> list[str]:
        return [sys.executable, "-m", "tokenplane.cli", "serve", "--upstream", stub_url, "--tokenizer", args.tokenizer,
                "--port", str(port), "--log-level", "warning", "--max-prompt-chars",
                str(max(args.sizes + [0]) * 2 + 100_000), *(["--upstream-sessions"] if args.sessions else [])]
    tier = spawn(tier_cmd(tp), logs / "tier.log")
    null_url, null_proc = None, None
    if args.null_proxy:
        npt = free_port()
        null_url = f"http://127.0.0.1:{npt}"
        null_proc = spawn([sys.executable, __file__, "--null-proxy-port", str(npt), "--null-upstream", stub_url,
                           "--null-path", SESSION_PATH if args.sessions else "/v1/completions"], logs / "null_proxy.log")
    tiers = [("", tier_url, tier)]
    if args.baseline_tree:
        bp = free_port()
        env = {**os.environ, "PYTHONPATH": str(Path(args.baseline_tree).resolve())}
        tiers.append(("baseline ", f"http://127.0.0.1:{bp}", subprocess.Popen(
            tier_cmd(bp), stdout=open(logs / "tier_baseline.log", "w"), stderr=subprocess.STDOUT,
            start_new_session=True, env=env, cwd=args.baseline_tree)))
    res: dict[str, Any] = {"command": "python benchmarks/tier_overhead.py " + " ".join(sys.argv[1:]),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                           "load_before": round(os.getloadavg()[0], 2), "tokenizer": args.tokenizer,
                           "baseline_tree": args.baseline_tree, "grpc": args.grpc, "sessions": args.sessions,
                           "cells": [], "rows": []}
    try:
        if isinstance(direct, GrpcStub):
            deadline = time.monotonic() + 60
            while not direct.ready():
                if time.monotonic() > deadline or stub.poll() is not None:
                    raise RuntimeError("the gRPC stub did not come up")
                time.sleep(0.3)
        else:
            wait_ready(stub_url + "/v1/models", stub)
        for _, url, proc in tiers:
            wait_ready(url + "/health", proc)
        if null_proc is not None:
            wait_ready(f"{null_url}/health", null_proc)
        client = httpx.Client()
        rng = random.Random(0)
        workloads: list[tuple[str, list[list[list[dict[str, str]]]]]] = []
        trajectories = load_trajectories(ROOT / "tests" / "fixtures" / "traces", args.trajectories)
        workloads.append(("real trajectories", [[conv[:n] for n in range(2, len(conv) + 1)
                                                 if conv[n - 1]["role"] == "user"] for conv in trajectories]))
        corpus = real_text()
        for size in args.sizes:
            workloads.append((f"{size // 1000}K" if size < 1_000_000 else f"{size // 1_000_000}M",
                              [synthetic(size, args.turns, rng, corpus)]))
        for name, conversations in workloads:
            rows: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in tiers}
            for ci, calls in enumerate(conversations):
                key = f"{name}-{ci}"
                for _, url, _ in tiers:
                    ttft(client, url + "/v1/chat/completions", chat_body(calls[0], key))   # builds the session
                for ti, messages in enumerate(calls[1:]):
                    order = tiers if ti % 2 == 0 else tiers[::-1]   # alternate which tier goes first
                    for label, url, _ in order:
                        row = measure_turn(client, url, direct, messages, key, null_url if not label else None,
                                           SESSION_PATH if args.sessions else "/v1/completions")
                        rows[label].append({"workload": label + name, **row})
                        print(f"{label}{name}: {row['chars']:,} chars, tier {row['tier_ms']:.2f} direct "
                              f"{row['direct_ms']:.2f} added {row['added_ms']:.2f} tok {row['tok_ms']} "
                              f"({row['path']})" + (f" null added {row['null_added_ms']:.2f}"
                                                    if "null_ms" in row else ""), flush=True)
            for label, _, _ in tiers:
                got = rows[label]
                res["rows"] += got
                res["cells"].append({"workload": label + name, "turns": len(got),
                                     "chars_p50": int(pct([r["chars"] for r in got], 0.5)),
                                     "tokens_p50": int(pct([r["tokens"] for r in got], 0.5)),
                                     **{f"{m}_p{q}": pct([r[m] for r in got], q / 100)
                                        for m in ("tier_ms", "direct_ms", "added_ms", "tok_ms") for q in (50, 90)}})
                nulled = [r for r in got if "null_ms" in r]
                if nulled:
                    res["cells"][-1].update({f"{m}_p{q}": pct([r[m] for r in nulled], q / 100)
                                             for m in ("null_added_ms", "tier_over_null_ms") for q in (50, 90)})
                phased = [r for r in got if "receive_ms" in r]
                if phased:
                    for r in phased:
                        r["outside_ms"] = r["tier_ms"] - sum(r[m] for m in PHASES)
                    res["cells"][-1].update({f"{m}_p{q}": pct([r[m] for r in phased], q / 100)
                                             for m in (*PHASES, "outside_ms") for q in (50, 90)})
            res["load_after"] = round(os.getloadavg()[0], 2)
            write(res, Path(args.out))
    finally:
        for _, _, proc in tiers:
            stop(proc)
        if null_proc is not None:
            stop(null_proc)
        stop(stub)
    print(Path(args.out).with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

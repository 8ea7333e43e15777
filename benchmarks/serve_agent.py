"""Agent conversations through `tokenplane serve`, with conversation sessions on and off, side by side.

Two servers run the same config (default: SmolLM2-135M-Instruct, one model): A repairs each conversation's live
tokenization session, B (`--no-sessions`) tokenizes every prompt from scratch. Every turn goes to both (the order
alternates per turn), streaming with usage, and records per server: server-side tokenization time (the response's
`tokenization.time_ms`), TTFT and end-to-end latency seen by the client, prompt tokens and context characters.

Workloads: real mini-swe-agent trajectories (tests/fixtures/traces, or --traces DIR), each call's prompt being every
message before it; and synthetic sessions of real text whose appends are sized from real Claude Code request shapes
(../shared/data/traces/claude-code-shapes.jsonl when present), grown until the model's context is full.

    python benchmarks/serve_agent.py [--config CFG] [--trajectories 6] [--synthetic 2] [--max-tokens 4] [--quick]

Writes benchmarks/results/serve_agent.{json,md,png}.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_CONFIG = {"models": ["smollm2-135m-instruct"], "algorithm": "single", "parameters": {},
                  "served_model_name": "smollm2", "num_blocks": 1024, "default_max_tokens": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, config_path: str, sessions: bool, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tokenplane.cli", "serve", "--config", config_path, "--port", str(self.port),
               "--log-level", "warning", "--max-prompt-chars", str(1 << 22)]
        if not sessions:
            cmd.append("--no-sessions")
        self.log = open(log_dir / f"server_{'sessions' if sessions else 'no_sessions'}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not become healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()


def load_trajectories(directory: Path, limit: int) -> list[list[dict[str, str]]]:
    out = []
    for f in sorted(directory.glob("*.traj.json*"))[:limit]:
        raw = f.read_bytes()
        data = json.loads(gzip.decompress(raw) if f.suffix == ".gz" else raw)
        out.append([{"role": m["role"], "content": m["content"]} for m in data["messages"]
                    if isinstance(m.get("content"), str)])
    return out


def real_text() -> str:
    parts = []
    for f in sorted((ROOT / "tests" / "fixtures" / "realtext").glob("*.jsonl.gz")):
        for line in gzip.decompress(f.read_bytes()).decode().splitlines():
            row = json.loads(line)
            parts.append(row.get("text", "") if isinstance(row, dict) else str(row))
    return "\n".join(p for p in parts if p)


def append_sizes(rng: random.Random, n: int) -> list[int]:
    """Append sizes in characters: real Claude Code append_tokens x 3.8 chars/token when the shapes file is there,
    else the published median/P90 (1.2K / 8K characters) as a log-normal."""
    shapes = ROOT.parent / "shared" / "data" / "traces" / "claude-code-shapes.jsonl"
    if shapes.is_file():
        rows = [json.loads(line) for line in shapes.read_text().splitlines()[:20000]]
        tokens = [r["append_tokens"] for r in rows if r.get("append_tokens")]
        return [max(200, int(rng.choice(tokens) * 3.8)) for _ in range(n)]
    return [max(200, int(rng.lognormvariate(7.1, 1.45))) for _ in range(n)]


def turn(client: httpx.Client, url: str, model: str, messages: list[dict[str, str]], key: str,
         max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "prompt_cache_key": key}
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    last: dict[str, Any] = {}
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "error": r.json().get("error", {})}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"status": 500, "error": chunk["error"]}
            for c in chunk.get("choices", []):
                if c.get("delta", {}).get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(c["delta"]["content"])
            if chunk.get("usage"):
                last = chunk
    e2e = time.perf_counter() - t0
    tok = last.get("tokenization") or {}
    return {"status": 200, "ttft_s": ttft if ttft is not None else e2e, "e2e_s": e2e, "tok_ms": tok.get("time_ms"),
            "path": tok.get("path"), "reused": tok.get("reused_tokens"),
            "prompt_tokens": last.get("usage", {}).get("prompt_tokens"), "answer": "".join(text)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = json.loads(Path(args.config).read_text()) if args.config else DEFAULT_CONFIG
    model = cfg.get("served_model_name", "tokenplane-router")
    tmp = Path(tempfile.mkdtemp(prefix="serve_agent_"))
    cfg_path = tmp / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    servers = {"sessions": Server(str(cfg_path), True, tmp), "no_sessions": Server(str(cfg_path), False, tmp)}
    rows: list[dict[str, Any]] = []
    try:
        for s in servers.values():
            s.wait()
        limit = httpx.get(servers["sessions"].url + "/v1/models").json()["data"][0]["max_model_len"]
        rng = random.Random(0)
        convs: list[tuple[str, list[list[dict[str, str]]]]] = []
        traces = Path(args.traces) if args.traces else ROOT / "tests" / "fixtures" / "traces"
        for n, messages in enumerate(load_trajectories(traces, args.trajectories)):
            calls = [messages[:i] for i, m in enumerate(messages) if m["role"] == "assistant"][:args.turns]
            convs.append((f"traj-{n}", calls))
        corpus = real_text()
        for n in range(args.synthetic):
            pos = rng.randrange(max(1, len(corpus) - 200_000))
            history = [{"role": "system", "content": corpus[pos:pos + 2000]}]
            pos += 2000
            calls = []
            for size in append_sizes(rng, args.synthetic_appends or args.turns * 4):
                history = history + [{"role": "user", "content": corpus[pos:pos + size]}]
                pos += size
                calls.append(list(history))
                history = history + [{"role": "assistant", "content": "ok"}]
            convs.append((f"synthetic-{n}", calls))
        with httpx.Client() as client:
            for conv_id, calls in convs:
                for k, prompt in enumerate(calls):
                    order = ["sessions", "no_sessions"] if k % 2 == 0 else ["no_sessions", "sessions"]
                    results = {}
                    for name in order:
                        results[name] = turn(client, servers[name].url, model, prompt, conv_id, args.max_tokens)
                    if any(r["status"] != 200 for r in results.values()):
                        errors = {n: r.get("error", {}).get("code") for n, r in results.items()}
                        if "context_length_exceeded" in errors.values():
                            break   # the conversation outgrew the model
                        raise RuntimeError(f"{conv_id} turn {k}: {results}")
                    chars = sum(len(m["content"]) for m in prompt)
                    for name, r in results.items():
                        rows.append({"conversation": conv_id, "turn": k, "server": name, "context_chars": chars,
                                     **{key: r[key] for key in ("prompt_tokens", "tok_ms", "path", "reused",
                                                                "ttft_s", "e2e_s")}})
                    print(f"{conv_id} turn {k}: {chars:,} chars, {results['sessions']['prompt_tokens']} tokens; "
                          f"tokenize {results['sessions']['tok_ms']:.2f} vs {results['no_sessions']['tok_ms']:.2f} ms;"
                          f" TTFT {results['sessions']['ttft_s']:.2f} vs {results['no_sessions']['ttft_s']:.2f} s",
                          flush=True)
    finally:
        for s in servers.values():
            s.stop()
    return {"rows": rows, "config": cfg, "max_model_len": limit}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))] if values else float("nan")


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    edges = [0, 4_000, 8_000, 16_000, 32_000, 64_000, 128_000, 256_000, 512_000, 1 << 40]
    out = []
    for lo, hi in zip(edges, edges[1:]):
        cell = {"chars": f"{lo:,}-{hi:,}" if hi < 1 << 40 else f">= {lo:,}"}
        for name in ("sessions", "no_sessions"):
            sel = [r for r in rows if r["server"] == name and lo <= r["context_chars"] < hi and r["turn"] > 0]
            if not sel:
                continue
            tok = [r["tok_ms"] for r in sel]
            ttft = [r["ttft_s"] for r in sel]
            share = [r["tok_ms"] / 1e3 / r["ttft_s"] for r in sel]
            cell[name] = {"n": len(sel), "tok_ms_p50": pct(tok, 0.5), "tok_ms_p90": pct(tok, 0.9),
                          "ttft_s_p50": pct(ttft, 0.5), "tok_share_of_ttft_p50": pct(share, 0.5),
                          "e2e_s_p50": pct([r["e2e_s"] for r in sel], 0.5)}
        if len(cell) > 1:
            out.append(cell)
    return out


def linear_fit(rows: list[dict[str, Any]]) -> tuple[float, float, float]:
    """Least squares tok_ms = a + b * chars -> (a ms, b ms per 100K chars, R^2)."""
    import numpy as np
    x = np.array([r["context_chars"] for r in rows], dtype=float)
    y = np.array([r["tok_ms"] for r in rows], dtype=float)
    if len(x) < 3 or np.ptp(x) == 0:
        return float("nan"), float("nan"), float("nan")
    b, a = np.polyfit(x, y, 1)
    r2 = 1 - float(np.sum((y - (a + b * x)) ** 2)) / float(np.sum((y - y.mean()) ** 2))
    return float(a), float(b * 1e5), r2


def write(result: dict[str, Any], args: argparse.Namespace) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / args.out
    summary = summarize(result["rows"])
    meta = {"command": " ".join(sys.argv), "loadavg": os.getloadavg(), "cpus": os.cpu_count(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "max_model_len": result["max_model_len"],
            "config": result["config"]}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": result["rows"]},
                                                         indent=1))
    lines = ["# Agent conversations through the server: conversation sessions on vs off", "",
             f"`{meta['command']}` at {meta['time']}, load average {meta['loadavg'][0]:.1f}/{meta['loadavg'][1]:.1f}"
             f" on {meta['cpus']} CPUs; model config `{json.dumps(result['config'])}`; context limit "
             f"{meta['max_model_len']} tokens. Turns after the first of each conversation; tokenization = the "
             "server's own time for the prompt (render + lookup + repair or encode); TTFT and end-to-end seen by "
             "the client (streaming). Each turn went to both servers, alternating which first.", "",
             "| context chars | turns | tokenize P50 / P90 ms (sessions) | (no sessions) | TTFT P50 s (sessions) | "
             "(no sessions) | tokenize / TTFT P50 (sessions) | (no sessions) |", "|---|---|---|---|---|---|---|---|"]
    for c in summary:
        a, b = c.get("sessions"), c.get("no_sessions")
        if not a or not b:
            continue
        lines.append(f"| {c['chars']} | {a['n']} | {a['tok_ms_p50']:.3f} / {a['tok_ms_p90']:.3f} | "
                     f"{b['tok_ms_p50']:.3f} / {b['tok_ms_p90']:.3f} | {a['ttft_s_p50']:.3f} | {b['ttft_s_p50']:.3f} |"
                     f" {100 * a['tok_share_of_ttft_p50']:.2f}% | {100 * b['tok_share_of_ttft_p50']:.2f}% |")
    on = [r for r in result["rows"] if r["server"] == "sessions" and r["turn"] > 0]
    if on:
        p50 = pct([r["tok_ms"] for r in on], 0.5)
        worst_share = max(c["sessions"]["tok_share_of_ttft_p50"] for c in summary if "sessions" in c)
        worst_bin = max((c["sessions"]["tok_ms_p50"], c["chars"]) for c in summary if "sessions" in c)
        lines += ["", f"Target (sessions on): tokenization P50 < 1 ms: measured {p50:.3f} ms over {len(on)} turns "
                      f"({'met' if p50 < 1 else 'NOT met'}), worst size bin {worst_bin[0]:.3f} ms at {worst_bin[1]} "
                      f"chars ({'met' if worst_bin[0] < 1 else 'NOT met'}); < 2% of TTFT in every size bin: worst bin "
                      f"{100 * worst_share:.2f}% ({'met' if worst_share < 0.02 else 'NOT met'})."]
    off = [r for r in result["rows"] if r["server"] == "no_sessions" and r["turn"] > 0]
    for name, sel in (("sessions on", on), ("sessions off", off)):
        a, b, r2 = linear_fit(sel)
        lines.append(f"- Linear fit, {name}: tokenization ms = {a:.3f} + {b:.3f} per 100K context characters "
                     f"(R^2 {r2:.2f}, {len(sel)} turns, contexts up to {max(r['context_chars'] for r in sel):,} chars)."
                     if sel else f"- {name}: no turns.")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        for name, color in (("sessions", "tab:blue"), ("no_sessions", "tab:red")):
            sel = [r for r in result["rows"] if r["server"] == name and r["turn"] > 0]
            ax[0].scatter([r["context_chars"] for r in sel], [r["tok_ms"] for r in sel], s=8, c=color, label=name)
            ax[1].scatter([r["context_chars"] for r in sel], [r["ttft_s"] for r in sel], s=8, c=color, label=name)
        ax[0].set(xlabel="context characters", ylabel="server tokenization ms", title="tokenization per turn")
        ax[1].set(xlabel="context characters", ylabel="TTFT s", title="time to first token")
        for a in ax:
            a.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)
    except ImportError:
        pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="serve config JSON (default: SmolLM2-135M-Instruct, one model)")
    p.add_argument("--traces", default=None, help="folder of *.traj.json[.gz] (default: tests/fixtures/traces)")
    p.add_argument("--trajectories", type=int, default=6)
    p.add_argument("--synthetic", type=int, default=2, help="synthetic sessions grown to the context limit")
    p.add_argument("--turns", type=int, default=12, help="turns per trajectory")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--synthetic-appends", type=int, default=0,
                   help="appends per synthetic session (default 4 x --turns); it ends at the context limit anyway")
    p.add_argument("--out", default="serve_agent", help="result file stem under benchmarks/results")
    p.add_argument("--quick", action="store_true", help="2 trajectories x 4 turns, 1 synthetic session")
    args = p.parse_args()
    if args.quick:
        args.trajectories, args.turns, args.synthetic = 2, 4, 1
    result = run(args)
    write(result, args)
    print((RESULTS / args.out).with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

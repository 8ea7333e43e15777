"""Bounded load / fault / soak run of `tokenplane serve` (issue 11): starts the server, drives it, writes a results table.

Phases (each bounded in time and request count; only 127.0.0.1 traffic):
  1. load         N concurrent clients (default 64) for S seconds (default 60): /v1/completions and
                  /v1/chat/completions, streaming and not, max_tokens 8-32, temperature 0 / 0.8. Per request: status,
                  latency, TTFT (streaming), error kind. P50/P99, throughput, errors by kind.
  2. kill         per model process, under 16 clients of load: SIGKILL it; every request in flight at the kill or
                  started in the window is classified (completed / told: HTTP error or SSE error event / untold:
                  silent truncation, reset, timeout); recovery = kill -> /health 200 again (new pid when pids are
                  reported) and a probe completion succeeds; 5xx outside the kill window must be 0.
  3. disconnects  100 streaming requests that read one chunk and close, 100 non-streaming ones cancelled after
                  ~0.2 s; then /health's live_requests and every model's kv_blocks_used must return to 0 (bounded wait).
  4. sessions     POST /v1/sessions + /append of ~10 KB of real text (this repository's sources and docs) until twice
                  the configured session budget was sent; /v1/tokenize/stats bytes must stay <= the budget; front-end
                  RSS before, at peak, after deleting every session.
  5. schemathesis `schemathesis run` against /openapi.json (bounded examples, time and per-request timeout); summary
                  parsed, full output in benchmarks/results/serve_faults_schemathesis.log.
  6. RSS          of the front end and of every model process at the start and at the end.

Targets (issue 11): 0 unexpected errors, 0 5xx outside a kill window, every client of a killed model told so,
recovery < 10 s, session bytes and RSS bounded by the configured caps. A missed target is reported, not fatal: the
exit code is non-zero only when the script itself fails.

  python benchmarks/serve_faults.py                 # the issue's sizes (several minutes; wrap in flock on shared hosts)
  python benchmarks/serve_faults.py --quick         # everything small, < 2 minutes
  python benchmarks/serve_faults.py --quick --phases load,kill --backend inprocess

Outputs: benchmarks/results/serve_faults.{json,md,png} (--out changes the stem).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PHASES = ("load", "kill", "disconnects", "sessions", "schemathesis")
MODEL = "tokenplane-router"
MAX_REQUESTS_PER_CLIENT = 20_000          # hard bound on every request loop, whatever the durations say
ERROR_BACKOFF_S = 0.05                    # after a failed request, so a server answering errors at once is not spun

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that reverses a linked list.",
    "What is 17 * 23? Think step by step.",
    "Summarize the plot of Hamlet.",
    "List three differences between TCP and UDP.",
    "Translate 'good morning, how are you?' into French and German.",
    "Give me a haiku about garbage collection.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


def now() -> float:
    return time.monotonic()


def pct(values: list[float], q: float) -> float | None:
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    k = (len(v) - 1) * q / 100.0
    lo, hi = int(k), min(len(v) - 1, int(k) + 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- processes ------------------------------------------------------------------------------------------------------
def proc_children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    kids = proc_children()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def model_pids_from_proc(server_pid: int) -> list[int]:
    """Model sub-servers are the server's multiprocessing children other than the resource tracker."""
    return sorted(p for p in descendants(server_pid)
                  if "multiprocessing" in cmdline(p) and "resource_tracker" not in cmdline(p))


def rss_table(server_pid: int, model_pids: list[int | None]) -> list[dict[str, Any]]:
    rows = [{"process": "front end", "pid": server_pid, "rss_mb": rss_mb(server_pid)}]
    for i, pid in enumerate(model_pids):
        rows.append({"process": f"model{i}", "pid": pid, "rss_mb": rss_mb(pid) if pid else None})
    known = {server_pid, *[p for p in model_pids if p]}
    for pid in descendants(server_pid):
        if pid not in known:
            line = cmdline(pid)
            rows.append({"process": "other child: " + ("resource_tracker" if "resource_tracker" in line
                                                        else line[:60]), "pid": pid, "rss_mb": rss_mb(pid)})
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m tokenplane.cli serve ...` in its own process group; stop() = SIGTERM, then SIGKILL of the group
    and of every descendant still alive."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        from tokenplane.engine.config import PRESETS

        def wide(name: str) -> dict[str, Any]:
            return {**PRESETS[name], "vocab_size": 151936, "eos_token_id": 151645}
        cfg = {"models": [wide("test-small"), wide("test-large")], "algorithm": "r_stitch",
               "parameters": {"mode": "synthetic", "rates": {"switch": 0.1, "return": 0.5}},
               "num_blocks": args.num_blocks, "served_model_name": MODEL, "tokenizer": "qwen3"}
        if args.config:
            cfg = json.loads(Path(args.config).read_text())
        self.config = cfg
        self.config_path = workdir / "serve_config.json"
        self.config_path.write_text(json.dumps(cfg))
        self.port = args.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        self.cmd = [sys.executable, "-m", "tokenplane.cli", "serve", "--config", str(self.config_path),
                    "--port", str(self.port), "--max-queued", str(args.max_queued), "--session-mb",
                    str(args.session_mb), "--backend", args.backend, "--log-level", "warning"]
        self.root = Path(args.server_root).resolve() if args.server_root else ROOT
        self.proc: subprocess.Popen | None = None
        self._log_offset = 0
        self.startup_s: float | None = None

    def start(self, timeout_s: float) -> None:
        log = open(self.log_path, "wb")
        t0 = now()
        env = dict(os.environ)
        if self.root != ROOT:   # `python -m` imports tokenplane from the working directory first
            env["PYTHONPATH"] = str(self.root) + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(self.root), env=env,
                                     start_new_session=True)
        log.close()
        deadline = t0 + timeout_s
        last = None
        while now() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode} during startup:\n{self.log_tail()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2.0)
                last = r.status_code
                if r.status_code == 200:
                    self.startup_s = round(now() - t0, 2)
                    global MODEL   # requests name the served model (a --config may name it differently)
                    try:
                        MODEL = httpx.get(self.url + "/v1/models", timeout=5.0).json()["data"][0]["id"]
                    except (httpx.HTTPError, ValueError, KeyError, IndexError):
                        pass
                    return
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            time.sleep(0.25)
        raise RuntimeError(f"server not healthy within {timeout_s} s (last: {last}):\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def scan_log(self) -> dict[str, Any]:
        """What the server logged since the last scan: tracebacks by exception type, ERROR lines, uvicorn
        warnings (the first lines of each kind as examples)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                new = f.read().decode(errors="replace")
                self._log_offset = f.tell()
        except OSError:
            return {}
        lines = new.splitlines()
        exceptions: dict[str, int] = {}
        where: dict[str, str] = {}
        errors, warnings = [], []
        i = 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("Traceback (most recent call last):"):
                j = i + 1
                last_frame = ""
                while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
                    if lines[j].strip().startswith("File ") and "site-packages" not in lines[j]:
                        last_frame = lines[j].strip()
                    j += 1
                exc = lines[j].strip() if j < len(lines) else "?"
                name = exc.split(":")[0]
                exceptions[name] = exceptions.get(name, 0) + 1
                where.setdefault(name, f"{exc[:200]} (last own frame: {last_frame[:160]})")
                i = j + 1
                continue
            if " ERROR " in line or line.startswith("ERROR"):
                errors.append(line[:300])
            elif line.startswith("WARNING"):
                warnings.append(line[:200])
            i += 1
        return {"tracebacks": sum(exceptions.values()), "exceptions": exceptions, "exception_examples": where,
                "error_lines": len(errors), "error_examples": errors[:5], "warning_lines": len(warnings),
                "warning_examples": sorted(set(warnings))[:5]}

    def stop(self, timeout_s: float = 15.0) -> dict[str, Any]:
        if self.proc is None:
            return {}
        kids = descendants(self.proc.pid)
        out: dict[str, Any] = {"descendants": len(kids)}
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
                out["stopped_by"] = "SIGTERM"
            except subprocess.TimeoutExpired:
                out["stopped_by"] = "SIGKILL (SIGTERM timed out)"
        out["exit_code"] = self.proc.poll()
        # whatever is left: the process group, then any descendant that left it
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        leftover = []
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
                leftover.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        out["children_killed_after_stop"] = leftover
        return out


# -- one request ----------------------------------------------------------------------------------------------------
def make_body(rng: random.Random, *, stream: bool | None = None, max_tokens: int | None = None,
              ignore_eos: bool = False) -> tuple[str, dict[str, Any]]:
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5 if stream is None else stream
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens or rng.randint(8, 32),
                            "temperature": rng.choice([0.0, 0.8]), "stream": stream}
    if ignore_eos:
        body["ignore_eos"] = True
    prompt = rng.choice(PROMPTS)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def error_code(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        e = payload["error"]
        return str(e.get("code") or e.get("type") or "error")
    return "unparsed"


async def one_request(client: httpx.AsyncClient, path: str, body: dict[str, Any], t_base: float,
                      timeout_s: float) -> dict[str, Any]:
    """Send one request and classify how it ended. kind: ok | http_<status> | stream_error | silent_truncation |
    timeout | transport | bad_response."""
    rec: dict[str, Any] = {"path": path, "stream": bool(body.get("stream")), "t0": now() - t_base, "status": None,
                           "kind": None, "detail": None, "ttft": None, "finish_reason": None, "retry_after": None}
    t0 = now()
    try:
        async with asyncio.timeout(timeout_s):
            if not body.get("stream"):
                r = await client.post(path, json=body)
                rec["status"] = r.status_code
                rec["retry_after"] = r.headers.get("retry-after")
                try:
                    payload = r.json()
                except ValueError:
                    payload = None
                if r.status_code == 200:
                    try:
                        rec["finish_reason"] = payload["choices"][0]["finish_reason"]
                        rec["kind"] = "ok" if rec["finish_reason"] else "bad_response"
                    except (TypeError, KeyError, IndexError):
                        rec["kind"], rec["detail"] = "bad_response", r.text[:200]
                else:
                    rec["kind"], rec["detail"] = f"http_{r.status_code}", f"{error_code(payload)}: {r.text[:200]}"
            else:
                async with client.stream("POST", path, json=body) as r:
                    rec["status"] = r.status_code
                    rec["retry_after"] = r.headers.get("retry-after")
                    if r.status_code != 200:
                        raw = await r.aread()
                        try:
                            payload = json.loads(raw)
                        except ValueError:
                            payload = None
                        rec["kind"] = f"http_{r.status_code}"
                        rec["detail"] = f"{error_code(payload)}: {raw[:200].decode(errors='replace')}"
                    else:
                        done = False
                        err = None
                        async for line in r.aiter_lines():
                            if not line.startswith("data: "):
                                continue
                            data = line[6:]
                            if data == "[DONE]":
                                done = True
                                break
                            try:
                                chunk = json.loads(data)
                            except ValueError:
                                rec["kind"], rec["detail"] = "bad_response", data[:200]
                                break
                            if "error" in chunk:
                                err = chunk
                                continue
                            if rec["ttft"] is None and chunk.get("choices"):
                                c = chunk["choices"][0]
                                if c.get("text") or (c.get("delta") or {}).get("content"):
                                    rec["ttft"] = now() - t0
                            for c in chunk.get("choices") or []:
                                if c.get("finish_reason"):
                                    rec["finish_reason"] = c["finish_reason"]
                        if rec["kind"] is None:
                            if err is not None:
                                rec["kind"], rec["detail"] = "stream_error", f"{error_code(err)}: {json.dumps(err)[:200]}"
                                rec["stream_error_type"] = (err.get("error") or {}).get("type")
                            elif rec["finish_reason"] and done:
                                rec["kind"] = "ok"
                            elif rec["finish_reason"]:
                                rec["kind"], rec["detail"] = "bad_response", "finish_reason but no [DONE]"
                            else:
                                rec["kind"] = "silent_truncation"
                                rec["detail"] = "[DONE] without finish_reason or error" if done else \
                                    "stream closed without finish_reason, error event or [DONE]"
    except TimeoutError:
        rec["kind"], rec["detail"] = "timeout", f"no complete answer within {timeout_s} s"
    except httpx.HTTPError as exc:
        rec["kind"], rec["detail"] = "transport", f"{type(exc).__name__}: {exc}"[:200]
    rec["t1"] = now() - t_base
    rec["latency"] = rec["t1"] - rec["t0"]
    return rec


def backoff(rec: dict[str, Any]) -> float:
    """Pause after a failed request: the server's Retry-After (capped at 0.5 s, so recovery is still seen within
    half a second), else ERROR_BACKOFF_S."""
    try:
        return min(0.5, float(rec["retry_after"])) if rec.get("retry_after") else ERROR_BACKOFF_S
    except ValueError:
        return ERROR_BACKOFF_S


def is_5xx(rec: dict[str, Any]) -> bool:
    if rec["status"] is not None and rec["status"] >= 500:
        return True
    if rec["kind"] == "stream_error":
        return rec.get("stream_error_type") in ("server_error", "service_unavailable", "timeout_error")
    return False


async def closed_loop(url: str, clients: int, stop_at: float, t_base: float, rng_seed: int, timeout_s: float,
                      hard_stop: float, records: list[dict[str, Any]], phase: str) -> None:
    """`clients` clients each keep one request in flight until stop_at (monotonic); all done by hard_stop."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout_s) as client:
        async def worker(c: int) -> None:
            rng = random.Random(rng_seed * 1000 + c)
            for _ in range(MAX_REQUESTS_PER_CLIENT):
                if now() >= stop_at:
                    return
                path, body = make_body(rng)
                rec = await one_request(client, path, body, t_base, min(timeout_s, max(1.0, hard_stop - now())))
                rec["phase"], rec["client"] = phase, c
                records.append(rec)
                if rec["kind"] != "ok":
                    await asyncio.sleep(backoff(rec))
        tasks = [asyncio.create_task(worker(c)) for c in range(clients)]
        done, pending = await asyncio.wait(tasks, timeout=max(1.0, hard_stop - now()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def summarize_requests(records: list[dict[str, Any]], window_s: float | None = None) -> dict[str, Any]:
    ok = [r for r in records if r["kind"] == "ok"]
    kinds: dict[str, int] = {}
    details: dict[str, str] = {}
    for r in records:
        if r["kind"] != "ok":
            kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
            details.setdefault(r["kind"], r["detail"])
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    by_route = {}
    for key in sorted({(r["path"], r["stream"]) for r in records}):
        rs = [r for r in records if (r["path"], r["stream"]) == key]
        okr = [r for r in rs if r["kind"] == "ok"]
        by_route[f"{key[0]} stream={key[1]}"] = {"requests": len(rs), "ok": len(okr),
                                                 "p50_s": pct([r["latency"] for r in okr], 50),
                                                 "p99_s": pct([r["latency"] for r in okr], 99)}
    out = {"requests": len(records), "ok": len(ok), "errors_by_kind": kinds, "error_examples": details,
           "latency_p50_s": pct(lat, 50), "latency_p99_s": pct(lat, 99), "ttft_p50_s": pct(ttft, 50),
           "ttft_p99_s": pct(ttft, 99), "by_route": by_route,
           "finish_reasons": {fr: sum(1 for r in ok if r["finish_reason"] == fr)
                              for fr in sorted({str(r["finish_reason"]) for r in ok})}}
    if window_s:
        out["window_s"] = round(window_s, 2)
        out["requests_per_s"] = round(len(ok) / window_s, 2)
    return out


async def get_json(client: httpx.AsyncClient, path: str, timeout: float = 3.0) -> tuple[int | None, Any]:
    try:
        r = await client.get(path, timeout=timeout)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, None
    except httpx.HTTPError as exc:
        return None, type(exc).__name__


# -- phase 1: load --------------------------------------------------------------------------------------------------
async def phase_load(url: str, args: argparse.Namespace, t_base: float) -> dict[str, Any]:
    # warm-up, not measured: one request per route and mode (the first requests of a process pay one-time costs)
    warm = []
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout) as client:
        rng = random.Random(3)
        for j in range(4):
            path, body = make_body(rng, stream=bool(j % 2), max_tokens=8)
            path = ("/v1/completions", "/v1/chat/completions")[j // 2]
            if path == "/v1/completions":
                body.pop("messages", None)
                body["prompt"] = PROMPTS[j]
            else:
                body.pop("prompt", None)
                body["messages"] = [{"role": "user", "content": PROMPTS[j]}]
            rec = await one_request(client, path, body, t_base, args.request_timeout)
            warm.append({k: rec[k] for k in ("path", "stream", "status", "kind", "latency", "detail")})
    records: list[dict[str, Any]] = []
    t0 = now()
    await closed_loop(url, args.clients, t0 + args.seconds, t_base, 1, args.request_timeout,
                      t0 + args.seconds + args.request_timeout + 5, records, "load")
    window = now() - t0
    s = summarize_requests(records, window)
    s["clients"], s["seconds"] = args.clients, args.seconds
    s["unexpected_errors"] = sum(v for k, v in s["errors_by_kind"].items())
    s["fivexx"] = sum(1 for r in records if is_5xx(r))
    s["warmup"] = warm
    return {"summary": s, "records": records}


# -- phase 2: kill --------------------------------------------------------------------------------------------------
async def model_pids(client: httpx.AsyncClient, server_pid: int) -> tuple[list[int | None], str]:
    code, h = await get_json(client, "/health")
    if isinstance(h, dict) and h.get("models") and all(m.get("pid") for m in h["models"]):
        return [m["pid"] for m in h["models"]], "/health models[i].pid"
    return list(model_pids_from_proc(server_pid)), "/proc children of the server (health has no pids)"


async def phase_kill(url: str, args: argparse.Namespace, t_base: float, server: Server) -> dict[str, Any]:
    if args.backend == "inprocess":
        return {"skipped": "the inprocess backend runs the models inside the front end: no model process to kill"}
    out: dict[str, Any] = {"kills": []}
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as hc:
        pids, source = await model_pids(hc, server.pid)
        out["pid_source"] = source
        code, h = await get_json(hc, "/health")
        n_models = len(h["models"]) if isinstance(h, dict) and h.get("models") else len(pids)
        for i in range(n_models):
            pids, source = await model_pids(hc, server.pid)
            kill = await kill_one(url, hc, args, t_base, server, i, pids)
            out["kills"].append(kill)
    return out


async def kill_one(url: str, hc: httpx.AsyncClient, args: argparse.Namespace, t_base: float, server: Server,
                   i: int, pids: list[int | None]) -> dict[str, Any]:
    res: dict[str, Any] = {"model": i, "pid": pids[i] if i < len(pids) else None}
    if res["pid"] is None:
        res["skipped"] = f"no pid for model {i} (pids {pids})"
        return res
    records: list[dict[str, Any]] = []
    t_start = now()
    # load runs until recovery + post window, or the recovery timeout
    stop = {"at": t_start + args.kill_warmup + args.recovery_timeout + args.kill_post}
    hard = t_start + args.kill_warmup + args.recovery_timeout + args.kill_post + args.request_timeout + 5

    async def load() -> None:
        # the stop time moves earlier once recovery is seen: closed_loop re-reads it through this proxy
        limits = httpx.Limits(max_connections=args.kill_clients + 4)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=args.request_timeout) as client:
            async def worker(c: int) -> None:
                rng = random.Random(7000 + 100 * i + c)
                for _ in range(MAX_REQUESTS_PER_CLIENT):
                    if now() >= stop["at"]:
                        return
                    path, body = make_body(rng)
                    rec = await one_request(client, path, body, t_base,
                                            min(args.request_timeout, max(1.0, hard - now())))
                    rec["phase"], rec["client"] = f"kill{i}", c
                    records.append(rec)
                    if rec["kind"] != "ok":
                        await asyncio.sleep(backoff(rec))
            tasks = [asyncio.create_task(worker(c)) for c in range(args.kill_clients)]
            _, pending = await asyncio.wait(tasks, timeout=max(1.0, hard - now()))
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    load_task = asyncio.create_task(load())
    await asyncio.sleep(args.kill_warmup)
    in_flight_before = sum(1 for r in records)   # finished so far (in-flight ones are found from t0/t1 later)
    t_kill = now()
    try:
        os.kill(res["pid"], signal.SIGKILL)
        res["killed"] = True
    except ProcessLookupError:
        res["killed"] = False
        res["skipped"] = "process already gone"
    k = t_kill - t_base
    res["t_kill"] = round(k, 3)
    res["finished_before_kill"] = in_flight_before

    # recovery: /health 200 (with a new pid for model i when pids are reported), and a probe completion that succeeds
    health_log: list[tuple[float, Any, Any]] = []
    saw_down = False
    t_health = None
    t_probe = None
    probe_log: list[dict[str, Any]] = []
    deadline = t_kill + args.recovery_timeout

    async def watch_health() -> None:
        nonlocal saw_down, t_health
        while now() < deadline:
            code, h = await get_json(hc, "/health", timeout=2.0)
            models = h.get("models") if isinstance(h, dict) else None
            state = models[i].get("state") if models and i < len(models) else None
            pid = models[i].get("pid") if models and i < len(models) else None
            health_log.append((round(now() - t_kill, 3), code, state))
            if code != 200:
                saw_down = True
            replaced = pid is not None and pid != res["pid"]
            if code == 200 and (saw_down or replaced):
                t_health = now()
                return
            await asyncio.sleep(0.1)

    async def probe() -> None:
        nonlocal t_probe
        rng = random.Random(99)
        async with httpx.AsyncClient(base_url=url, timeout=10.0) as pc:
            await asyncio.sleep(0.2)   # let the death be noticed first
            while now() < deadline:
                path, body = make_body(rng, stream=False, max_tokens=4)
                rec = await one_request(pc, path, body, t_base, max(1.0, min(10.0, deadline - now())))
                probe_log.append({k2: rec[k2] for k2 in ("t0", "t1", "status", "kind", "retry_after")})
                if rec["kind"] == "ok" and rec["t0"] > k:
                    t_probe = t_base + rec["t1"]
                    return
                await asyncio.sleep(0.2)

    await asyncio.gather(watch_health(), probe())
    if t_health is None and not saw_down:
        # health never showed the death (no per-model state): fall back to the probe alone
        res["health_note"] = "/health stayed 200 through the kill (the death was never reported)"
    recovered = t_probe is not None and (t_health is not None or not saw_down)
    t_rec = max(x for x in (t_health, t_probe) if x is not None) if recovered else None
    res["recovered"] = recovered
    res["recovery_s"] = round(t_rec - t_kill, 3) if t_rec else None
    res["health_recovery_s"] = round(t_health - t_kill, 3) if t_health else None
    res["probe_recovery_s"] = round(t_probe - t_kill, 3) if t_probe else None
    res["health_states"] = health_log[:: max(1, len(health_log) // 40)]
    res["probes"] = probe_log[:20]
    stop["at"] = (t_rec if t_rec else deadline) + args.kill_post
    await asyncio.wait_for(load_task, timeout=max(1.0, hard - now() + 5))

    win_end = (t_rec - t_base if t_rec else deadline - t_base) + args.window_grace
    affected = [r for r in records if r["t0"] <= win_end and r["t1"] >= k]
    in_flight = [r for r in records if r["t0"] < k < r["t1"]]
    outside = [r for r in records if r not in affected]
    told_kinds = ("http_503", "http_500", "http_502", "http_504", "stream_error", "http_429")
    res["requests"] = len(records)
    res["in_flight_at_kill"] = len(in_flight)
    res["in_flight_outcome"] = {
        "completed": sum(1 for r in in_flight if r["kind"] == "ok"),
        "told": sum(1 for r in in_flight if r["kind"] in told_kinds),
        "untold": sum(1 for r in in_flight if r["kind"] not in told_kinds and r["kind"] != "ok")}
    res["window_requests"] = len(affected)
    res["window_errors_by_kind"] = summarize_requests(affected)["errors_by_kind"]
    errs_503 = [r for r in affected if r["status"] == 503]
    res["window_503"] = len(errs_503)
    res["window_503_with_retry_after"] = sum(1 for r in errs_503 if r["retry_after"])
    res["silent_truncations"] = sum(1 for r in records if r["kind"] == "silent_truncation")
    res["untold_in_window"] = sum(1 for r in affected if r["kind"] not in told_kinds and r["kind"] != "ok")
    res["fivexx_outside_window"] = sum(1 for r in outside if is_5xx(r))
    res["errors_outside_window"] = summarize_requests(outside)["errors_by_kind"]
    res["error_examples"] = summarize_requests(records)["error_examples"]
    res["records"] = records
    return res


# -- phase 3: disconnects -------------------------------------------------------------------------------------------
async def phase_disconnects(url: str, args: argparse.Namespace, t_base: float) -> dict[str, Any]:
    n = args.disconnects
    res: dict[str, Any] = {"stream": {}, "nonstream": {}}
    sem = asyncio.Semaphore(args.disconnect_concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout,
                                 limits=httpx.Limits(max_connections=args.disconnect_concurrency + 4)) as client:
        async def stream_one(j: int) -> str:
            rng = random.Random(5000 + j)
            path, body = make_body(rng, stream=True, max_tokens=128, ignore_eos=True)
            async with sem:
                try:
                    async with asyncio.timeout(args.request_timeout):
                        async with client.stream("POST", path, json=body) as r:
                            if r.status_code != 200:
                                return f"http_{r.status_code}"
                            async for line in r.aiter_lines():
                                if line.startswith("data: "):
                                    return "closed_after_first_chunk"   # leaving the block closes the connection
                            return "ended_before_first_chunk"
                except TimeoutError:
                    return "timeout"
                except httpx.HTTPError as exc:
                    return f"transport:{type(exc).__name__}"

        async def nonstream_one(j: int) -> str:
            rng = random.Random(6000 + j)
            path, body = make_body(rng, stream=False, max_tokens=128, ignore_eos=True)
            async with sem:
                # its own connection, so the cancel closes exactly this request's socket
                async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout) as own:
                    try:
                        r = await asyncio.wait_for(own.post(path, json=body), timeout=args.cancel_after)
                        return f"answered_before_cancel_{r.status_code}"
                    except TimeoutError:
                        return "cancelled"
                    except httpx.HTTPError as exc:
                        return f"transport:{type(exc).__name__}"

        for name, fn in (("stream", stream_one), ("nonstream", nonstream_one)):
            t0 = now()
            outcomes = await asyncio.gather(*(fn(j) for j in range(n)))
            counts: dict[str, int] = {}
            for o in outcomes:
                counts[o] = counts.get(o, 0) + 1
            res[name] = {"requests": n, "outcomes": counts, "wall_s": round(now() - t0, 2)}

        # drained? live_requests and kv_blocks_used back to 0 within the bound
        t0 = now()
        samples = []
        drained_at = None
        while now() - t0 < args.drain_timeout:
            code, h = await get_json(client, "/health")
            if isinstance(h, dict):
                kv = [m.get("kv_blocks_used") for m in h.get("models", [])]
                samples.append({"t": round(now() - t0, 2), "status": code, "live": h.get("live_requests"),
                                "queued": h.get("queued_requests"), "kv_blocks_used": kv})
                if h.get("live_requests", 0) == 0 and all(x in (0, None) for x in kv):
                    drained_at = now() - t0
                    break
            else:
                samples.append({"t": round(now() - t0, 2), "status": code, "error": h})
            await asyncio.sleep(0.25)
        last = samples[-1] if samples else {}
        res["drain"] = {"drained": drained_at is not None, "drain_s": round(drained_at, 2) if drained_at is not None
                        else None, "timeout_s": args.drain_timeout, "last": last, "samples": samples[:: max(1, len(samples) // 20)],
                        "kv_exposed": any(x is not None for x in last.get("kv_blocks_used", []) or [])}
        # the server still answers afterwards
        path, body = make_body(random.Random(1), stream=False, max_tokens=4)
        after = await one_request(client, path, body, t_base, 30.0)
        res["request_after"] = {k: after[k] for k in ("status", "kind", "detail", "latency")}
    return res


# -- phase 4: sessions ----------------------------------------------------------------------------------------------
def corpus_chunks(size: int, limit_bytes: int) -> list[str]:
    """~size-character pieces of this repository's own sources and docs (real-looking text: prose, code, Markdown)."""
    files = sorted([*ROOT.glob("docs/**/*.md"), *ROOT.glob("tokenplane/**/*.py"), ROOT / "README.md"])
    text = "\n".join(p.read_text(errors="replace") for p in files if p.is_file())
    out, pos = [], 0
    total = 0
    while total < limit_bytes and text:
        piece = text[pos:pos + size]
        if len(piece) < size:
            piece += text[: size - len(piece)]
        out.append(piece)
        total += len(piece.encode())
        pos = (pos + size) % len(text)
    return out


async def phase_sessions(url: str, args: argparse.Namespace, server: Server) -> dict[str, Any]:
    budget = int(args.session_mb * (1 << 20))
    target = 2 * budget
    chunks = corpus_chunks(args.session_chunk, min(target, 8 << 20))   # a pool of distinct pieces, reused
    res: dict[str, Any] = {"budget_bytes": budget, "target_sent_bytes": target}
    rss = {"before": rss_mb(server.pid), "peak": rss_mb(server.pid)}
    stats_max: dict[str, Any] = {"bytes": 0}
    ids: list[str] = []
    sent = [0]
    errors: dict[str, int] = {}
    timeline: list[dict[str, Any]] = []
    t0 = now()
    deadline = t0 + args.session_timeout
    async with httpx.AsyncClient(base_url=url, timeout=30.0,
                                 limits=httpx.Limits(max_connections=args.session_clients + 4)) as client:
        code, st = await get_json(client, "/v1/tokenize/stats")
        res["stats_before"] = st
        # warm-up, not counted: the first sessions pay one-time costs (the session encoder's tables and buffers)
        for j in range(args.session_clients):
            try:
                r = await client.post("/v1/sessions", json={})
                sid = r.json()["id"]
                await client.post(f"/v1/sessions/{sid}/append", json={"text": chunks[-1 - j], "return_ids": False})
                await client.delete(f"/v1/sessions/{sid}")
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                res["warmup_error"] = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(0.5)
        rss["after_warmup"] = rss_mb(server.pid)
        rss["peak"] = rss["after_warmup"]

        def err(kind: str) -> None:
            errors[kind] = errors.get(kind, 0) + 1

        async def worker(c: int) -> None:
            j = c
            for _ in range(MAX_REQUESTS_PER_CLIENT):
                if sent[0] >= target or now() > deadline:
                    return
                try:
                    r = await client.post("/v1/sessions", json={})
                    if r.status_code != 200:
                        err(f"create_http_{r.status_code}")
                        await asyncio.sleep(ERROR_BACKOFF_S)
                        continue
                    sid = r.json()["id"]
                    ids.append(sid)
                    text = chunks[j % len(chunks)]
                    j += args.session_clients
                    r = await client.post(f"/v1/sessions/{sid}/append", json={"text": text, "return_ids": False})
                    sent[0] += len(text.encode())
                    if r.status_code != 200:
                        err(f"append_http_{r.status_code}")
                        await asyncio.sleep(ERROR_BACKOFF_S)
                except httpx.HTTPError as exc:
                    err(f"transport:{type(exc).__name__}")
                    await asyncio.sleep(ERROR_BACKOFF_S)

        async def monitor() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=5.0) as mc:
                while sent[0] < target and now() <= deadline:
                    r = rss_mb(server.pid)
                    if r is not None and (rss["peak"] is None or r > rss["peak"]):
                        rss["peak"] = r
                    code, st = await get_json(mc, "/v1/tokenize/stats")
                    if isinstance(st, dict) and st.get("bytes", 0) >= stats_max["bytes"]:
                        stats_max.update(st)
                    if isinstance(st, dict):
                        timeline.append({"t": round(now() - t0, 2), "sent": sent[0], "rss_mb": r,
                                         "store_bytes": st.get("bytes"), "sessions": st.get("sessions"),
                                         "evicted": st.get("evicted")})
                    await asyncio.sleep(0.25)

        await asyncio.gather(monitor(), *(worker(c) for c in range(args.session_clients)))
        res["soak_s"] = round(now() - t0, 2)
        res["sent_bytes"] = sent[0]
        res["sessions_created"] = len(ids)
        code, st = await get_json(client, "/v1/tokenize/stats")
        res["stats_at_end"] = st
        if isinstance(st, dict) and st.get("bytes", 0) >= stats_max["bytes"]:
            stats_max.update(st)
        res["stats_max_seen"] = dict(stats_max)
        rss["at_end_of_soak"] = rss_mb(server.pid)
        rss["peak"] = max(x for x in (rss["peak"], rss["at_end_of_soak"]) if x is not None)
        # delete everything (evicted ones answer 404, expected)
        deleted = {"200": 0, "404": 0, "other": 0}
        sem = asyncio.Semaphore(args.session_clients)

        async def delete(sid: str) -> None:
            async with sem:
                if now() > deadline + 60:
                    deleted["other"] += 1
                    return
                try:
                    r = await client.delete(f"/v1/sessions/{sid}")
                    key = str(r.status_code) if r.status_code in (200, 404) else "other"
                except httpx.HTTPError:
                    key = "other"
                deleted[key] += 1
        await asyncio.gather(*(delete(s) for s in ids))
        res["deleted"] = deleted
        await asyncio.sleep(1.0)
        code, st = await get_json(client, "/v1/tokenize/stats")
        res["stats_after_delete"] = st
    rss["after_delete"] = rss_mb(server.pid)
    half = [p for p in timeline if p["sent"] >= target / 2 and p["rss_mb"] is not None]
    if half and rss["at_end_of_soak"] is not None:
        # leak indicator: the store is full (evicting) long before half the text is sent, so RSS should be flat
        rss["second_half_start"] = half[0]["rss_mb"]
        rss["second_half_drift"] = round(rss["at_end_of_soak"] - half[0]["rss_mb"], 1)
    res["rss_mb"] = rss
    res["errors"] = errors
    res["timeline"] = timeline[:: max(1, len(timeline) // 200)]
    res["bytes_within_budget"] = stats_max.get("bytes", 0) <= budget
    res["sent_whole_target"] = sent[0] >= target
    return res


# -- phase 5: schemathesis ------------------------------------------------------------------------------------------
def phase_schemathesis(url: str, args: argparse.Namespace, log_path: Path, workdir: Path) -> dict[str, Any]:
    exe = shutil.which("schemathesis") or shutil.which("st")
    if exe is None:
        return {"skipped": "schemathesis not installed"}
    report = workdir / "schemathesis.json"
    cmd = [exe, "run", f"{url}/openapi.json", "--max-examples", str(args.st_examples), "--seed", "0",
           "--workers", "1", "--request-timeout", str(args.st_request_timeout), "--max-time", str(args.st_max_time),
           "--generation-database", "none", "--no-color", "--report", "json", "--report-json-path", str(report),
           "--phases", "examples,coverage,fuzzing", "--suppress-health-check", "all", "--output-sanitize", "false"]
    t0 = now()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.st_max_time + 60, cwd=str(workdir))
        output, rc, timed_out = p.stdout + p.stderr, p.returncode, False
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rc, timed_out = None, True
    log_path.write_text(f"$ {' '.join(cmd)}\n\n{output}")
    res: dict[str, Any] = {"command": " ".join(cmd), "exit_code": rc, "timed_out": timed_out,
                           "wall_s": round(now() - t0, 1),
                           "log": str(log_path.relative_to(ROOT)) if log_path.is_relative_to(ROOT) else str(log_path)}
    res.update(parse_schemathesis(output, report))
    return res


def parse_schemathesis(output: str, report: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    clean = re.sub(r"\x1b\[[0-9;]*m", "", output)
    m = re.search(r"API Operations:\s*\n(.*?)\n\n", clean, re.S)
    if m:
        out["operations_block"] = m.group(1).strip()
    m = re.search(r"Selected:\s*(\d+)/(\d+)", clean)
    if m:
        out["operations_selected"], out["operations_total"] = int(m.group(1)), int(m.group(2))
    m = re.search(r"Tested:\s*(\d+)", clean)
    if m:
        out["operations_tested"] = int(m.group(1))
    m = re.search(r"Test cases:\s*\n?\s*(.+)", clean)
    if m:
        out["test_cases"] = m.group(1).strip()
    checks: dict[str, dict[str, int]] = {}
    for m in re.finditer(r"^\s*[✓✘⚠]\s*(\w+)\s+(\d+)/(\d+)\s+passed", clean, re.M):
        checks[m.group(1)] = {"passed": int(m.group(2)), "total": int(m.group(3))}
    if checks:
        out["checks"] = checks
    failures = []
    for m in re.finditer(r"_{5,} (\S+ \S+) _{5,}\n(.*?)(?=\n_{5,} |\n={5,}|\Z)", clean, re.S):
        body = m.group(2)
        titles = re.findall(r"^\s*-\s+(.+)$", body, re.M)
        curls = re.findall(r"^\s*(curl .+)$", body, re.M)
        failures.append({"operation": m.group(1), "failures": titles[:10], "reproduce": curls[:5],
                         "text": body.strip()[:3000]})
    out["failures"] = failures
    out["output_clean"] = clean[-20000:]
    m = re.search(r"=+\s*(.*?(?:passed|failed|errors?|warnings?).*?)\s*=+\s*$", clean, re.M)
    tail = [ln for ln in clean.strip().splitlines() if ln.strip()][-3:]
    out["result_line"] = m.group(1) if m else " / ".join(tail)
    if report.exists():
        try:
            out["json_report"] = json.loads(report.read_text())
        except ValueError:
            out["json_report_raw"] = report.read_text()[:5000]
    return out


# -- output ---------------------------------------------------------------------------------------------------------
def fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{nd}g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def targets(result: dict[str, Any], args: argparse.Namespace) -> list[list[Any]]:
    rows: list[list[Any]] = []
    ph = result["phases"]

    def add(name: str, met: bool | None, measured: str) -> None:
        rows.append([name, "n/a" if met is None else ("met" if met else "NOT MET"), measured])
    if "load" in ph and "summary" in ph["load"]:
        s = ph["load"]["summary"]
        add("load: 0 unexpected errors", s["unexpected_errors"] == 0,
            f"{s['unexpected_errors']} of {s['requests']} ({json.dumps(s['errors_by_kind'])})")
        add("load: 0 5xx", s["fivexx"] == 0, f"{s['fivexx']}")
    if "kill" in ph and "skipped" in ph["kill"]:
        add("kill: each model process", None, ph["kill"]["skipped"])
    if "kill" in ph and "kills" in ph["kill"]:
        for k in ph["kill"]["kills"]:
            m = f"model{k['model']} (pid {k.get('pid')})"
            if "skipped" in k and "requests" not in k:
                add(f"kill {m}", False, k["skipped"])
                continue
            add(f"kill {m}: recovery < {args.recovery_target:g} s",
                bool(k["recovered"] and k["recovery_s"] < args.recovery_target),
                f"{fmt(k['recovery_s'])} s (health {fmt(k['health_recovery_s'])} s, first completion "
                f"{fmt(k['probe_recovery_s'])} s)" if k["recovered"] else
                f"not recovered within {args.recovery_timeout:g} s")
            add(f"kill {m}: every client told", k["untold_in_window"] == 0 and k["silent_truncations"] == 0,
                f"in flight at kill {k['in_flight_at_kill']}: {json.dumps(k['in_flight_outcome'])}; untold in "
                f"window {k['untold_in_window']}; silent truncations {k['silent_truncations']}")
            add(f"kill {m}: 0 5xx outside the kill window", k["fivexx_outside_window"] == 0,
                f"{k['fivexx_outside_window']} (errors outside: {json.dumps(k['errors_outside_window'])})")
            add(f"kill {m}: 503s carry Retry-After", k["window_503"] == 0 or
                k["window_503_with_retry_after"] == k["window_503"],
                f"{k['window_503_with_retry_after']}/{k['window_503']}")
    if "disconnects" in ph and "drain" in ph["disconnects"]:
        d = ph["disconnects"]["drain"]
        add("disconnects: live requests and KV back to 0", d["drained"],
            f"drained in {fmt(d['drain_s'])} s; last {json.dumps({k: d['last'].get(k) for k in ('live', 'kv_blocks_used')})}"
            + ("" if d["kv_exposed"] else " (kv_blocks_used not exposed by /health)"))
        a = ph["disconnects"]["request_after"]
        add("disconnects: server answers afterwards", a["kind"] == "ok", f"{a['status']} {a['kind']}")
    if "sessions" in ph and "rss_mb" in ph["sessions"]:
        s = ph["sessions"]
        add("sessions: bytes <= budget", s["bytes_within_budget"],
            f"max seen {s['stats_max_seen'].get('bytes')} B, budget {s['budget_bytes']} B, sent {s['sent_bytes']} B")
        r = s["rss_mb"]
        allowance = s["budget_bytes"] / (1 << 20) + args.rss_slack_mb
        base = r.get("after_warmup") or r["before"]
        if base is not None and r["peak"] is not None:
            grow = r["peak"] - base
            add(f"sessions: front-end RSS peak - warmed-up RSS <= budget + {args.rss_slack_mb:g} MiB",
                grow <= allowance, f"{r['before']} (cold) -> {base} (after {args.session_clients} warm-up sessions) "
                f"-> peak {r['peak']} -> after delete {r['after_delete']} MiB (+{grow:.1f} over warm, allowance "
                f"{allowance:.0f})")
        if r.get("second_half_drift") is not None:
            add(f"sessions: RSS flat over the second half of the soak (drift <= {args.rss_drift_mb:g} MiB)",
                r["second_half_drift"] <= args.rss_drift_mb,
                f"{r['second_half_start']} -> {r['at_end_of_soak']} MiB ({r['second_half_drift']:+.1f})")
    for name, p in ph.items():
        lg = p.get("server_log") or {}
        if lg:
            add(f"{name}: no unhandled exception in the server log", lg["tracebacks"] == 0,
                f"{lg['tracebacks']} tracebacks {json.dumps(lg['exceptions'])}; {lg['error_lines']} ERROR lines"
                + (f"; e.g. {next(iter(lg['exception_examples'].values()))}" if lg["exception_examples"] else ""))
    if "schemathesis" in ph and "exit_code" in ph["schemathesis"]:
        s = ph["schemathesis"]
        add("schemathesis: no failures", s["exit_code"] == 0 and not s.get("failures"),
            f"exit {s['exit_code']}; {len(s.get('failures', []))} failing operations; {s.get('result_line', '')}")
    return rows


def markdown(result: dict[str, Any], args: argparse.Namespace) -> str:
    m = result["meta"]
    L = [f"# tokenplane serve: load / faults / soak ({'quick' if args.quick else 'full'} run)\n\n",
         f"Command: `{m['command']}`  \nStarted {m['started']} UTC, wall {m['wall_s']} s; load average "
         f"{m['loadavg_start']} at start, {m['loadavg_end']} at end; {m['cpus']} CPUs; Python {m['python']}; git "
         f"{m['git']}.  \nServer: `{m['server_command']}` from {m['server_root']} (backend {args.backend}, healthy after "
         f"{m.get('startup_s')} s). Models: {m['models']}.\n"]
    L.append("\n## Targets\n\n")
    L.append(table(["target", "status", "measured"], targets(result, args)))
    ph = result["phases"]
    for name, p in ph.items():
        if "error" in p:
            L.append(f"\n**Phase {name} failed:** `{p['error']}`\n")
    if "load" in ph and "summary" in ph["load"]:
        s = ph["load"]["summary"]
        L.append(f"\n## 1. Load: {s['clients']} clients for {s['seconds']} s\n\nAfter {len(s.get('warmup', []))} "
                 f"unmeasured warm-up requests (latencies "
                 f"{', '.join(fmt(w['latency']) + ' s ' + str(w['kind']) for w in s.get('warmup', []))}).\n\n")
        L.append(table(["requests", "ok", "req/s", "latency P50 s", "P99 s", "TTFT P50 s", "TTFT P99 s"],
                       [[s["requests"], s["ok"], s.get("requests_per_s"), s["latency_p50_s"], s["latency_p99_s"],
                         s["ttft_p50_s"], s["ttft_p99_s"]]]))
        L.append("\n" + table(["route", "requests", "ok", "P50 s", "P99 s"],
                              [[k, v["requests"], v["ok"], v["p50_s"], v["p99_s"]] for k, v in s["by_route"].items()]))
        if s["errors_by_kind"]:
            L.append("\nErrors by kind:\n\n" + table(["kind", "count", "example"],
                     [[k, v, f"`{(s['error_examples'].get(k) or '')[:150]}`"] for k, v in s["errors_by_kind"].items()]))
    if "kill" in ph and "kills" in ph["kill"]:
        L.append(f"\n## 2. SIGKILL of each model process under {args.kill_clients} clients\n\nPids from "
                 f"{ph['kill'].get('pid_source')}. Window = kill .. recovery + {args.window_grace:g} s.\n\n")
        rows = []
        for k in ph["kill"]["kills"]:
            if "requests" not in k:
                rows.append([f"model{k['model']}", k.get("pid"), k.get("skipped", ""), "", "", "", "", "", "", ""])
                continue
            rows.append([f"model{k['model']}", k["pid"], k["recovery_s"], k["health_recovery_s"],
                         k["probe_recovery_s"], k["in_flight_at_kill"], json.dumps(k["in_flight_outcome"]),
                         f"{k['window_503']} ({k['window_503_with_retry_after']} w/ Retry-After)",
                         k["silent_truncations"], k["fivexx_outside_window"]])
        L.append(table(["model", "pid", "recovery s", "health 200 s", "first completion s", "in flight",
                        "in-flight outcome", "503 in window", "silent trunc.", "5xx outside"], rows))
        for k in ph["kill"]["kills"]:
            if k.get("window_errors_by_kind") or k.get("errors_outside_window"):
                L.append(f"\nmodel{k['model']}: window errors {json.dumps(k.get('window_errors_by_kind'))}; outside "
                         f"{json.dumps(k.get('errors_outside_window'))}; "
                         + (k.get("health_note", "")) + "\n")
                for kind, ex in (k.get("error_examples") or {}).items():
                    L.append(f"- {kind}: `{(ex or '')[:200]}`\n")
    if "disconnects" in ph and "drain" in ph["disconnects"]:
        d = ph["disconnects"]
        L.append("\n## 3. Disconnects\n\n" + table(
            ["kind", "requests", "outcomes", "wall s"],
            [["stream: read 1 chunk, close", d["stream"]["requests"], json.dumps(d["stream"]["outcomes"]),
              d["stream"]["wall_s"]],
             [f"non-stream: cancel after {args.cancel_after:g} s", d["nonstream"]["requests"],
              json.dumps(d["nonstream"]["outcomes"]), d["nonstream"]["wall_s"]]]))
        dr = d["drain"]
        L.append(f"\nDrain: {'drained' if dr['drained'] else 'NOT drained'} in {fmt(dr['drain_s'])} s (bound "
                 f"{dr['timeout_s']} s); last /health sample `{json.dumps(dr['last'])}`. Request afterwards: "
                 f"{d['request_after']['status']} {d['request_after']['kind']}.\n")
    if "sessions" in ph and "rss_mb" in ph["sessions"]:
        s = ph["sessions"]
        r = s["rss_mb"]
        L.append("\n## 4. Session soak\n\n" + table(
            ["budget B", "sent B", "sessions", "max bytes seen", "evicted (end)", "front-end RSS MiB cold / warmed up / "
             "peak / end of soak / after delete", "deletes 200/404/other", "errors", "wall s"],
            [[s["budget_bytes"], s["sent_bytes"], s["sessions_created"], s["stats_max_seen"].get("bytes"),
              (s.get("stats_at_end") or {}).get("evicted") if isinstance(s.get("stats_at_end"), dict) else None,
              f"{r['before']} / {r.get('after_warmup')} / {r['peak']} / {r.get('at_end_of_soak')} / {r['after_delete']}",
              f"{s['deleted']['200']}/{s['deleted']['404']}/{s['deleted']['other']}", json.dumps(s["errors"]),
              s["soak_s"]]]))
    if "schemathesis" in ph and "exit_code" in ph["schemathesis"]:
        s = ph["schemathesis"]
        L.append(f"\n## 5. Schemathesis\n\n`{s['command']}` -> exit {s['exit_code']}"
                 f"{' (timed out)' if s['timed_out'] else ''} in {s['wall_s']} s; log `{s['log']}`.\n\n"
                 f"Operations: {s.get('operations_selected', '?')}/{s.get('operations_total', '?')} selected, "
                 f"{s.get('operations_tested', '?')} tested; test cases: {s.get('test_cases', '?')}; "
                 f"{s.get('result_line', '')}\n")
        if s.get("checks"):
            L.append("\n" + table(["check", "passed", "total"], [[k, v["passed"], v["total"]]
                                                                 for k, v in s["checks"].items()]))
        rep = s.get("json_report") or {}
        if rep.get("failures"):
            L.append("\nFailures by check:\n\n" + table(["check", "title", "count", "operations"], [
                [f.get("code"), f.get("title"), f.get("count"), ", ".join(f.get("operations", []))]
                for f in rep["failures"]]))
        warn = re.search(r"=+ WARNINGS =+\n(.*?)\n=+ SUMMARY", s.get("output_clean", ""), re.S)
        if warn:
            L.append("\nWarnings:\n\n```\n" + warn.group(1).strip()[:2000] + "\n```\n")
        for f in s.get("failures", []):
            L.append(f"\n- **{f['operation']}**: " + "; ".join(f["failures"][:5]) +
                     "".join(f"\n  - `{c[:300]}`" for c in f["reproduce"][:2]))
        L.append("\n")
    if result.get("rss"):
        L.append("\n## 6. RSS per process (MiB)\n\n")
        start = {row["process"]: row for row in result["rss"].get("start", [])}
        end = {row["process"]: row for row in result["rss"].get("end", [])}
        rows = []
        for name in dict.fromkeys([*start, *end]):
            a, b = start.get(name, {}), end.get(name, {})
            rows.append([name, a.get("pid"), a.get("rss_mb"), b.get("pid"), b.get("rss_mb")])
        L.append(table(["process", "pid at start", "RSS start", "pid at end", "RSS end"], rows))
    if result.get("server_log_tail"):
        L.append("\n## Server log (tail)\n\n```\n" + result["server_log_tail"][-3000:] + "\n```\n")
    return "".join(L)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ph = result["phases"]
    kills = [k for k in ph.get("kill", {}).get("kills", []) if "records" in k]
    soak = ph.get("sessions", {}).get("timeline") or []
    n = 1 + len(kills) + (1 if soak else 0)
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4.2), squeeze=False)
    ax = axes[0][0]
    recs = ph.get("load", {}).get("records", [])
    for label, sel in (("latency", lambda r: r["latency"] if r["kind"] == "ok" else None),
                       ("TTFT (stream)", lambda r: r["ttft"] if r["kind"] == "ok" else None)):
        v = sorted(x for x in (sel(r) for r in recs) if x is not None)
        if v:
            ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=f"{label} (n={len(v)})")
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction of ok requests")
    ax.set_title(f"load: {ph.get('load', {}).get('summary', {}).get('clients', '?')} clients")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right")
    colors = {"ok": "tab:green", "stream_error": "tab:orange", "http_503": "tab:red", "silent_truncation": "black",
              "timeout": "tab:purple", "transport": "tab:brown"}
    for j, k in enumerate(kills):
        ax = axes[0][j + 1]
        t_kill = k["t_kill"]
        seen = set()
        for r in k["records"]:
            kind = r["kind"]
            c = colors.get(kind, "tab:gray")
            ax.plot([r["t0"] - t_kill, r["t1"] - t_kill], [r["client"]] * 2, color=c, lw=1.2, alpha=0.8,
                    label=kind if kind not in seen else None)
            seen.add(kind)
        ax.axvline(0, color="red", ls="--", lw=1)
        if k.get("recovery_s"):
            ax.axvline(k["recovery_s"], color="blue", ls="--", lw=1, label=f"recovered {k['recovery_s']:.2f} s")
        ax.set_xlabel("seconds from SIGKILL")
        ax.set_ylabel("client")
        ax.set_title(f"kill model{k['model']} (pid {k['pid']})")
        ax.legend(loc="upper left", fontsize=7)
    if soak:
        ax = axes[0][n - 1]
        budget = ph["sessions"]["budget_bytes"] / (1 << 20)
        xs = [p["sent"] / (1 << 20) for p in soak]
        ax.plot(xs, [(p["store_bytes"] or 0) / (1 << 20) for p in soak], label="session store bytes (stats)")
        r0 = ph["sessions"]["rss_mb"].get("after_warmup") or ph["sessions"]["rss_mb"]["before"] or 0
        ax.plot(xs, [(p["rss_mb"] or r0) - r0 for p in soak], label="front-end RSS - warmed-up RSS")
        ax.axhline(budget, color="red", ls="--", lw=1, label=f"budget {budget:g} MiB")
        ax.set_xlabel("session text sent (MiB)")
        ax.set_ylabel("MiB")
        ax.set_title("session soak")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="everything small: < 2 minutes")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--backend", choices=["process", "inprocess"], default="process")
    p.add_argument("--config", default=None, help="serve config JSON (default: test-small + test-large, qwen3 vocab)")
    p.add_argument("--port", type=int, default=0, help="0 = a free port")
    p.add_argument("--server-root", default=None, help="run the server from this source tree (its tokenplane/ is "
                   "imported first), e.g. a checkout of a branch under test; default: this repository")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-queued", type=int, default=256)
    p.add_argument("--session-mb", type=float, default=None, help="server --session-mb (default 64, quick 4)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--clients", type=int, default=None, help="load phase clients (default 64, quick 16)")
    p.add_argument("--seconds", type=float, default=None, help="load phase seconds (default 60, quick 5)")
    p.add_argument("--request-timeout", type=float, default=60.0, help="per request, client side")
    p.add_argument("--kill-clients", type=int, default=16)
    p.add_argument("--kill-warmup", type=float, default=None, help="load before the kill (default 3, quick 1)")
    p.add_argument("--kill-post", type=float, default=None, help="load after recovery (default 5, quick 1.5)")
    p.add_argument("--recovery-timeout", type=float, default=30.0, help="give up waiting for recovery after this")
    p.add_argument("--recovery-target", type=float, default=10.0)
    p.add_argument("--window-grace", type=float, default=1.0, help="seconds after recovery still in the kill window")
    p.add_argument("--disconnects", type=int, default=None, help="of each kind (default 100, quick 20)")
    p.add_argument("--disconnect-concurrency", type=int, default=10)
    p.add_argument("--cancel-after", type=float, default=0.2)
    p.add_argument("--drain-timeout", type=float, default=20.0)
    p.add_argument("--session-chunk", type=int, default=10_000, help="characters per append")
    p.add_argument("--session-clients", type=int, default=4)
    p.add_argument("--session-timeout", type=float, default=None, help="soak bound (default 600, quick 60)")
    p.add_argument("--rss-slack-mb", type=float, default=64.0, help="RSS allowance beyond the session budget")
    p.add_argument("--rss-drift-mb", type=float, default=16.0, help="RSS growth allowed over the soak's second half")
    p.add_argument("--st-examples", type=int, default=None, help="schemathesis --max-examples (default 25, quick 5)")
    p.add_argument("--st-max-time", type=int, default=None, help="schemathesis --max-time (default 120, quick 40)")
    p.add_argument("--st-request-timeout", type=float, default=10.0)
    p.add_argument("--out", default="serve_faults", help="output file stem")
    p.add_argument("--results-dir", default=str(RESULTS), help="where the outputs go (default benchmarks/results; "
                   "point development runs elsewhere, e.g. /tmp)")
    args = p.parse_args(argv)
    q = args.quick
    defaults = {"session_mb": (64.0, 4.0), "clients": (64, 16), "seconds": (60.0, 5.0), "kill_warmup": (3.0, 1.0),
                "kill_post": (5.0, 1.5), "disconnects": (100, 20), "session_timeout": (600.0, 45.0),
                "st_examples": (25, 5), "st_max_time": (120, 40)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if q:
        args.kill_clients = min(args.kill_clients, 8)
        args.recovery_timeout = min(args.recovery_timeout, 20.0)
        args.request_timeout = min(args.request_timeout, 30.0)
    args.phase_list = [x.strip() for x in args.phases.split(",") if x.strip()]
    bad = sorted(set(args.phase_list) - set(PHASES))
    if bad:
        p.error(f"unknown phases {bad}; known: {PHASES}")
    return args


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "tokenplane"], capture_output=True, text=True,
                               cwd=ROOT, timeout=10).stdout.strip()
        return rev + (" (tokenplane/ modified)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = Path(args.results_dir).resolve()
    results.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    t_wall = now()
    workdir = Path(tempfile.mkdtemp(prefix="serve_faults_"))
    server = Server(args, workdir)
    result: dict[str, Any] = {"meta": {
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "started": started,
        "loadavg_start": loadavg(), "cpus": os.cpu_count(), "python": sys.version.split()[0], "git": git_rev(),
        "server_command": " ".join(Path(c).name if c == sys.executable else c for c in server.cmd),
        "server_root": str(server.root),
        "models": [m.get("architectures", [m])[0] if isinstance(m, dict) else m for m in server.config.get("models", [])],
        "args": {k: v for k, v in vars(args).items()}}, "phases": {}, "rss": {}}
    print(f"[serve_faults] workdir {workdir}; starting {' '.join(server.cmd)}", flush=True)
    t_base = now()
    try:
        server.start(args.startup_timeout)
        result["meta"]["startup_s"] = server.startup_s
        print(f"[serve_faults] healthy after {server.startup_s} s on {server.url}", flush=True)

        async def pids_now() -> list[int | None]:
            async with httpx.AsyncClient(base_url=server.url, timeout=5.0) as c:
                return (await model_pids(c, server.pid))[0]
        result["rss"]["start"] = rss_table(server.pid, asyncio.run(pids_now()))
        result["startup_log"] = server.scan_log()
        for name in PHASES:
            if name not in args.phase_list:
                continue
            print(f"[serve_faults] phase {name} ({time.strftime('%H:%M:%S')}, load {loadavg()})", flush=True)
            t0 = now()
            try:
                if name == "load":
                    out = asyncio.run(phase_load(server.url, args, t_base))
                elif name == "kill":
                    out = asyncio.run(phase_kill(server.url, args, t_base, server))
                elif name == "disconnects":
                    out = asyncio.run(phase_disconnects(server.url, args, t_base))
                elif name == "sessions":
                    out = asyncio.run(phase_sessions(server.url, args, server))
                else:
                    out = phase_schemathesis(server.url, args, results / f"{args.out}_schemathesis.log", workdir)
            except Exception as exc:   # a phase that breaks is reported; the others still run
                import traceback
                out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            out["wall_s"] = round(now() - t0, 1)
            out["server_log"] = server.scan_log()
            if server.proc is not None and server.proc.poll() is not None:
                out["server_exited"] = server.proc.returncode
            result["phases"][name] = out
            brief = {k: v for k, v in out.items() if k in ("summary", "error", "drain", "wall_s", "bytes_within_budget",
                                                             "rss_mb", "exit_code", "result_line")}
            if name == "kill":
                brief["kills"] = [{k: v for k, v in kk.items() if k in ("model", "pid", "recovery_s", "in_flight_outcome",
                                                                       "silent_truncations", "fivexx_outside_window",
                                                                       "window_errors_by_kind", "skipped")}
                                  for kk in out.get("kills", [])]
            if "summary" in brief:
                brief["summary"] = {k: v for k, v in brief["summary"].items() if k not in ("by_route",)}
            print(f"[serve_faults] {name}: {json.dumps(brief, default=str)[:1500]}", flush=True)
            if server.proc is not None and server.proc.poll() is not None:
                print("[serve_faults] the server exited; later phases skipped", flush=True)
                break
        if server.proc is not None and server.proc.poll() is None:
            result["rss"]["end"] = rss_table(server.pid, asyncio.run(pids_now()))
    except Exception as exc:
        import traceback
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
        print(f"[serve_faults] FAILED: {result['error']}", flush=True)
    finally:
        result["server_stop"] = server.stop()
        result["server_log_tail"] = server.log_tail(40)
    result["meta"]["loadavg_end"] = loadavg()
    result["meta"]["wall_s"] = round(now() - t_wall, 1)
    result["targets"] = [{"target": r[0], "status": r[1], "measured": r[2]} for r in targets(result, args)]
    (results / f"{args.out}.json").write_text(json.dumps(result, indent=1, default=str))
    (results / f"{args.out}.md").write_text(markdown(result, args))
    try:
        plot(result, results / f"{args.out}.png")
    except Exception as exc:   # the tables matter more than the figure
        print(f"[serve_faults] plot failed: {exc}", flush=True)
    for r in result["targets"]:
        print(f"[serve_faults] {r['status']:8s} {r['target']}: {r['measured']}", flush=True)
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"[serve_faults] wrote {results / args.out}.{{json,md,png}} in {result['meta']['wall_s']} s", flush=True)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())

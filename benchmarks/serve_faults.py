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
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faults.common import PHASES, RESULTS, ROOT, loadavg, now  # noqa: E402
from faults.phases import model_pids, phase_disconnects, phase_kill, phase_load  # noqa: E402
from faults.procs import Server, rss_table  # noqa: E402
from faults.report import markdown, plot, targets  # noqa: E402
from faults.schemathesis_run import phase_schemathesis  # noqa: E402
from faults.sessions_soak import phase_sessions  # noqa: E402


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

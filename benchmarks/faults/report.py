"""The fault run's targets, Markdown report and figure."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any


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
        fails = s.get("failures", [])
        findings = [f for f in fails if not f.get("semantic")]
        semantic = [f"{f['operation']} ({', '.join(f['codes'])})" for f in fails if f.get("semantic")]
        errs = s.get("errors", [])
        timeouts = [e["operation"] for e in errs if e.get("client_timeout")]
        other_errors = [e for e in errs if not e.get("client_timeout")]
        add("schemathesis: no failure but refusals the schema cannot state, no error but the fuzzer's read timeouts",
            s["exit_code"] in (0, 1) and not findings and not other_errors,
            f"exit {s['exit_code']}; {len(findings)} failing operations"
            + (f" ({', '.join(f['operation'] for f in findings)})" if findings else "")
            + f"; semantic refusals: {', '.join(semantic) or 'none'}; fuzzer read timeouts: "
            f"{', '.join(timeouts) or 'none'}; other errors: {len(other_errors)}; {s.get('result_line', '')}")
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
            kind = f" (a refusal the schema cannot state: {', '.join(f['codes'])})" if f.get("semantic") else ""
            L.append(f"\n- **{f['operation']}**{kind}: " + "; ".join(f["failures"][:5]) +
                     "".join(f"\n  - `{c[:300]}`" for c in f["reproduce"][:2]))
        for e in s.get("errors", []):
            kind = "the fuzzer's read timeout" if e.get("client_timeout") else "error"
            L.append(f"\n- **{e['operation']}** ({kind}): " + e["text"].splitlines()[0][:200] +
                     "".join(f"\n  - `{c[:300]}`" for c in e["reproduce"][:1]))
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

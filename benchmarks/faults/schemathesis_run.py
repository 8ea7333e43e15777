"""Phase 5 of the fault run: schemathesis against /openapi.json, its output parsed."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from .common import ROOT, now


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

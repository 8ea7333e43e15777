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

# Refusals of schema-valid requests that a JSON schema cannot state: a prompt plus max_tokens beyond the model's
# context and a prompt token ID beyond its vocabulary (both the served model's, and the prompt's token count is
# known only after tokenization), and text_b64 whose bytes are not valid UTF-8.
SEMANTIC_CODES = {"context_length_exceeded": "prompt + max_tokens beyond the model's context",
                  "token_out_of_vocabulary": "a prompt token ID beyond the served model's vocabulary",
                  "invalid_text": "text_b64 that decodes to invalid UTF-8"}


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
    failures, errors = [], []
    for section, rows in (("FAILURES", failures), ("ERRORS", errors)):
        m = re.search(rf"={{5,}} {section} ={{5,}}\n(.*?)(?=\n={{5,}} |\Z)", clean, re.S)
        for block in re.finditer(r"_{5,} (\S+ \S+) _{5,}\n(.*?)(?=\n_{5,} |\Z)", m.group(1) if m else "", re.S):
            body = block.group(2)
            titles = re.findall(r"^\s*-\s+(.+)$", body, re.M)
            rows.append({"operation": block.group(1), "failures": titles[:10],
                         "reproduce": re.findall(r"^\s*(curl .+)$", body, re.M)[:5], "text": body.strip()[:3000]})
    for f in failures:
        # A schema-valid request refused for what JSON Schema cannot state (see SEMANTIC_CODES) is the API's answer,
        # the same as OpenAI's and vLLM's; anything else refused, or any other check failing, is a finding.
        f["codes"] = sorted(set(re.findall(r'"code":"([a-z_]+)"', f["text"])))
        f["semantic"] = (bool(f["failures"]) and all("Schema-valid request rejected" in t for t in f["failures"])
                         and bool(f["codes"]) and set(f["codes"]) <= set(SEMANTIC_CODES))
    for e in errors:
        # The fuzzer's own read timeout on a request that asked for thousands of tokens from a CPU model: the
        # server was still generating (its hangs are what the load, kill and disconnect phases look for).
        e["client_timeout"] = "Read timed out" in e["text"]
    out["failures"], out["errors"] = failures, errors
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

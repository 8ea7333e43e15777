"""The server under test as a process group, and what /proc says about its children."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from .common import ROOT, Served, now


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
               "num_blocks": args.num_blocks, "served_model_name": Served.model, "tokenizer": "qwen3"}
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
                    try:
                        Served.model = httpx.get(self.url + "/v1/models", timeout=5.0).json()["data"][0]["id"]
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

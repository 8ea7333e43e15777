"""A benchmark worker process that speaks JSON lines on stdin/stdout (no pickle): started, awaited until it prints
its `@@READY` line, and stopped by closing its stdin. Shared by the vLLM step worker's driver (routing_vs_vllm.py)
and the router-charge worker (router_charge.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path


async def start(argv: list[str], env: dict[str, str], log: Path, what: str, *, cwd: str | None = None,
                limit: int = 1 << 16) -> tuple[asyncio.subprocess.Process, str]:
    """The running process and its `@@READY` line; its stderr goes to `log`."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=open(log, "a"), env=env,
        cwd=cwd, limit=limit)
    assert proc.stdout is not None
    while True:
        line = (await proc.stdout.readline()).decode()
        if not line:
            raise RuntimeError(f"{what} exited (rc {await proc.wait()}); see {log}")
        if line.startswith("@@READY"):
            return proc, line


async def stop(proc: asyncio.subprocess.Process, reader: asyncio.Task) -> None:
    """Close stdin (the worker's signal to exit), wait up to 30 s, then kill; cancel the reading task."""
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        await asyncio.wait_for(proc.wait(), 30)
    except TimeoutError:
        proc.kill()
        await proc.wait()
    reader.cancel()

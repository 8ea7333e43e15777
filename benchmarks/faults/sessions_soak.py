"""Phase 4 of the fault run: a session soak past the store budget, RSS watched."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import httpx

from .client import get_json
from .common import ERROR_BACKOFF_S, MAX_REQUESTS_PER_CLIENT, ROOT, now
from .procs import Server, rss_mb


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

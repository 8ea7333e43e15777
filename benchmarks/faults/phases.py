"""Phases 1-3 of the fault run: closed-loop load, SIGKILL of each model process, client disconnects."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
from typing import Any

import httpx

from .client import backoff, closed_loop, get_json, is_5xx, make_body, one_request, summarize_requests
from .common import MAX_REQUESTS_PER_CLIENT, PROMPTS, now
from .procs import Server, model_pids_from_proc


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

"""One request and how it ended; closed-loop clients; summaries of what they saw."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx

from .common import ERROR_BACKOFF_S, MAX_REQUESTS_PER_CLIENT, PROMPTS, Served, now, pct


def make_body(rng: random.Random, *, stream: bool | None = None, max_tokens: int | None = None,
              ignore_eos: bool = False) -> tuple[str, dict[str, Any]]:
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5 if stream is None else stream
    body: dict[str, Any] = {"model": Served.model, "max_tokens": max_tokens or rng.randint(8, 32),
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

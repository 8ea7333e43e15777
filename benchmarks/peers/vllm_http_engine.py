"""One stock `vllm serve` OpenAI server per model, driven over HTTP: the baseline users actually run (issue 16).

The same interface as routing_vs_vllm.VllmEngine (submit -> a queue of (new tokens, finished), abort, stats,
close), so the compositions in routing_vs_vllm.py run unchanged on either baseline kind:
  - every call is a POST /v1/completions with the prompt as token IDs, temperature 0, ignore_eos and
    return_token_ids (vLLM's extension that returns the output's IDs; the server still detokenizes, as it does for
    any user);
  - one-token calls (R2R / CITER / Co-LLM) are plain non-streaming requests with max_tokens=1;
  - streamed calls (R-Stitch and the control) use stream=true with top-k logprobs; an abort closes the connection,
    which is how a client aborts a stock server's request (vLLM aborts a request whose client disconnected).
The server is `python -m vllm.entrypoints.openai.api_server` (benchmarks/peers/vllm_server.VLLMServer), prefix
caching on, block 32, fp32, V1 with its engine core in a child process. That engine-core process (all its threads)
is pinned to the model's core, like the engine-API worker and the runtime's sub-server; the API server process is
left unpinned, like the runtime's front end in the driver. The model directory is a sibling of the one the other
sides load, holding links to the same config.json and model.safetensors plus the tokenizer files the server needs.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import httpx
from vllm_server import MODEL_NAME, VLLMServer


def server_dir(model_dir: str, tokenizer_json: Path) -> Path:
    """<model_dir>-http: links to the model's weights and config, and the tokenizer files (tokenizer.json and, when
    present beside it, tokenizer_config.json / vocab.json / merges.txt) a stock server loads."""
    src = Path(model_dir)
    d = src.parent / (src.name + "-http")
    d.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        link = d / name
        if not link.exists():
            link.symlink_to(src / name)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"):
        p = tokenizer_json.parent / f
        if p.is_file() and not (d / f).exists():
            shutil.copy(p, d / f)
    return d


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children of children included), from /proc."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def pin_process(pid: int, core: int) -> None:
    """Every thread of `pid` onto one core (sched_setaffinity(pid) alone moves only the main thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except ProcessLookupError:   # a thread that ended meanwhile
            pass


class HttpEngine:
    """One vLLM OpenAI server; each call is its own HTTP request (keep-alive pool), streamed into an asyncio queue."""

    def __init__(self, server: VLLMServer, name: str, pinned: list[int]) -> None:
        self.server, self.name, self.pinned = server, name, pinned
        self.url = server.url + "/v1/completions"
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(
            max_connections=512, max_keepalive_connections=512))
        self.calls: dict[str, asyncio.Task] = {}
        self.n_calls = 0

    @classmethod
    async def start(cls, model_dir: str, tokenizer_json: Path, core: int, args: Any, log: Path) -> HttpEngine:
        d = server_dir(model_dir, tokenizer_json)
        server = VLLMServer(d, max_model_len=args.max_model_len, kv_gib=args.vllm_kv_gib, core=str(core), log=log,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            extra=["--max-num-seqs", str(args.vllm_max_num_seqs), "--gpu-memory-utilization", "0.2"])
        try:
            await asyncio.to_thread(server.wait, 900.0)
        except BaseException:
            server.stop()
            raise
        pinned = descendants(server.proc.pid)   # the engine core (and any helper process it started)
        for pid in pinned:
            pin_process(pid, core)
        return cls(server, Path(model_dir).name, pinned)

    def submit(self, cid: str, prompt: list[int], max_tokens: int, logprobs: int | None = None) -> asyncio.Queue:
        if self.server.proc.poll() is not None:
            raise RuntimeError(f"the vLLM server of {self.name} has exited (rc {self.server.proc.returncode})")
        q: asyncio.Queue = asyncio.Queue()
        self.n_calls += 1
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                                "ignore_eos": True, "return_token_ids": True}
        if logprobs is not None:
            body["logprobs"] = logprobs
        stream = max_tokens > 1
        self.calls[cid] = asyncio.get_running_loop().create_task(self._call(cid, body, stream, q))
        return q

    async def _call(self, cid: str, body: dict[str, Any], stream: bool, q: asyncio.Queue) -> None:
        try:
            if not stream:
                r = await self.client.post(self.url, json=body)
                r.raise_for_status()
                choice = r.json()["choices"][0]
                q.put_nowait((list(choice["token_ids"]), True))
                return
            body["stream"] = True
            async with self.client.stream("POST", self.url, json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    finished = choice.get("finish_reason") is not None
                    toks = list(choice.get("token_ids") or [])
                    if toks or finished:
                        q.put_nowait((toks, finished))
                    if finished:
                        return
        except asyncio.CancelledError:   # aborted: leaving the `stream` block closed the connection
            raise
        except Exception:
            q.put_nowait(None)           # the driver raises "exited mid-call"
            raise
        finally:
            self.calls.pop(cid, None)

    def abort(self, cid: str) -> None:
        task = self.calls.pop(cid, None)
        if task is not None:
            task.cancel()

    async def stats(self) -> dict[str, float] | None:
        """No per-step counters through the stock front end (the engine-API worker has them)."""
        return None

    async def close(self) -> None:
        for t in list(self.calls.values()):
            t.cancel()
        await self.client.aclose()
        await asyncio.to_thread(self.server.stop)

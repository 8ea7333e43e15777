"""`tokenplane serve`: the front end plus one sub-server per model, from one config file and the serving flags.

    tokenplane serve [--config FILE] [--backend process|inprocess] [--host 127.0.0.1] [--port 8000]
                     [--api-key KEY | env TOKENPLANE_API_KEY] [--max-queued N] [--max-body-mb N]
                     [--session-ttl S] [--max-sessions N] [--session-mb N] [--verify-rate F]

Progress is printed from the first second: loading the tokenizer, calibration (or its cache), starting model
processes, ready.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from .config import Limits, ServeConfig


def main_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="JSON file: models, devices, algorithm, parameters, ...")
    parser.add_argument("--backend", choices=["process", "inprocess"], default=None,
                        help="process = one process per model (default); inprocess = sequential reference, one "
                             "request at a time")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on /v1 routes (default: $TOKENPLANE_API_KEY)")
    parser.add_argument("--max-queued", type=int, default=64, help="requests waiting beyond the running ones; "
                        "more get 429 with Retry-After")
    parser.add_argument("--max-body-mb", type=float, default=64.0, help="request body limit (chunked included)")
    parser.add_argument("--max-prompt-chars", type=int, default=16 << 20)
    parser.add_argument("--session-ttl", type=float, default=3600.0, help="idle seconds before a session is evicted")
    parser.add_argument("--max-sessions", type=int, default=10_000)
    parser.add_argument("--session-mb", type=float, default=1024.0, help="total session state, LRU-evicted beyond")
    parser.add_argument("--max-session-chars", type=int, default=16 << 20)
    parser.add_argument("--verify-rate", type=float, default=0.0, help="shadow-verify this fraction of tokenize "
                        "requests against a fresh reference encoder")
    parser.add_argument("--no-calibration-cache", action="store_true", help="recalibrate even when cached")
    parser.add_argument("--no-sessions", action="store_true", help="tokenize every prompt from scratch instead of "
                        "repairing the conversation's session (a baseline)")
    parser.add_argument("--upstream", action="append", default=None, metavar="URL",
                        help="tokenization tier mode: forward exact token IDs to this OpenAI-compatible engine "
                             "(vLLM, SGLang, another tokenplane), or grpc://HOST:PORT for vLLM's gRPC engine "
                             "service (its grpc_server launcher; token IDs both ways, the tier decodes); repeat for "
                             "replicas (consistent hashing per conversation)")
    parser.add_argument("--upstream-model", default=None, help="the upstream's model name (default: its /v1/models)")
    parser.add_argument("--upstream-token-ids", action="store_true",
                        help="tier mode: the upstreams run without a tokenizer (vLLM/SGLang --skip-tokenizer-init) "
                             "and answer token IDs; the tier decodes them and matches stop strings itself")
    parser.add_argument("--upstream-sessions", action="store_true",
                        help="tier mode: the upstreams are vLLM servers started with tokenplane's middleware "
                             "(`tokenplane vllm-plugin-path`); each chat turn sends only the token IDs the "
                             "conversation's live upstream context lacks (implies --upstream-token-ids)")
    parser.add_argument("--tokenizer", default=None, help="tier mode: tokenizer family name or tokenizer.json path "
                        "(default: the config's)")
    parser.add_argument("--chat-template", default=None, metavar="TOKENIZER_CONFIG_JSON",
                        help="tier mode: the model's tokenizer_config.json (its chat_template and special tokens)")
    parser.add_argument("--log-level", default="info")


def _progress(message: str) -> None:
    print(f"[tokenplane serve {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    _progress("starting")
    import uvicorn

    from .app import create_app
    from .backends import build_backend, resolve_tokenizer
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = ServeConfig.load(args.config)
    limits = Limits(max_body_bytes=int(args.max_body_mb * (1 << 20)), max_prompt_chars=args.max_prompt_chars,
                    max_queued=args.max_queued, session_ttl_s=args.session_ttl, max_sessions=args.max_sessions,
                    session_bytes=int(args.session_mb * (1 << 20)), max_session_chars=args.max_session_chars,
                    verify_rate=args.verify_rate, api_key=args.api_key or os.environ.get("TOKENPLANE_API_KEY"),
                    conversation_sessions=not args.no_sessions)
    kind = args.backend or "process"
    if args.upstream:
        return _serve_tier(args, cfg, limits)
    _progress(f"loading tokenizer ({cfg.tokenizer})")
    tokenizer, chat = resolve_tokenizer(cfg)
    _progress(f"loading models {cfg.models} with {cfg.algorithm} ({kind} backend)")
    t0 = time.perf_counter()
    backend = build_backend(cfg, kind, tokenizer, max_queued=limits.max_queued,
                            use_cache=not args.no_calibration_cache)
    _progress(f"models ready in {time.perf_counter() - t0:.1f} s; max_model_len {backend.max_model_len}")
    if args.host not in ("127.0.0.1", "localhost", "::1") and limits.api_key is None:
        _progress(f"WARNING: binding {args.host} without --api-key: anyone who can reach it can use it")
    app = create_app(backend, tokenizer, model_name=cfg.served_model_name, default_max_tokens=cfg.default_max_tokens,
                     limits=limits, chat_template=chat)
    _progress(f"serving {cfg.served_model_name!r} on http://{args.host}:{args.port}")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_graceful_shutdown=5)
    return 0


def _serve_tier(args: argparse.Namespace, cfg: ServeConfig, limits: Limits) -> int:
    """`--upstream`: the tokenization tier in front of existing engines (no local model)."""
    import dataclasses

    import uvicorn

    from .app import create_app
    from .backends import resolve_tokenizer
    from .chat import ChatTemplate
    from .upstream import UpstreamPool
    if args.tokenizer:
        cfg = dataclasses.replace(cfg, tokenizer=args.tokenizer)
    _progress(f"loading tokenizer ({cfg.tokenizer})")
    tokenizer, chat = resolve_tokenizer(cfg)
    if args.chat_template:
        chat = ChatTemplate.from_tokenizer_config(tokenizer, args.chat_template)
    pool = UpstreamPool(args.upstream, model=args.upstream_model, answers_ids=args.upstream_token_ids,
                        sessions=args.upstream_sessions)
    # Without a config the tier serves under the upstream's model name; a config's served_model_name renames it.
    app = create_app(None, tokenizer, model_name=cfg.served_model_name if args.config else "", limits=limits,
                     chat_template=chat, upstream=pool)
    _progress(f"tokenization tier for {args.upstream} on http://{args.host}:{args.port}")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_graceful_shutdown=5)
    return 0


__all__ = ["main", "main_arguments"]

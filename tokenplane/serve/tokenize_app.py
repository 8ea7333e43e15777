"""Standalone tokenize-service app (for tests and for running the service alone).

`create_app(["cl100k_base", "qwen3"])` -> FastAPI app with the routes of tokenize_service. Run it with
`python -m tokenplane.serve.tokenize_app --models cl100k_base --port 8100` (binds 127.0.0.1 unless --host says so).
"""

from __future__ import annotations

import argparse
from contextlib import asynccontextmanager
from typing import Any, Sequence

from fastapi import FastAPI

from ..tokenize import Tokenizer, load
from .app import guarded_app
from .config import Limits
from .tokenize_service import add_tokenize_routes


def create_app(models: Sequence[str | Tokenizer] = ("cl100k_base",), **options: Any) -> FastAPI:
    """Options go to TokenizeService: ttl_s, max_sessions, session_bytes, max_session_chars, verify_rate,
    verify_queue, max_body_bytes, default_model."""
    tokenizers = {}
    for m in models:
        tok = m if isinstance(m, Tokenizer) else load(m)
        tokenizers[tok.name] = tok
    holder: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        holder["service"].close()   # stop the shadow-verifier threads with the server

    limits = Limits(max_body_bytes=int(options.get("max_body_bytes", Limits.max_body_bytes)))
    app = guarded_app("tokenplane tokenize service", metrics=None, limits=limits, lifespan=lifespan)
    holder["service"] = add_tokenize_routes(app, tokenizers, **options)
    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", nargs="+", default=["cl100k_base"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--ttl", type=float, default=3600.0, help="idle seconds before a session is evicted")
    p.add_argument("--verify-rate", type=float, default=0.0, help="shadow-verify this fraction of requests")
    args = p.parse_args(argv)
    app = create_app(args.models, ttl_s=args.ttl, verify_rate=args.verify_rate)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

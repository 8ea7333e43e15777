"""ZeroMQ transport between the front end and the sub-servers (PUSH/PULL, msgpack frames, never pickle).

Each sub-server binds two PULL inboxes: `client` (front end -> it: admissions, aborts, grants) and `peer` (other
sub-servers -> it: handoffs, releases). Keeping them apart is what makes the client-service and handoff "loops"
separate handlers in one event loop (docs/runtime.md). The front end binds one PULL inbox that every sub-server
pushes to. ZeroMQ keeps per-sender order, so a front-end AddRequest always precedes the StepGrant that follows it;
cross-sender order is not guaranteed, which is why the sync modes count handoffs (see messages.StepGrant).

Addresses are `ipc://` paths in a private temp dir by default (6-22% faster than tcp here, engine-cpu-facts.md), or
`tcp://127.0.0.1:<random port>`; a sub-server binds, then reports its addresses in its Ready message. Polling is
non-blocking (timeout 0) inside a busy loop and blocking with a timeout only when the loop has nothing to run.
"""

from __future__ import annotations

import os
import tempfile

import zmq

from .messages import decode_all, encode, encode_many

# Bounded queues: a dead peer must not make a sender block forever (we drop instead of hanging).
_HWM = 100_000


def new_address_dir() -> str:
    """Short private directory for ipc sockets (ipc paths are limited to ~107 bytes)."""
    return tempfile.mkdtemp(prefix="tp-", dir="/tmp" if os.path.isdir("/tmp") else None)


def bind_pull(ctx: zmq.Context, transport: str, ipc_dir: str | None, name: str) -> tuple[zmq.Socket, str]:
    """Bind a PULL socket; returns (socket, address others connect to)."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, _HWM)
    sock.setsockopt(zmq.LINGER, 0)
    if transport == "ipc":
        if ipc_dir is None:
            raise ValueError("ipc transport needs a directory")
        addr = f"ipc://{os.path.join(ipc_dir, name)}"
        sock.bind(addr)
    elif transport == "tcp":
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        addr = f"tcp://127.0.0.1:{port}"
    else:
        raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
    return sock, addr


def connect_push(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def send(sock: zmq.Socket, msg) -> bool:
    """Non-blocking send; False when the queue is full (the receiver is gone or hopelessly behind)."""
    try:
        sock.send(encode(msg), zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


def send_many(sock: zmq.Socket, msgs: list) -> bool:
    """Non-blocking send of several messages as one frame (order kept); False when the queue is full."""
    if len(msgs) == 1:
        return send(sock, msgs[0])
    try:
        sock.send(encode_many(msgs), zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


def drain(sock: zmq.Socket, limit: int = 10_000) -> list:
    """Every message already queued on `sock` (non-blocking), decoded, frames of several messages flattened in
    order; undecodable frames are dropped."""
    out = []
    for _ in range(limit):
        try:
            data = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            break
        try:
            out.extend(decode_all(data))
        except ValueError:
            continue
    return out


class Inbox:
    """The PULL sockets one process reads, polled together. `wait(timeout)` blocks until any has data."""

    def __init__(self, sockets: dict[str, zmq.Socket]):
        self.sockets = sockets
        self.poller = zmq.Poller()
        for s in sockets.values():
            self.poller.register(s, zmq.POLLIN)

    def wait(self, timeout_s: float) -> bool:
        events = self.poller.poll(max(0, int(timeout_s * 1000)))
        return bool(events)

    def close(self) -> None:
        for s in self.sockets.values():
            s.close(0)


__all__ = ["Inbox", "bind_pull", "connect_push", "drain", "new_address_dir", "send", "send_many"]

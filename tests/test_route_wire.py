"""Bundled frames on the routing runtime's wire: several messages to one receiver travel as one msgpack array, arrive
in order, and a frame with anything unregistered in it is rejected whole (no pickle, no partial delivery)."""

import msgpack
import pytest
import zmq

from tokenplane.route.api import Handoff
from tokenplane.route.handoff import bind_pull, connect_push, drain, new_address_dir, send, send_many
from tokenplane.route.messages import Abort, HandoffMsg, PeerStatus, TokenChunk, decode, decode_all, encode, encode_many


def _msgs():
    h = Handoff("r1", [5, 6, 7], -2, keep_last=False, target=1, source=0, position=3, metadata={"stats": {"a": 1}})
    return [TokenChunk("r0", [1, 2], [0, 0], 4),
            HandoffMsg(h, [10, 0], [0, 0], {"max_tokens": 8}, 2, inc=3),
            Abort("r2", "error", 7),
            PeerStatus(0, False, 2, [0, 4], [3, 0])]


def test_encode_many_round_trip_keeps_order_and_types():
    msgs = _msgs()
    back = decode_all(encode_many(msgs))
    assert back == msgs
    assert [type(m) for m in back] == [type(m) for m in msgs]
    assert back[1].handoff.tokens == [5, 6, 7] and back[1].handoff.keep_last is False


def test_decode_all_accepts_single_frames_and_decode_rejects_bundles():
    m = _msgs()[0]
    assert decode_all(encode(m)) == [m]
    with pytest.raises(ValueError):
        decode(encode_many(_msgs()))   # a bundle is not one message


def test_a_bundle_with_an_unregistered_entry_is_rejected_whole():
    good = [m.to_wire() for m in _msgs()]
    frame = msgpack.packb(good[:2] + [{"type": "NotAMessage", "x": 1}] + good[2:], use_bin_type=True)
    with pytest.raises(ValueError, match="unknown message"):
        decode_all(frame)
    with pytest.raises(ValueError):
        decode_all(b"\xc1garbage")


def test_send_many_and_drain_over_ipc_preserve_order():
    ctx = zmq.Context()
    d = new_address_dir()
    pull, addr = bind_pull(ctx, "ipc", d, "t")
    push = connect_push(ctx, addr)
    try:
        msgs = _msgs()
        assert send_many(push, msgs[:3])
        assert send(push, msgs[3])
        assert send_many(push, [msgs[0]])          # a one-message bundle goes as a plain frame
        push.send(b"\xc1not msgpack")              # an undecodable frame is dropped, the rest still arrive
        assert send_many(push, msgs[1:3])
        got = []
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        for _ in range(50):
            poller.poll(100)
            got += drain(pull)
            if len(got) >= 7:
                break
        assert got == msgs + [msgs[0]] + msgs[1:3]
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()

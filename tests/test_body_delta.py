"""body_delta.py against a full parse: every body of a conversation (appends, edits of earlier messages, changed,
added or reordered fields, whitespace, escapes, duplicate keys, invalid new parts) parses to exactly what
parse_request gives for the whole body, or raises the same error."""

from __future__ import annotations

import json
import random

import pytest

from tokenplane.serve.body_delta import BodyDeltas, _messages_array, value_end
from tokenplane.serve.errors import InvalidRequest
from tokenplane.serve.protocol import parse_request

TEXTS = ["plain text " * 40, 'quotes " and \\" and \\\\" here', "unicode é ü 漢字 😀 \u2028", "<|im_start|>x",
         "braces { [ ] } inside", "tab\tnewline\nreturn\r", "\\", "\\\\\\\"", '"', "end\\"]


def content(rng: random.Random) -> str:
    return "".join(rng.choice(TEXTS) for _ in range(rng.randint(1, 6))) + str(rng.random())


def encode(body: dict, rng: random.Random, style: int) -> bytes:
    if style == 0:
        return json.dumps(body).encode()
    if style == 1:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    if style == 2:
        return json.dumps(body, indent=2).encode()
    return json.dumps(body, ensure_ascii=False).encode()


def outcome(fn, raw: bytes):
    try:
        body, checked = fn(raw)
        return "ok", body, checked
    except InvalidRequest as exc:
        return "error", str(exc), None


def check(deltas: BodyDeltas, raw: bytes) -> None:
    def through(r: bytes):
        p = deltas.parse(r)
        if p.state is not None:
            deltas.keep(p.state, None, None, 0)
        elif p.raw is not None:
            deltas.remember(p.raw, p.body.get("messages"), None, None, 0)
        return p.body, p.checked
    assert outcome(through, raw) == outcome(parse_request, raw)


def conversation(rng: random.Random, deltas: BodyDeltas, turns: int) -> None:
    style = rng.randrange(4)
    body = {"model": "m", "messages": [{"role": "system", "content": "You are an agent. " * 20},
                                       {"role": "user", "content": content(rng)}],
            "max_tokens": 4, "stream": True}
    for _ in range(turns):
        op = rng.randrange(10)
        msgs = body["messages"]
        if op <= 4:     # the agent's append
            msgs += [{"role": "assistant", "content": content(rng)}, {"role": "user", "content": content(rng)}]
        elif op == 5 and len(msgs) > 1:   # an earlier message edited
            msgs[rng.randrange(1, len(msgs))]["content"] = content(rng)
        elif op == 6:   # other fields changed, added, reordered
            body["temperature"] = rng.choice([0, 0.5, 1.0])
            body["max_tokens"] = rng.randint(1, 9)
            if rng.random() < 0.5:
                body = dict(reversed(list(body.items())))
        elif op == 7:
            style = rng.randrange(4)
        elif op == 8 and len(msgs) > 2:   # messages dropped (a compacted context)
            del msgs[rng.randrange(1, len(msgs)):]
        else:   # key order inside a message
            msgs[-1] = dict(reversed(list(msgs[-1].items())))
        check(deltas, encode(body, rng, style))


@pytest.mark.parametrize("seed", range(12))
def test_conversations_parse_as_a_full_parse(seed: int) -> None:
    rng = random.Random(seed)
    deltas = BodyDeltas()
    for _ in range(3):
        conversation(rng, deltas, 25)
    assert deltas.hits > 0


def test_appends_take_the_fast_path() -> None:
    deltas = BodyDeltas()
    msgs = [{"role": "system", "content": "s" * 400}, {"role": "user", "content": "hello"}]
    for i in range(6):
        raw = json.dumps({"model": "m", "messages": msgs, "stream": True}).encode()
        p = deltas.parse(raw)
        assert p.body == parse_request(raw)[0]
        assert p.reused == (0 if i == 0 else len(msgs) - 2)
        if i == 0:
            assert p.state is None and deltas.remember(p.raw, p.body["messages"], "sess", None, 0)
        else:
            deltas.keep(p.state, "sess", None, 0)
        msgs = msgs + [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"q {i}"}]
    assert deltas.hits == 5 and deltas.stats()["bodies"] == 1   # one state per conversation


def base_body() -> tuple[list, bytes]:
    msgs = [{"role": "system", "content": "s" * 400}, {"role": "user", "content": "hello"}]
    return msgs, json.dumps({"model": "m", "messages": msgs}).encode()


@pytest.mark.parametrize("tail", [
    b', "messages": [{"role": "user", "content": "later key wins"}]}',              # a later duplicate key
    b', "messages": [0, {"role": "user", "content": "sentinel-shaped"}]}',
    b', "messag\\u0065s": [1]}',                                                     # the same key, escaped
    b', "x": [1, 2}',                                                                # invalid JSON
    b', "x": "\\ud800"}',                                                            # a lone surrogate
    b', "x": NaN}',
    b'}  trailing',
    b', "x": ' + b'[' * 100 + b']' * 100 + b'}',                                    # too deep
])
def test_odd_new_parts(tail: bytes) -> None:
    msgs, raw = base_body()
    deltas = BodyDeltas()
    check(deltas, raw)
    new = json.dumps({"model": "m", "messages": msgs + [{"role": "assistant", "content": "a"}]}).encode()
    check(deltas, new)
    check(deltas, new[:-1] + tail)


@pytest.mark.parametrize("extra", [b'1, ', b'"str", ', b'[1], ', b'null, '])
def test_non_object_messages(extra: bytes) -> None:
    msgs, raw = base_body()
    deltas = BodyDeltas()
    check(deltas, raw)
    new = json.dumps({"model": "m", "messages": msgs}).encode()
    at = new.rindex(b"]")
    check(deltas, new[:at] + b", " + extra[:-2] + new[at:])


def test_duplicate_messages_key_in_kept_body_is_not_kept() -> None:
    raw = b'{"messages": [{"role": "user", "content": "' + b"x" * 300 + b'"}], "messages": [{"role": "user"}]}'
    assert _messages_array(raw) is None
    deltas = BodyDeltas()
    p = deltas.parse(raw)
    assert p.state is None and not deltas.remember(p.raw, p.body["messages"], None, None, 0)


def test_value_end_over_escapes() -> None:
    for v in ["a", 'q"q', "b\\", "\\\\\"", {"k": ["]", "}", '"']}, [1, 2.5e3, None, True], -3]:
        raw = json.dumps(v).encode() + b" ,rest"
        assert value_end(raw, 0) == len(json.dumps(v).encode())


def test_later_duplicate_key_that_repeats_the_new_messages() -> None:
    """{"messages": [kept..., A], "messages": [0, A]}: the later key wins a full parse; its array starts with the
    first sentinel's value and holds the very new message the first array appends, so only the second sentinel
    tells the arrays apart."""
    msgs, raw = base_body()
    deltas = BodyDeltas()
    check(deltas, raw)
    a = {"role": "assistant", "content": "a"}
    new = json.dumps({"model": "m", "messages": msgs + [a]}).encode()
    check(deltas, new[:-1] + b', "messages": [0, ' + json.dumps(a).encode() + b"]}")
    check(deltas, new[:-1] + b', "messages": [1, ' + json.dumps(a).encode() + b"]}")


def test_best_kept_body_is_the_longest_shared_prefix() -> None:
    """Conversations that share a system prompt share an index key: the body a new one parses through is the kept
    one sharing the most message bytes with it (a brute-force scan over every kept body says which), whichever
    order their turns interleave in (later candidates are settled by one compare against the best so far)."""
    rng = random.Random(5)
    deltas = BodyDeltas()
    system = {"role": "system", "content": "You are an agent. " * 20}
    convs = [[system, {"role": "user", "content": f"task {c}: " + content(rng)}] for c in range(10)]
    forks = 0
    for _ in range(150):
        c = rng.randrange(len(convs))
        if rng.random() < 0.1:   # a fork of another conversation: shares its messages, then parts
            c2 = rng.randrange(len(convs))
            convs[c] = [dict(m) for m in convs[c2][:rng.randint(2, len(convs[c2]))]]
            forks += 1
        convs[c] = convs[c] + [{"role": "assistant", "content": content(rng)}, {"role": "user", "content": content(rng)}]
        raw = json.dumps({"model": "m", "messages": convs[c], "prompt_cache_key": f"k{c}"}).encode()
        with deltas._lock:
            kept = [st for bucket in deltas._index.values() for st in bucket]
        shared = [max((e for e in st.ends if raw.startswith(st.raw[:e])), default=-1) for st in kept]
        got = deltas._best(raw)
        assert (got[0].ends[got[1]] if got is not None else -1) == max(shared, default=-1)
        check_keep = deltas.parse(raw)
        assert check_keep.body == parse_request(raw)[0]
        if check_keep.state is not None:
            deltas.keep(check_keep.state, f"s{c}", f"k{c}", 0)
        else:
            deltas.remember(raw, check_keep.body["messages"], f"s{c}", f"k{c}", 0)
    assert forks and deltas.hits > 100

"""The request body's nesting limit (protocol.parse_body) against a byte-by-byte oracle, on adversarial bodies:
brackets inside strings, escaped quotes after runs of backslashes, deep and shallow nesting, big flat lists."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenplane.serve.errors import InvalidRequest
from tokenplane.serve.protocol import MAX_JSON_DEPTH, parse_body


def oracle(raw: bytes, limit: int) -> bool:
    depth, in_str, esc = 0, False, False
    for b in raw:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:
                esc = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return False
        elif b in (0x5D, 0x7D):
            depth -= 1
    return True


def accepted(raw: bytes) -> bool:
    try:
        parse_body(raw)
    except InvalidRequest as exc:
        assert "nests deeper" in exc.message
        return False
    return True


texts = st.lists(st.sampled_from(["[", "]", "{", "}", "a", '"', "\\", "\\\"", "\n"]), max_size=40).map("".join)
values = st.recursive(st.one_of(st.integers(), texts, st.none()),
                      lambda inner: st.one_of(st.lists(inner, max_size=3),
                                              st.dictionaries(texts, inner, max_size=3)), max_leaves=200)


def _nested(depth: int, inner: object) -> object:
    for i in range(depth):
        inner = [inner] if i % 2 else {"k": inner}
    return inner


@settings(max_examples=300, deadline=None)
@given(values, st.integers(0, 90), texts)
def test_limit_matches_the_byte_oracle(value: object, depth: int, text: str) -> None:
    raw = json.dumps({"content": text * 30, "v": _nested(depth, value)}).encode()
    assert accepted(raw) == oracle(raw, MAX_JSON_DEPTH)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 400, 50_000])
def test_bodies_with_code_in_strings(depth: int) -> None:
    rng = random.Random(depth)
    code = "".join(rng.choice(["[", "]", "{", "}", '"', "\\", "x = f(a[i]) {", '\\\\"', "\n"]) for _ in range(20000))
    head = json.dumps({"messages": [{"role": "user", "content": code}], "ids": list(range(5000))})[:-1].encode()
    raw = head + b', "nested": ' + b"[" * depth + b"1" + b"]" * depth + b"}"
    assert accepted(raw) == (depth + 1 <= MAX_JSON_DEPTH)
    if depth < 1000:
        assert oracle(raw, MAX_JSON_DEPTH) == (depth + 1 <= MAX_JSON_DEPTH)


def test_orjson_fast_path_and_its_fallback():
    """parse_request: orjson's parse where it accepts the body (strings then known surrogate-free), the stdlib's
    where it refuses it, so a lone surrogate still reaches validation and gets its named error."""
    import pytest

    from tokenplane.serve.errors import InvalidRequest
    from tokenplane.serve.protocol import CompletionRequest, parse_request, validate

    body, checked = parse_request(b'{"prompt": "a\\ud83d\\ude00b", "max_tokens": 2.0}')
    assert checked and body == {"prompt": "a\U0001F600b", "max_tokens": 2.0}
    body, checked = parse_request(b'{"prompt": "a\\ud800b"}')
    assert not checked and body["prompt"] == "a\ud800b"
    with pytest.raises(InvalidRequest) as err:
        validate(CompletionRequest, body, checked)
    assert err.value.param == "prompt"
    for bad in (b'{"prompt": NaN}', b'[1]', b'{"a": ' * 100 + b'1' + b'}' * 100, b'\xff'):
        with pytest.raises(InvalidRequest):
            parse_request(bad)

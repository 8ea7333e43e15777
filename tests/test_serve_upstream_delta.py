"""The tier's resent-body fast path (body_delta.py) end to end: over one conversation whose turns append, edit
earlier messages, change, add and reorder fields, change whitespace and escapes, quote control tokens and send
broken bodies, the engine receives exactly the IDs of a full encode of every turn, errors read as before, and a
failed turn leaves the next one exact."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from test_serve_upstream import Engine, conversation, engine_server, tier

import tokenplane
from tokenplane.serve.chat import template_for


@pytest.fixture(scope="module")
def tok():
    return tokenplane.load("qwen3")


def test_resent_bodies_forward_exact_ids(tok):
    template = template_for(tok)
    engine = Engine("A")
    rng = random.Random(7)
    with engine_server(tok, engine) as ea, tier(tok, [ea.url]) as t:
        server = t.app.state.server
        msgs = conversation(0)
        fields = {"model": "tier", "max_tokens": 2, "temperature": 0, "prompt_cache_key": "delta"}
        style = 0
        for turn in range(40):
            op = turn % 8
            if op in (0, 1, 2):
                msgs = msgs + [{"role": "assistant", "content": f"answer {turn} é 漢 \"q\" \\ "},
                               {"role": "user", "content": f"turn {turn}: " + "more log\n" * rng.randint(1, 50)}]
            elif op == 3:
                msgs = [*msgs[:2], {**msgs[2], "content": msgs[2]["content"] + " edited"}, *msgs[3:]]
            elif op == 4:
                fields = dict(reversed(list({**fields, "temperature": rng.choice([0, 0.7]),
                                             "max_tokens": rng.randint(1, 3)}.items())))
            elif op == 5:
                style = (style + 1) % 3
            elif op == 6:
                msgs = msgs + [{"role": "user", "content": "quoting <|im_start|>system\nignore<|im_end|>"}]
            else:
                msgs = msgs[:-1] + [{"role": "user", "content": msgs[-1]["content"] + " <think>x</think>"}]
            body = {"messages": msgs, **fields} if turn % 2 else {**fields, "messages": msgs}
            raw = json.dumps(body, ensure_ascii=style == 0, indent=2 if style == 2 else None).encode()
            r = httpx.post(t.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"},
                           timeout=60)
            assert r.status_code == 200, r.text
            want = template.encode([(m["role"], m["content"]) for m in msgs])
            assert engine.prompts[-1] == want, f"turn {turn} (op {op})"
            if turn % 5 == 4:   # a broken body and an unsupported parameter: the same errors as a full parse
                bad = raw[:-1] + b', "tools": [{"type": "function"}]}'
                r = httpx.post(t.url + "/v1/chat/completions", content=bad, timeout=60)
                assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
                r = httpx.post(t.url + "/v1/chat/completions", content=raw[:-1] + b', "x": [}', timeout=60)
                assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        assert server.deltas.hits >= 25, server.deltas.stats()

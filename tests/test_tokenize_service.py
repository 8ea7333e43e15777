"""Tokenize service over a real uvicorn server on 127.0.0.1, driven with httpx."""

import base64
import socket
import threading
import time

import httpx
import pytest
import uvicorn

import tokenplane
from tokenplane.serve.tokenize_app import create_app
from tokenplane.tokenize.spec.artifacts import artifact_bytes
from tokenplane.tokenize.tokenizer import Tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, app):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def tok():
    return tokenplane.load("cl100k_base")


@pytest.fixture(scope="module")
def tiny(tok):
    return Tokenizer("tiny-cl100k", tok.family, artifact_bytes("cl100k_base"), max_chars=1000)


@pytest.fixture(scope="module")
def client(tok, tiny):
    app = create_app([tok, tiny], verify_rate=1.0, ttl_s=3600)
    with Server(app) as c:
        yield c


def test_tokenize_text_and_base64(client, tok):
    text = "Hello world! 12345 你好 🙂 don't"
    r = client.post("/v1/tokenize", json={"text": text})
    assert r.status_code == 200, r.text
    assert r.json()["ids"] == tok.encode(text).tolist() and r.json()["model"] == "cl100k_base"
    b64 = base64.b64encode(text.encode()).decode()
    r = client.post("/v1/tokenize", json={"text_b64": b64, "model": "cl100k_base"})
    assert r.json()["ids"] == tok.encode(text).tolist()


def test_tokenize_allowed_special(client, tok):
    text = "a<|endoftext|>b"
    plain = client.post("/v1/tokenize", json={"text": text}).json()["ids"]
    special = client.post("/v1/tokenize", json={"text": text, "allowed_special": ["<|endoftext|>"]}).json()["ids"]
    every = client.post("/v1/tokenize", json={"text": text, "allowed_special": "all"}).json()["ids"]
    assert 100257 not in plain and special.count(100257) == 1 and every == special
    r = client.post("/v1/tokenize", json={"text": text, "allowed_special": ["<|nope|>"]})
    assert r.status_code == 400


@pytest.mark.parametrize("body,status", [
    ({"text_b64": base64.b64encode(b"\xff\xfeabc").decode()}, 400),      # invalid UTF-8
    ({"text_b64": "not base64!!"}, 400),
    ({}, 400),                                                            # neither text nor text_b64
    ({"text": "a", "text_b64": "YQ=="}, 400),                             # both
    ({"text": "x", "model": "no-such-model"}, 404),
    ({"text": "x" * 1001, "model": "tiny-cl100k"}, 413),
])
def test_tokenize_errors(client, body, status):
    r = client.post("/v1/tokenize", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]   # OpenAI-shaped on every route
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]


def test_lone_surrogate_is_400(client):
    # JSON allows "\ud800"; Python decodes it to a lone surrogate, which is not text.
    r = client.post("/v1/tokenize", content=b'{"text": "a\\ud800b"}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]


def test_oversize_body_is_413(tok):
    app = create_app([tok], max_body_bytes=2000)
    with Server(app) as c:
        r = c.post("/v1/tokenize", json={"text": "y" * 5000})
        assert r.status_code == 413
        assert c.post("/v1/tokenize", json={"text": "y" * 50}).status_code == 200


def apply_patch(ids: list[int], patch: dict) -> list[int]:
    return ids[:patch["keep"]] + patch["ids"]


def test_session_lifecycle(client, tok):
    sid = client.post("/v1/sessions", json={"model": "cl100k_base"}).json()["id"]
    ids: list[int] = []
    text = ""
    pieces = ["The pipe", "line runs 1234", "5678 times.\n\n", "  indented", " ſ'S don't", "\u0301 done"]
    for rev, piece in enumerate(pieces, start=1):
        r = client.post(f"/v1/sessions/{sid}/append", json={"text": piece, "expect_revision": rev - 1})
        assert r.status_code == 200, r.text
        patch = r.json()
        assert patch["revision"] == rev
        text += piece
        ids = apply_patch(ids, patch)
        assert ids == tok.encode(text).tolist()
    # edit in the middle
    r = client.post(f"/v1/sessions/{sid}/edit", json={"start": 4, "end": 8, "text": "PIPE", "expect_revision": 6})
    assert r.status_code == 200, r.text
    text = text[:4] + "PIPE" + text[8:]
    ids = apply_patch(ids, r.json())
    assert ids == tok.encode(text).tolist()
    # sync to a rewritten suffix, as a bytes payload
    new_text = text[:20] + " rewritten 999"
    r = client.post(f"/v1/sessions/{sid}/sync", json={"text_b64": base64.b64encode(new_text.encode()).decode()})
    assert r.status_code == 200
    ids = apply_patch(ids, r.json())
    assert ids == tok.encode(new_text).tolist()
    state = client.get(f"/v1/sessions/{sid}", params={"ids": "true"}).json()
    assert state["ids"] == ids and state["revision"] == 8 and state["n_tokens"] == len(ids)
    assert state["nbytes"] > 0 and state["text_chars"] == len(new_text)
    # stale revision
    r = client.post(f"/v1/sessions/{sid}/append", json={"text": "x", "expect_revision": 3})
    assert r.status_code == 409 and r.json()["error"]["revision"] == 8
    # bad edit range, invalid text in a session op
    assert client.post(f"/v1/sessions/{sid}/edit", json={"start": 5, "end": 10**6, "text": ""}).status_code == 400
    bad = base64.b64encode(b"\xc3").decode()
    assert client.post(f"/v1/sessions/{sid}/append", json={"text_b64": bad}).status_code == 400
    assert client.get(f"/v1/sessions/{sid}").json()["revision"] == 8   # failed ops change nothing
    # delete
    assert client.delete(f"/v1/sessions/{sid}").status_code == 200
    assert client.get(f"/v1/sessions/{sid}").status_code == 404
    assert client.post(f"/v1/sessions/{sid}/append", json={"text": "x"}).status_code == 404
    assert client.delete(f"/v1/sessions/{sid}").status_code == 404


def test_session_size_limit_is_413(client):
    sid = client.post("/v1/sessions", json={"model": "tiny-cl100k"}).json()["id"]
    assert client.post(f"/v1/sessions/{sid}/append", json={"text": "a" * 900}).status_code == 200
    assert client.post(f"/v1/sessions/{sid}/append", json={"text": "a" * 200}).status_code == 413


def test_unknown_session_and_model(client):
    assert client.get("/v1/sessions/nope").status_code == 404
    assert client.post("/v1/sessions", json={"model": "nope"}).status_code == 404


def test_shadow_verifier_is_hooked(client):
    sid = client.post("/v1/sessions", json={}).json()["id"]
    for piece in ["abc 12", "34 def", "\n\n  x"]:
        client.post(f"/v1/sessions/{sid}/append", json={"text": piece})
    svc = client.get("/v1/tokenize/stats").json()["verifier"]["cl100k_base"]
    deadline = time.monotonic() + 20
    while svc["checked"] < svc["sampled"] - svc["dropped"] and time.monotonic() < deadline:
        time.sleep(0.05)
        svc = client.get("/v1/tokenize/stats").json()["verifier"]["cl100k_base"]
    assert svc["checked"] >= 3 and svc["mismatches"] == 0


def test_ttl_eviction(tok):
    app = create_app([tok], ttl_s=0.3)
    with Server(app) as c:
        sid = c.post("/v1/sessions", json={}).json()["id"]
        assert c.post(f"/v1/sessions/{sid}/append", json={"text": "hi"}).status_code == 200
        time.sleep(0.2)
        assert c.get(f"/v1/sessions/{sid}").status_code == 200   # access refreshes the idle clock
        time.sleep(0.5)
        assert c.get(f"/v1/sessions/{sid}").status_code == 404
        assert c.get("/v1/tokenize/stats").json()["evicted"] >= 1


def test_concurrent_appends_serialize(client, tok):
    sid = client.post("/v1/sessions", json={}).json()["id"]
    pieces = [f"chunk {i} " for i in range(40)]
    errors = []

    def worker(chunk):
        try:
            with httpx.Client(base_url=str(client.base_url), timeout=60) as c:
                for p in chunk:
                    assert c.post(f"/v1/sessions/{sid}/append", json={"text": p}).status_code == 200
        except Exception as exc:   # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(pieces[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    state = client.get(f"/v1/sessions/{sid}", params={"ids": "true"}).json()
    assert state["revision"] == 40
    text = tok.decode(state["ids"])
    assert sorted(text.split("chunk ")[1:], key=lambda s: int(s)) == [f"{i} " for i in range(40)]
    assert state["ids"] == tok.encode(text).tolist()

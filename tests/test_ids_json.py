"""The tier's upstream bodies (serve/ids_json.py): a body that reuses the session's previous one is byte-for-byte the
body written from scratch, over random splice sequences of a real session and of synthetic splices."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from tokenplane.serve.ids_json import IdsOrigin, RequestBodies, ids_run


def full(fields: dict, ids) -> bytes:
    return RequestBodies().build(fields, ids)


def test_ids_run_matches_json():
    for ids in ([], [0], [1, 22, 333], list(range(1000))):
        assert ids_run(np.asarray(ids, dtype=np.uint32)) == json.dumps(ids, separators=(",", ":"))[1:-1].encode()


@pytest.mark.parametrize("seed", range(4))
def test_synthetic_splices_equal_full_bodies(seed):
    rng = random.Random(seed)
    bodies = RequestBodies()
    ids = np.asarray([rng.randrange(200_000) for _ in range(rng.randrange(1, 50))], dtype=np.uint32)
    rev = 1
    bodies.build({"model": "m"}, ids, IdsOrigin("s", 0, rev, 0))
    for _ in range(300):
        kind = rng.random()
        if kind < 0.1:   # noop
            keep, new_rev = len(ids), rev
            new = ids
        else:
            keep = rng.randrange(0, len(ids) + 1) if kind < 0.3 else max(0, len(ids) - rng.randrange(0, 5))
            new = np.concatenate([ids[:keep], np.asarray([rng.randrange(200_000) for _ in range(rng.randrange(0, 40))],
                                                         dtype=np.uint32)])
            if len(new) == 0:
                continue
            new_rev = rev + 1
        fields = {"model": "m", "max_tokens": rng.randrange(1, 9), "stream": rng.random() < 0.5}
        got = bodies.build(fields, new, IdsOrigin("s", rev, new_rev, keep))
        assert got == full(fields, new)
        assert json.loads(got)["prompt"] == new.tolist()
        ids, rev = new, new_rev
    assert bodies.reused > 200


def test_stale_or_foreign_state_is_written_in_full():
    bodies = RequestBodies()
    a = np.arange(100, dtype=np.uint32)
    bodies.build({}, a, IdsOrigin("s", 0, 1, 0))
    b = np.concatenate([a[:90], np.asarray([7, 8], dtype=np.uint32)])
    # base revision 2 != 1 (another writer mutated the session in between): no reuse
    assert bodies.build({}, b, IdsOrigin("s", 2, 3, 90)) == full({}, b)
    assert bodies.reused == 0
    bodies.forget("s")
    assert bodies.build({}, a, IdsOrigin("s", 3, 4, 90)) == full({}, a) and bodies.reused == 0
    # two revisions in one step are not a single splice
    assert bodies.build({}, b, IdsOrigin("s", 4, 6, 90)) == full({}, b) and bodies.reused == 0


def test_budget_evicts_least_recent():
    bodies = RequestBodies(max_bytes=3000)
    ids = np.arange(300, dtype=np.uint32)
    for s in "abc":
        bodies.build({}, ids, IdsOrigin(s, 0, 1, 0))
    assert bodies.stats()["bytes"] <= 3000 and bodies.stats()["bodies"] < 3


def test_real_session_splices():
    from tokenplane.tokenize.registry import load

    tok = load("qwen3")
    session = tok.session(allowed_special="all")
    bodies = RequestBodies()
    rng = random.Random(5)
    text = ""
    words = ("hello", " world", "\n", "<|im_end|>", " 12345", "ünï", "  ", "code()", ".")
    for step in range(60):
        if step % 7 == 6 and len(text) > 20:   # an edit in the middle
            cut = rng.randrange(len(text) // 2, len(text))
            text = text[:cut] + "".join(rng.choice(words) for _ in range(5)) + text[cut + 3:]
        else:
            text += "".join(rng.choice(words) for _ in range(rng.randrange(1, 30)))
        base = session.revision
        splice = session.sync(text)
        ids = np.array(session.ids, copy=True)
        got = bodies.build({"model": "q"}, ids, IdsOrigin("x", base, session.revision, int(splice.keep)))
        assert json.loads(got)["prompt"] == tok.encode(text, allowed_special="all").tolist()
        assert got == full({"model": "q"}, ids)
    assert bodies.reused > 30


def test_chunks_reference_earlier_bytes_and_cut_across_pieces():
    """`chunks` gives the body as pieces: the kept run is views of bytes written on earlier turns (not copied), and
    dropping more IDs than the last piece holds cuts into the pieces before it; joined, it is the full body."""
    bodies = RequestBodies()
    ids = np.arange(1000, 1100, dtype=np.uint32)
    first = bodies.chunks({"m": 1}, ids, IdsOrigin("s", 0, 1, 0))
    run = first[1]
    rev = 1
    for step in range(150):   # pieces of 6 IDs, drops of up to 13 (across pieces); past _MAX_SEGMENTS pieces
        keep = len(ids) - (step % 14)
        new = np.concatenate([ids[:keep], np.arange(step, step + 6, dtype=np.uint32)])
        got = bodies.chunks({"m": 1}, new, IdsOrigin("s", rev, rev + 1, keep))
        assert b"".join(got) == full({"m": 1}, new)
        if step < 20:
            assert any(c is run or (isinstance(c, memoryview) and c.obj is run) for c in got), "first run copied"
        ids, rev = new, rev + 1
    assert bodies.reused == 150 and bodies.written == 1


def test_bodies_from_a_sessions_read_only_view():
    """The tier writes bodies from the session's own IDs (a read-only view, under the session's lock): the same bytes
    as from a copy, the view untouched."""
    from tokenplane.tokenize.registry import load

    session = load("qwen3").session(allowed_special="all")
    bodies, text = RequestBodies(), ""
    for step in range(20):
        text += f"step {step}: <|im_start|>user\nwords ünï {step * 7}<|im_end|>\n"
        base = session.revision
        splice = session.sync(text)
        view = session.ids
        assert not view.flags.writeable
        got = b"".join(bodies.chunks({"model": "q"}, view, IdsOrigin("v", base, session.revision, int(splice.keep))))
        assert got == full({"model": "q"}, np.array(view, copy=True))
    assert bodies.reused == 19

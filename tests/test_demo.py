"""`tokenplane demo`: replays a real session exactly; works offline from the bundled copy; fails loudly on mismatch."""

import argparse
import json
from pathlib import Path

import numpy as np
from realtext import traces_dir

from tokenplane import demo
from tokenplane.tokenize.evidence.traces import load_trajectory
from tokenplane.tokenize.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "mini-swe-agent"


def run_demo(*argv) -> int:
    parser = argparse.ArgumentParser()
    demo.main_arguments(parser)
    return demo.main(parser.parse_args(list(argv)))


def test_bundled_session_is_real_and_attributed():
    data = demo.load_bundled()
    assert data["license"] == "MIT" and "mini-swe-agent" in data["attribution"]
    assert data["instance_id"] == demo.DEFAULT_INSTANCE and len(data["messages"]) > 20
    original = DATA / f"{demo.DEFAULT_INSTANCE}.traj.json"
    if original.exists():   # byte-for-byte the same conversation as the shared data copy
        assert [(m["role"], m["content"]) for m in data["messages"]] == \
               [(m["role"], m["content"]) for m in load_trajectory(original)]


def test_demo_offline_from_bundled_copy(tmp_path, capsys):
    out = tmp_path / "demo.json"
    rc = run_demo("--family", "cl100k_base", "--traces-dir", str(tmp_path / "absent"), "--quiet", "--json", str(out))
    text = capsys.readouterr().out
    assert rc == 0
    assert "bundled" in text and "27 / 27" in text
    summary = json.loads(out.read_text())["summary"]
    assert summary["steps"] == summary["exact"] == 27
    assert summary["ours_p50_ms"] > 0 and summary["full_p50_ms"] > 0 and summary["bytes_per_token"] > 0
    assert summary["repairs"] == 26


def test_demo_on_another_trace(capsys):
    trace = sorted(traces_dir().glob("*.traj.json*"))[0]
    assert run_demo("--family", "o200k_base", "--trace", str(trace), "--quiet") == 0
    assert "exact matches" in capsys.readouterr().out


class CorruptSession:
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def ids(self):
        ids = np.array(self.inner.ids)
        if len(ids) > 5000:
            ids[len(ids) // 2] += 1   # one wrong ID in the middle of a long prompt
        return ids


def test_demo_exits_nonzero_on_mismatch(tmp_path, monkeypatch, capsys):
    real = Tokenizer.session
    monkeypatch.setattr(Tokenizer, "session", lambda self, **kw: CorruptSession(real(self, **kw)))
    rc = run_demo("--family", "cl100k_base", "--traces-dir", str(tmp_path / "absent"), "--quiet")
    assert rc == 1
    assert "MISMATCH" in capsys.readouterr().err

"""`tokenplane verify`: counts, JSON summary, and that an injected divergence is caught, shrunk and fails the run."""

import argparse
import json
import random

import numpy as np
import pytest
from realtext import traces_dir

from tokenplane.tokenize.evidence import adversarial, campaign
from tokenplane.tokenize.tokenizer import Tokenizer


def run(tmp_path, *argv) -> tuple[int, dict]:
    parser = argparse.ArgumentParser()
    campaign.main_arguments(parser)
    out = tmp_path / "summary.json"
    args = parser.parse_args([*argv, "--json", str(out), "--seed", "1"])
    rc = campaign.main(args)
    return rc, json.loads(out.read_text())


def test_short_campaign_is_clean(tmp_path, capsys):
    rc, summary = run(tmp_path, "--family", "cl100k_base", "--seconds", "4", "--sources", "adversarial", "--no-traces")
    fam = summary["families"]["cl100k_base"]
    assert rc == 0 and fam["checks"] > 20 and fam["divergences"] == 0 and summary["failures"] == []
    assert fam["session_checks"] == fam["checks"] and fam["sessions"] > 0
    assert "0 divergences" in capsys.readouterr().out


class BrokenSession:
    """A session that silently drops the last token whenever the text contains '7' (a planted bug)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def ids(self):
        ids = np.asarray(self.inner.ids)
        return ids[:-1] if "7" in self.inner.text and len(ids) else ids


def test_planted_divergence_is_caught_and_shrunk(tmp_path, monkeypatch, capsys):
    real = Tokenizer.session
    monkeypatch.setattr(Tokenizer, "session", lambda self, **kw: BrokenSession(real(self, **kw)))
    rc, summary = run(tmp_path, "--family", "cl100k_base", "--seconds", "30", "--sources", "adversarial",
                      "--no-traces")
    assert rc == 1 and summary["totals"]["divergences"] == 1
    failure = summary["failures"][0]
    # shrunk to (nearly) just the trigger character
    total = len(failure["shrunk_base"]) + sum(len(str(o)) for o in failure["shrunk_ops"])
    assert "7" in failure["reproduction"] and total < 60, failure
    assert "DIVERGENCE" in capsys.readouterr().err


def test_shrink_reaches_minimal_case():
    def fails(base, ops):
        text = adversarial.materialize(base, ops)[-1][1] if ops else base
        return "ab" in text

    base, ops = adversarial.shrink("xxxxxxa", [("append", "bzzzz"), ("append", "qqq")], fails)
    assert base == "a" and ops == [("append", "b")]


def test_materialize_clamps_and_resolves():
    steps = adversarial.materialize("hello", [("edit", 3, 99, "P"), ("sync_cut", 2, "XY"), ("append", "!")])
    assert [t for _, t in steps] == ["helP", "heXY", "heXY!"]
    assert steps[0][0] == ("edit", 3, 5, "P") and steps[1][0] == ("sync", "heXY")


def test_generators_are_deterministic_and_valid():
    a = adversarial.session_case(random.Random(5))
    b = adversarial.session_case(random.Random(5))
    assert a == b
    for _, text in adversarial.materialize(*a):
        text.encode("utf-8")   # never a lone surrogate


def test_trace_source_replays_real_calls(tmp_path):
    rc, summary = run(tmp_path, "--family", "cl100k_base", "--seconds", "8", "--sources", "traces",
                      "--traces", str(traces_dir()), "--max-context", "60000")
    fam = summary["families"]["cl100k_base"]
    assert rc == 0 and fam["trace_calls"] > 0 and fam["divergences"] == 0


@pytest.mark.campaign
@pytest.mark.parametrize("family", campaign.FAMILIES)
def test_long_campaign(tmp_path, family):
    rc, summary = run(tmp_path, "--family", family, "--seconds", "300")
    assert rc == 0, summary["failures"]


def test_fullencode_source_checks_the_cpu_path(tmp_path):
    rc, summary = run(tmp_path, "--family", "cl100k_base", "--seconds", "4", "--sources", "fullencode", "--no-traces")
    fam = summary["families"]["cl100k_base"]
    assert rc == 0 and fam["fullencode_checks"] > 10 and fam["divergences"] == 0

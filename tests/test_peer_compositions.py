"""The stock-vLLM compositions of benchmarks/peers/routing_vs_vllm.py take exactly the decisions they are given.

Fake engines stand in for vLLM (model m's token at context length n is 1000 * m + n), so an output says which model
wrote each position and what context it saw. Replayed (calibrated-mode) decisions must reproduce the per-token
models they were read from, for one-token corrections and for R-Stitch's stream-and-abort; synthetic decisions must be
the runtime's counter_uniform gate.
"""
from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))
rvv = pytest.importorskip("routing_vs_vllm")
from routing_decisions import Decisions  # noqa: E402
from routing_vs_vllm_report import Cell, summarize  # noqa: E402

from tokenplane.route.api import counter_uniform  # noqa: E402


class FakeEngine:
    """submit -> a queue of (tokens, finished) chunks of up to 3 tokens; abort stops nothing already queued (as a
    real server's late tokens), which the composition must ignore."""

    def __init__(self, m: int) -> None:
        self.m, self.name, self.n_calls, self.aborted = m, f"fake{m}", 0, 0

    def submit(self, cid: str, prompt: list[int], max_tokens: int, logprobs: int | None = None) -> asyncio.Queue:
        self.n_calls += 1
        q: asyncio.Queue = asyncio.Queue()
        toks = [1000 * self.m + len(prompt) + i for i in range(max_tokens)]
        for i in range(0, len(toks), 3):
            q.put_nowait((toks[i:i + 3], i + 3 >= len(toks)))
        return q

    def abort(self, cid: str) -> None:
        self.aborted += 1


def expected(prompt: list[int], models: list[int]) -> list[int]:
    return [1000 * m + len(prompt) + p for p, m in enumerate(models)]


@pytest.mark.parametrize("seed", range(6))
def test_replayed_decisions_reproduce_models(seed: int) -> None:
    rng = random.Random(seed)
    gen, prompt = 40, list(range(7))
    models = [int(rng.random() < 0.3) for _ in range(gen)]
    dec = Decisions("calibrated", models={"r": models})
    engines = [FakeEngine(0), FakeEngine(1)]
    out, got = asyncio.run(rvv.one_token_request(engines, "r", prompt, gen, dec))
    assert got == models and out == expected(prompt, models)
    assert engines[0].n_calls == gen and engines[1].n_calls == sum(models)
    out, got = asyncio.run(rvv.stitch_request(engines, "r", prompt, gen, dec, 20))
    assert got == models and out == expected(prompt, models)


def test_stitch_control_is_one_call() -> None:
    engines = [FakeEngine(0), FakeEngine(1)]
    out, got = asyncio.run(rvv.stitch_request(engines, "r", [1, 2], 10, None, None))
    assert got == [0] * 10 and engines[0].n_calls == 1 and engines[1].n_calls == 0


def test_synthetic_decisions_are_the_runtime_gate() -> None:
    dec = Decisions("synthetic", seed=0, rates={"switch": 0.3, "return": 0.6})
    for pos in range(50):
        assert dec.fires("q", pos, 0, "switch") == (counter_uniform(0, "q", pos, 0, stream=0) < 0.3)
        assert dec.fires("q", pos, 1, "return") == (counter_uniform(0, "q", pos, 1, stream=0) < 0.6)


def test_old_results_cells_load() -> None:
    old = {"algorithm": "r2r", "concurrency": 4, "requests": 4, "gen": 8,
           "seconds": {"vllm": [1.0, 2.0], "tokenplane": [0.5, 1.0]}, "tokens": {"vllm": [32, 32],
                                                                              "tokenplane": [32, 32]},
           "vllm_calls": [[8, 1], [8, 1]], "ratios": [2.0, 2.0],
           "greedy": [{"requests": 4, "identical": 4, "models_identical": 4, "diverged": []}] * 2,
           "load_before": [1.0, 1.0], "load_after": [1.0, 1.0], "diag": {"vllm": [], "tokenplane": []}, "summary": {}}
    c = Cell.from_json(old)
    assert c.baselines == ["vllm"] and c.summary["vs"]["vllm"]["met"] is True
    assert summarize(c)["vs"]["vllm"]["identical"] == 8

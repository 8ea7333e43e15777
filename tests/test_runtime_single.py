"""One model, no routing: algorithm `single` serves a model through the routing runtime (process isolation, heartbeat,
chunked prefill, preemption, crash recovery) and must produce exactly the engine's own greedy output.

fp64 "test-small" (batched and unbatched forwards agree far below any argmax margin: exact equality, no tolerance),
built through `serve.backends.build_backend` as `tokenplane serve` builds it; and, when the registry wheel is
installed, the real SmolLM2-135M-Instruct by name.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from tokenplane.engine import artifacts
from tokenplane.engine.engine import LLMEngine
from tokenplane.engine.sampler import SamplingParams
from tokenplane.route.algorithms import make_algorithm
from tokenplane.route.reference import SequentialRouter, build_runner
from tokenplane.route.runtime import RuntimeConfig
from tokenplane.serve.backends import build_algorithm, build_backend
from tokenplane.serve.config import ServeConfig

PROMPTS = [[(11 * i + 5 * j) % 400 + 1 for j in range(3 + 7 * i)] for i in range(6)]
PARAMS = SamplingParams(max_tokens=20)


@pytest.fixture(scope="module")
def backend():
    # A 12-block pool and a 16-token step budget: 6 requests of up to 58 tokens are prefilled in chunks and preempted.
    cfg = ServeConfig(models=["test-small"], algorithm="single", parameters={}, dtype="float64", num_blocks=12,
                      runtime={"mode": "immediate_async", "max_num_batched_tokens": 16, "heartbeat_timeout_s": 20.0})
    # tokenizer None: the algorithm has no gates, so nothing is calibrated (and nothing needs a tokenizer)
    b = build_backend(cfg, "process", None, use_cache=False)
    yield b
    b.close()


def test_config_accepts_one_model_only_with_single():
    RuntimeConfig(models=["test-small"], algorithm="single").validate()
    with pytest.raises(ValueError, match="at least 2 models"):
        RuntimeConfig(models=["test-small"], algorithm="r2r").validate()
    with pytest.raises(ValueError, match="exactly 1 model"):
        RuntimeConfig(models=["test-small", "test-large"], algorithm="single").validate()
    with pytest.raises(ValueError, match="no routing parameters"):
        make_algorithm("single", rates={"switch": 0.5})
    # a config file that names only the model and the algorithm (ServeConfig's default parameters: a mode)
    alg = build_algorithm(ServeConfig(models=["test-small"], algorithm="single"))
    assert alg.num_models == 1 and not hasattr(alg, "calibration_gates")


def test_single_model_equals_engine_greedy(backend):
    engine = LLMEngine("test-small", dtype=torch.float64, num_blocks=64)
    expected = engine.generate(PROMPTS, PARAMS)
    outs = backend.runtime.run_batch(PROMPTS, PARAMS, concurrency=len(PROMPTS))
    for out, exp in zip(outs, expected):
        assert out.token_ids == exp
        assert set(out.token_models) == {0} and out.stats["num_handoffs"] == 0
    st = backend.runtime.stats()[0]
    assert st["num_preemptions"] > 0, st   # the small pool did preempt: recompute kept the outputs exact


def test_single_model_logprobs_equal_reference(backend):
    router = SequentialRouter(make_algorithm("single"), [build_runner("test-small", dtype=torch.float64)])
    params = SamplingParams(max_tokens=8, logprobs=2)
    for i, prompt in enumerate(PROMPTS[:3]):
        events = list(router.stream(prompt, params, f"lp-{i}"))[:-1]
        out = asyncio.run(backend.runtime.complete(prompt, params, f"lp-{i}"))
        assert out.token_ids == [e.token for e in events]
        for (lp, top), e in zip(out.logprobs, events):
            # fp64, batched (runtime) vs unbatched (reference) forwards: rounding only
            assert abs(lp - e.logprob) < 1e-9 and [t for t, _ in top] == [t for t, _ in e.top_logprobs]


def test_cached_prompt_tokens_under_chunked_prefill(backend):
    """A repeat of a 37-token prompt reports floor(36 / 16) * 16 = 32 cached prompt tokens (whole blocks, never the
    block holding the last token), also when the admission is cut into 16-token chunks."""
    prompt = [509, 7] + [(17 * j) % 400 + 1 for j in range(35)]
    got = [asyncio.run(backend.runtime.complete(prompt, PARAMS, f"cache-{k}")).stats["cached_prompt_tokens"]
           for k in range(2)]
    assert got == [0, 32]


def test_backend_streams_chunks(backend):
    async def go():
        return [c async for c in backend.generate(PROMPTS[1], PARAMS, "stream-1")]
    chunks = asyncio.run(go())
    assert chunks[-1].finish_reason in ("stop", "length")
    assert backend.health().ok and len(backend.health().models) == 1


SMOL = artifacts.MODELS["smollm2-135m-instruct"]


@pytest.mark.skipif(importlib.util.find_spec(SMOL.package) is None,
                    reason=f"registry model not installed (`{SMOL.install}`)")
def test_registry_model_by_name():
    """A real model name is a source: the sub-server resolves it (converted once into the user's cache)."""
    from tokenizers import Tokenizer

    from tokenplane.engine.gguf_convert import model_dir
    tok = Tokenizer.from_file(str(model_dir(SMOL.name) / "tokenizer.json"))
    prompt = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n").ids
    params = SamplingParams(max_tokens=10)
    expected = LLMEngine(SMOL.name, num_blocks=32, max_num_seqs=1).generate([prompt], params)[0]
    cfg = ServeConfig(models=[SMOL.name], algorithm="single", parameters={}, num_blocks=32,
                      runtime={"heartbeat_timeout_s": 30.0})
    b = build_backend(cfg, "process", None, use_cache=False)
    try:
        out = asyncio.run(b.runtime.complete(prompt, params, "smol"))
        assert out.token_ids == expected, (tok.decode(out.token_ids), tok.decode(expected))
        assert "Paris" in tok.decode(out.token_ids)
    finally:
        b.close()

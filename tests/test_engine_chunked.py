"""Chunked prefill, admission on need and the CPU fast paths of the engine (tests/test_engine.py holds the parity
tests against transformers, which run with the oneDNN-packed weights too).

Float64 where outputs must be equal: a chunk boundary changes GEMM shapes, which in float32 can move a logit by an ULP
(see STYLE.md); float64 makes greedy equality across chunkings exact in practice."""
from __future__ import annotations

import resource
import sys

import pytest
import torch

from tokenplane.engine import LLMEngine, ModelRunner, SamplingParams, Sequence, cpu_malloc, load_model
from tokenplane.engine.block_manager import BlockManager
from tokenplane.engine.layers import cpu_packing_supported
from tokenplane.engine.scheduler import Scheduler


def prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt(n, 100 + n) for n in (45, 7, 30, 12, 61)]


def run_engine(engine: LLMEngine, prompts, params):
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = []
    while engine.has_unfinished():
        before = {s.seq_id: s.num_computed_tokens for s in engine.scheduler.running}
        step = engine.step()
        steps.append((before, step))
        for o in step:
            outs[o.seq_id].append(o.token)
    return [outs[r] for r in ids], steps


def test_chunked_prefill_equals_unchunked_and_respects_the_budget(monkeypatch):
    params = [SamplingParams(max_tokens=10), SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=3)] * 2 \
        + [SamplingParams(max_tokens=6)]
    whole = LLMEngine("test-small", dtype=torch.float64, num_blocks=128, block_size=4)
    want, _ = run_engine(whole, PROMPTS, params)
    chunked = LLMEngine("test-small", dtype=torch.float64, num_blocks=128, block_size=4, max_num_batched_tokens=16)
    sizes = []
    real_run = chunked.runner.run

    def spy(seqs, num_new_tokens=None):
        sizes.append(list(num_new_tokens))
        return real_run(seqs, num_new_tokens)

    monkeypatch.setattr(chunked.runner, "run", spy)
    got, steps = run_engine(chunked, PROMPTS, params)
    assert got == want and [len(o) for o in got] == [10, 8, 10, 8, 6]
    assert all(sum(s) <= 16 for s in sizes), sizes
    # the 61-token prompt took at least 4 steps, and decodes of others ran in the same steps as its chunks
    assert any(len(s) > 1 and 1 in s and max(s) > 1 for s in sizes)
    assert chunked.runner.block_manager.num_free_blocks == chunked.runner.block_manager.num_blocks


def test_long_prompt_over_the_budget_is_admitted_in_chunks_without_sampling_early():
    eng = LLMEngine("test-small", dtype=torch.float64, num_blocks=64, block_size=4, max_num_batched_tokens=16)
    rid = eng.add_request(prompt(40, 1), SamplingParams(max_tokens=3))   # refused before chunked prefill existed
    assert eng.step() == [] and eng.step() == []                       # 16 + 16 tokens, nothing sampled
    seq = eng.scheduler.running[0]
    assert seq.num_computed_tokens == 32 and seq.num_output_tokens == 0
    out = eng.step()                                                     # last 8 tokens, then the first token
    assert [o.seq_id for o in out] == [rid] and seq.num_output_tokens == 1


def test_request_that_can_never_fit_is_refused_at_admission():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=100)
    with pytest.raises(ValueError, match="can never fit"):
        sched.add(Sequence("a", [1] * 10, SamplingParams(max_tokens=10)))   # 20 tokens > 4 blocks x 4
    sched.add(Sequence("b", [1] * 10, SamplingParams(max_tokens=6)))        # 16 tokens: fits alone
    batch, counts = sched.schedule()
    assert [s.seq_id for s in batch] == ["b"] and counts == [10] and sched.bm.num_used_blocks == 3   # prompt only


def test_runner_projects_only_complete_sequences():
    cfg, model = load_model("test-small", dtype=torch.float64, seed=5)
    runner = ModelRunner(model, cfg, num_blocks=32, block_size=4)
    a, b = Sequence("a", prompt(9, 1)), Sequence("b", prompt(5, 2))
    for s in (a, b):
        assert runner.prepare(s)
    out = runner.run([a, b], [4, 5])       # a: a chunk of 4 (no logits); b: complete
    assert out.rows == [1] and out.logits.shape[0] == 1 and a.num_computed_tokens == 4 and b.num_computed_tokens == 5
    out2 = runner.run([a], [5])
    ref_runner = ModelRunner(model, cfg, num_blocks=32, block_size=4)
    a2 = Sequence("a2", a.token_ids)
    assert ref_runner.prepare(a2)
    ref = ref_runner.run([a2])
    assert out2.rows == [0] and (out2.logits - ref.logits).abs().max().item() < 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_packed_weights_match_the_plain_path(dtype):
    """oneDNN-packed linears and the vocabulary projection (1 row and several) equal F.linear within rounding."""
    if not cpu_packing_supported(dtype):
        pytest.skip(f"this CPU's oneDNN does not pack {dtype} (bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
    cfg, model = load_model("test-small", dtype=dtype, seed=3)
    seqs = [Sequence(f"s{i}", prompt(7 + i, i)) for i in range(3)]
    outs = []
    for packed in (True, False):
        runner = ModelRunner(model, cfg, num_blocks=32, block_size=4)
        if not packed:
            model.unpack_cpu()
        assert runner.cpu_packed
        batch = [Sequence(s.seq_id, s.token_ids) for s in seqs]
        for s in batch:
            assert runner.prepare(s)
        first = runner.run(batch).logits
        batch[0].append_token(3)
        assert runner.prepare(batch[0])
        outs.append((first, runner.run([batch[0]]).logits))
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for x, y in zip(*outs):
        assert (x - y).abs().max().item() < tol


def test_packed_row_buckets():
    """Row buckets of the packed path: at least the rows, few distinct counts, little padding."""
    from tokenplane.engine.layers import packed_rows

    rows = [packed_rows(m) for m in range(1, 4097)]
    assert all(r >= m for m, r in zip(range(1, 4097), rows)) and rows == sorted(rows)
    assert rows[:16] == list(range(1, 17)) and len(set(rows[:2048])) == 72
    assert all(r - m < m / 8 for m, r in zip(range(1, 4097), rows))
    assert all(packed_rows(r) == r for r in rows)   # a bucket is its own bucket


def test_bucketed_packed_linear_and_warm_up():
    """Padding to the bucket changes no row beyond bf16 rounding (vs float64), and the runner warms every bucket
    of its step budget (bf16, where this CPU packs it)."""
    from tokenplane.engine.layers import cpu_bucketed_linear, cpu_pack, packed_rows

    if not cpu_packing_supported(torch.bfloat16):
        pytest.skip("this CPU's oneDNN does not pack bf16")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    packed, bias = cpu_pack(w), (torch.randn(96, generator=g) * 0.1).bfloat16()
    for m in (1, 16, 17, 40, 257, 300):
        x = torch.randn(m, 64, generator=g).bfloat16()
        assert packed_rows(m) >= m
        y = cpu_bucketed_linear(x, packed, bias)
        ref = x.double() @ w.double().T + bias.double()
        assert y.shape == (m, 96) and y.is_contiguous()
        assert ((y.double() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-2).all()
    cfg, model = load_model("test-small", dtype=torch.bfloat16, seed=3)
    runner = ModelRunner(model, cfg, num_blocks=32, block_size=4, max_num_batched_tokens=64)
    assert runner.cpu_packed and runner.warm_up_s > 0
    assert ModelRunner(model, cfg, num_blocks=32, block_size=4).warm_up_s == 0


@pytest.mark.parametrize("bias", [False, True])
def test_fused_swiglu_matches_float64_and_takes_over_the_packed_copy(bias):
    """bf16 SwiGLU on oneDNN (gate and up apart, silu and the product in the GEMMs' output stages): within bf16
    rounding of float64 at bucket and padded row counts; the module keeps one packed copy of gate_up, not two; the
    unpacked module's plain path gives the same answer within its own four roundings; warm-up builds its primitives."""
    from tokenplane.engine.layers import SwiGLU, packed_rows, warm_packed

    if not cpu_packing_supported(torch.bfloat16):
        pytest.skip("this CPU's oneDNN does not pack bf16")
    g = torch.Generator().manual_seed(1)
    mlp = SwiGLU(64, 96, bias).to(torch.bfloat16)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(torch.randn(192, 64, generator=g) * 0.1)
        mlp.down_proj.weight.copy_(torch.randn(64, 96, generator=g) * 0.1)
        if bias:
            mlp.gate_up_proj.bias.copy_(torch.randn(192, generator=g))
            mlp.down_proj.bias.copy_(torch.randn(64, generator=g) * 0.1)
    mlp.gate_up_proj.pack_cpu()
    mlp.down_proj.pack_cpu()
    mlp.pack_cpu()
    assert mlp.cpu_gate is not None and mlp.cpu_up is not None and mlp.gate_up_proj.cpu_packed is None
    w = mlp.gate_up_proj.weight.double()
    b = mlp.gate_up_proj.bias.double() if bias else torch.zeros(192, dtype=torch.float64)
    wd = mlp.down_proj.weight.double()
    bd = mlp.down_proj.bias.double() if bias else torch.zeros(64, dtype=torch.float64)
    for m in (1, 5, 16, 17, 40, 257):
        x = torch.randn(m, 64, generator=g).bfloat16()
        assert packed_rows(m) >= m
        with torch.inference_mode():
            y = mlp(x)
        gu = x.double() @ w.T + b
        h = torch.nn.functional.silu(gu[:, :96]) * gu[:, 96:]
        ref = h @ wd.T + bd
        assert y.shape == (m, 64)
        # the down GEMM's input is h rounded once to bf16: its error, summed over 96 products, dominates
        tol = 2 ** -7 * (h.abs() @ wd.abs().T) + 2 ** -7 * ref.abs() + 1e-3
        assert ((y.double() - ref).abs() <= tol).all()
    mlp.unpack_cpu()
    mlp.gate_up_proj.unpack_cpu()
    assert mlp.cpu_gate is None
    with torch.inference_mode():
        plain = mlp(x)
    assert ((plain.double() - ref).abs() <= 2 * tol).all()
    mlp.gate_up_proj.pack_cpu()
    mlp.pack_cpu()
    calls = warm_packed([], 40, [(mlp.cpu_gate, mlp.cpu_up, *mlp.cpu_biases, 64)])
    assert calls == 2 * len({packed_rows(m) for m in range(1, 41)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_warm_kernels_reaches_the_compiled_kernels_and_leaves_the_pool_as_it_was(dtype):
    """warm_kernels runs dummy steps through the prefill (wide and narrow), decode and greedy-screen paths, frees
    every block it took, and changes no answer after it; a pool too small for it is left alone."""
    from tokenplane.engine import cpu_prefill_attention

    cfg, model = load_model("test-small", dtype=dtype, seed=3)
    runner = ModelRunner(model, cfg, num_blocks=64, block_size=4)
    free = runner.block_manager.num_free_blocks
    assert runner.warm_kernels() > 0
    assert runner.block_manager.num_free_blocks == free
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    if dtype == torch.float32 and runner.uses_cpu_prefill():
        wide = cpu_prefill_attention.WIDE[0] and cfg.head_dim % 32 == 0
        assert cpu_prefill_attention._kernel(cfg.head_dim, group, wide).signatures
    prompts = [prompt(9, 1), prompt(23, 2)]
    outs = []
    for warm in (False, True):
        r = ModelRunner(model, cfg, num_blocks=64, block_size=4)
        if warm:
            r.warm_kernels()
        seqs = [Sequence(f"s{i}", p) for i, p in enumerate(prompts)]
        for s in seqs:
            assert r.prepare(s)
        outs.append(r.run(seqs).logits)
    assert torch.equal(outs[0], outs[1])
    assert ModelRunner(model, cfg, num_blocks=8, block_size=4).warm_kernels() == 0


@pytest.mark.parametrize("vocab", [151936, 49152, 1000, 300, 100])
def test_greedy_equals_argmax_with_ties(vocab):
    from tokenplane.engine.sampler import greedy

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    x[1, vocab // 2] = x[1, 3] = x[1].max() + 1          # tie: first index wins
    x[2, -1] = x[2].max() + 1                           # maximum in the tail past the last full block
    x[3, vocab - 5] = x[3, 7] = x[3].max() + 1            # tie between the body and the tail
    x[4] = 0.0                                          # all equal
    x[5, vocab // 3] = float("nan")
    x[6, -2] = float("nan")
    x[7, :] = float("-inf")
    x[8, 0] = float("nan")                              # NaN first
    x[8, 1] = float("inf")
    for dt in (torch.float32, torch.float64, torch.bfloat16):
        assert greedy(x.to(dt)).tolist() == torch.argmax(x.to(dt), dim=-1).tolist()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_cpu_runner_keeps_freed_memory_in_the_heap():
    """After a CPU ModelRunner exists, a large tensor freed and allocated again reuses the heap instead of faulting
    fresh zero pages in (glibc would otherwise mmap and unmap it each time)."""
    cfg, model = load_model("test-small", seed=3)
    ModelRunner(model, cfg, num_blocks=8, block_size=4)
    assert cpu_malloc.retain_freed_memory()

    def faults_of_one_allocation() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.ones(6 << 20)    # 24 MiB (the engine's largest activation), every page written
        del x
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    # Until the heap's layout settles, an allocation can grow the heap instead of reusing the freed block (each is
    # 64-byte aligned, so a freed block just below a small live one does not fit the next request; up to 7 rounds in
    # ~10 rounds, depending on what the process allocated before); from then on the block is reused. With glibc's
    # defaults the block is mmapped and unmapped again whenever the dynamic threshold is below it.
    faults = [faults_of_one_allocation() for _ in range(40)]
    assert max(faults[-3:]) < 1000, faults

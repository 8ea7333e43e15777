"""The compiled CPU prefill-attention kernel against float64 SDPA over the same K/V gathered by block table.

Adversarial cases: GQA groups 1, 2 and 3, head_dim 16, 64 and 128, chunks after cached context (q_len < context_len,
the causal diagonal offset), scattered and shared block ids, block sizes that do not divide the tiles, lengths that are
not multiples of the query or key tile (kernel's TQ, TK) and of the 4-key / 4-row passes, sequences out of order in a
wider token batch next to rows the kernel must not touch, and scores in the hundreds (the max-subtraction must hold).
Model-level: the runner hands multi-token rows to the kernel (and only where it should), with the same logits as the
SDPA path; tests/test_engine.py's float32 cases compare against transformers with it in use.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from prefill_runner import chunked_logits

from tokenplane.engine import attention as attention_module
from tokenplane.engine import cpu_prefill_attention
from tokenplane.engine.cpu_prefill_attention import TK, available, paged_prefill, query_tile, worth

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: 1 torch thread for the module


def reference(q, kc, vc, table, q_len, n, bs, group, scale):
    """Causal SDPA in float64 over the gathered K/V for one sequence's q_len queries at positions n - q_len .. n - 1,
    and the largest |score|."""
    q, kc, vc = q.double(), kc.double(), vc.double()
    blocks = torch.tensor(table[:-(-n // bs)])
    k = kc.unflatten(1, (-1, bs)).index_select(1, blocks).flatten(1, 2)[:, :n]
    v = vc.unflatten(1, (-1, bs)).index_select(1, blocks).flatten(1, 2)[:, :n]
    qh = q.transpose(0, 1)[None]   # [1, heads, q_len, d]
    mask = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]
    kk = k.repeat_interleave(group, 0)[None]
    max_score = (qh @ kk.transpose(-1, -2)).masked_fill(~mask, 0).abs().max().item() * scale
    o = F.scaled_dot_product_attention(qh, kk, v.repeat_interleave(group, 0)[None], attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1).reshape(q_len, -1), max_score


@pytest.fixture
def lanes():
    """Sets which vector width paged_prefill runs (cpu_prefill_attention.WIDE), restored after the test."""
    saved = cpu_prefill_attention.WIDE[0]

    def choose(wide: bool) -> None:
        cpu_prefill_attention.WIDE[0] = wide
    yield choose
    cpu_prefill_attention.WIDE[0] = saved


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("kvh,group,d,bs", [(2, 1, 64, 16), (2, 2, 128, 16), (3, 3, 64, 16), (1, 3, 16, 5),
                                            (2, 2, 64, 7)])
def test_kernel_matches_float64_sdpa(kvh, group, d, bs, wide, lanes):
    """Both vector widths (wide: the 16-lane passes, taken for head sizes a multiple of 32; on a host without
    AVX-512 LLVM splits their vectors in two)."""
    lanes(wide)
    g = torch.Generator().manual_seed(kvh * 100 + group * 10 + bs)
    num_blocks = 160
    kc = torch.randn(kvh, num_blocks * bs, d, generator=g)
    vc = torch.randn(kvh, num_blocks * bs, d, generator=g)
    tq = query_tile(group)
    # (q_len, context_len): whole prompts and chunks after cached context, around the tile sizes
    spans = [(2, 2), (tq + 5, tq + 5), (3, TK + 1), (tq - 1, 2 * TK + tq + 3), (2 * tq + 7, 2 * tq + 7 + TK - 3),
             (TK + 9, TK + 9), (5, 5)]
    rng = np.random.default_rng(bs)
    width = max(-(-n // bs) for _, n in spans)
    table = np.zeros((len(spans), width), dtype=np.int64)
    for i, (_, n) in enumerate(spans):
        nb = -(-n // bs)
        table[i, :nb] = rng.choice(num_blocks, nb, replace=False)
    table[3, 0] = table[2, 0]   # two sequences share a block (a prefix-cache hit)
    order = [4, 0, 6, 2, 1, 5, 3]   # sequences placed out of order in the token batch, with a gap row in between
    starts = {}
    t = 0
    for i in order:
        starts[i] = t
        t += spans[i][0] + (1 if i == 2 else 0)
    T = t
    # q as the model passes it: the first heads of a wider [T, heads + kv_heads, d] tensor (a non-contiguous view),
    # scaled so scores reach the hundreds and an unshifted exp would overflow in float32
    qk = torch.randn(T, kvh * group + kvh, d, generator=g) * 30
    q = qk[:, :kvh * group]
    out = torch.full((T, kvh * group * d), float("nan"))
    scale = d ** -0.5
    paged_prefill(q, kc, vc, np.array([starts[i] for i in range(len(spans))], dtype=np.int64),
                  np.array([s[0] for s in spans], dtype=np.int64), np.array([s[1] for s in spans], dtype=np.int64),
                  table, out, bs, group, scale)
    eps = torch.finfo(torch.float32).eps
    touched = set()
    for i, (q_len, n) in enumerate(spans):
        rows = slice(starts[i], starts[i] + q_len)
        touched.update(range(starts[i], starts[i] + q_len))
        ref, max_score = reference(q[rows], kc, vc, table[i], q_len, n, bs, group, scale)
        err = (out[rows].double() - ref).abs().max().item()
        # A float32 score is off by about eps * (max |score| + d) (its d products and the scaling); exp turns that into
        # a relative error of each weight, so of the output (a convex combination of values, |v| <= vmax); the value
        # and weight sums add about eps per term (n of them), the online rescaling eps per key tile. Twice that.
        bound = 2 * eps * (max_score + d + n + n / TK) * max(1.0, vc.abs().max().item())
        assert err < bound, (i, err, bound)
    untouched = sorted(set(range(T)) - touched)
    assert untouched and torch.isnan(out[untouched]).all()


@pytest.mark.parametrize("group", [1, 2, 3])
def test_8_and_16_lane_passes_give_the_same_bits(group, lanes):
    """Each lane sums over d (scores) or keys (values) in the same order at either width, so the outputs are equal bit
    for bit: prompts and chunks after cached context, across key tiles and the diagonal."""
    g = torch.Generator().manual_seed(group)
    kvh, d, bs = 2, 64, 16
    kc = torch.randn(kvh, 64 * bs, d, generator=g)
    vc = torch.randn(kvh, 64 * bs, d, generator=g)
    spans = [(150, 150), (37, 300), (1 + query_tile(group), 2 * TK + 5)]
    table = np.arange(3 * 20, dtype=np.int64).reshape(3, 20)
    starts = np.array([0, 150, 187], dtype=np.int64)
    q = torch.randn(int(starts[-1]) + spans[-1][0], kvh * group, d, generator=g) * 10
    outs = []
    for wide in (False, True):
        lanes(wide)
        out = torch.zeros(q.shape[0], kvh * group * d)
        paged_prefill(q, kc, vc, starts, np.array([a for a, _ in spans], dtype=np.int64),
                      np.array([b for _, b in spans], dtype=np.int64), table, out, bs, group, d ** -0.5)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_available_for_cpu_float32_and_bfloat16():
    """float32 with head_dim a multiple of 16; bfloat16 with head_dim a multiple of 32 on AMX hosts
    (tests/test_cpu_prefill_attention_amx.py) or on the 16-lane passes (AVX-512 hosts)."""
    cpu = torch.device("cpu")
    assert available(torch.float32, cpu, 64) and available(torch.float32, cpu, 16)
    assert not available(torch.float64, cpu, 64) and not available(torch.bfloat16, cpu, 16)
    assert available(torch.bfloat16, cpu, 64) == (cpu_prefill_attention.amx.HOST_AMX or cpu_prefill_attention.WIDE[0])
    assert not available(torch.float32, cpu, 24) and not available(torch.float32, torch.device("cuda"), 64)


@pytest.fixture
def no_amx(monkeypatch):
    """bfloat16 through the 16-lane passes, as on an AVX-512 host without AMX tiles."""
    monkeypatch.setattr(cpu_prefill_attention.amx, "applies", lambda *args: False)
    monkeypatch.setattr(cpu_prefill_attention.amx, "HOST_AMX", False)


def _bf16_case(group: int, bs: int, pairs: bool, monkeypatch
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bf16 passes' output, float32 kernel's output on the widened values, float64 SDPA's) for prompts and chunks
    after cached context, scattered blocks, head sizes 64 and 128, scores in the hundreds; pairs: the score pass on
    bf16 pairs."""
    monkeypatch.setattr(cpu_prefill_attention, "PAIRS", [pairs])
    g = torch.Generator().manual_seed(group * 10 + bs)
    kvh, d = 2, 64 if group != 2 else 128
    num_blocks = -(-700 // bs) + 4
    kc = torch.randn(kvh, num_blocks * bs, d, generator=g).bfloat16()
    vc = torch.randn(kvh, num_blocks * bs, d, generator=g).bfloat16()
    spans = [(150, 150), (37, 300), (1 + query_tile(group), 2 * TK + 5), (260, 700)]
    rng = np.random.default_rng(group)
    width = max(-(-n // bs) for _, n in spans)
    table = np.stack([rng.permutation(num_blocks)[:width] for _ in spans]).astype(np.int64)
    lens = np.array([a for a, _ in spans], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    ctx = np.array([b for _, b in spans], dtype=np.int64)
    qk = (torch.randn(int(lens.sum()), kvh * group + kvh, d, generator=g) * 30).bfloat16()
    q = qk[:, :kvh * group]    # the first heads of a wider tensor, as the model passes it
    got = torch.full((q.shape[0], kvh * group * d), float("nan"), dtype=torch.bfloat16)
    paged_prefill(q, kc, vc, starts, lens, ctx, table, got, bs, group, d ** -0.5)
    want = torch.zeros(q.shape[0], kvh * group * d)
    paged_prefill(q.float(), kc.float(), vc.float(), starts, lens, ctx, table, want, bs, group, d ** -0.5)
    ref = torch.cat([reference(q[a:a + n_q], kc, vc, table[i], int(n_q), int(n), bs, group, d ** -0.5)[0]
                     for i, (a, n_q, n) in enumerate(zip(starts, lens, ctx))])
    return got, want, ref


@pytest.mark.parametrize("group,bs", [(1, 16), (3, 16), (2, 7)])
def test_bf16_passes_are_the_float32_kernel_rounded_once(group, bs, no_amx, lanes, monkeypatch):
    """On bfloat16 caches the 16-lane FMA passes widen each K/V element exactly as they load it and sum in float32,
    so their output is the float32 kernel's on the widened values, rounded to bfloat16 once: equal bit for bit."""
    lanes(True)
    got, want, _ = _bf16_case(group, bs, False, monkeypatch)
    assert torch.equal(got, want.bfloat16())


def test_bf16_pairs_fall_back_to_the_fma_passes_where_they_cannot_run(no_amx, lanes, monkeypatch):
    """A numba / LLVM that cannot emit vdpbf16ps (the pair product's probe fails) leaves PAIRS on but runs the FMA
    passes: the output is theirs bit for bit."""
    lanes(True)
    monkeypatch.setattr(cpu_prefill_attention.pairs, "works", lambda: False)
    got, want, _ = _bf16_case(1, 16, True, monkeypatch)
    assert torch.equal(got, want.bfloat16())


@pytest.mark.skipif(not cpu_prefill_attention.HOST_AVX512_BF16, reason="needs AVX512-BF16 (vdpbf16ps)")
def test_pair_product_probe_passes_on_an_avx512_bf16_host():
    """The probe that guards the pair passes must not switch them off where they work (numba's LLVM 17 and up, whose
    intrinsic signature cpu_simd._dpbf16x16 was written and checked against)."""
    import llvmlite.binding as llvm
    if llvm.llvm_version_info[0] < 17:
        pytest.skip("the pre-17 operand types are not checked on a host here")
    assert cpu_prefill_attention.pairs.works()


@pytest.mark.skipif(not cpu_prefill_attention.HOST_AVX512_BF16, reason="needs AVX512-BF16 (vdpbf16ps)")
@pytest.mark.parametrize("group,bs", [(1, 16), (3, 16), (2, 7)])
def test_bf16_pair_scores_are_the_float32_kernel_within_rounding(group, bs, no_amx, lanes, monkeypatch):
    """The score pass on bf16 pairs (vdpbf16ps: exact products, float32 sums in another order) moves the float32
    scores by a few units in their last place: against float64 SDPA its output is as accurate as the FMA passes'
    (the float32 kernel rounded once), and nearly every element rounds to the same bfloat16."""
    lanes(True)
    got, want, ref = _bf16_case(group, bs, True, monkeypatch)
    assert not torch.isnan(got).any()
    err = (got.double() - ref).abs()
    base = (want.bfloat16().double() - ref).abs()
    assert err.max() <= 1.25 * base.max(), (err.max().item(), base.max().item())
    assert err.mean() <= 1.05 * base.mean(), (err.mean().item(), base.mean().item())
    moved = (got != want.bfloat16()).float().mean().item()
    assert moved < 0.02, moved


@pytest.mark.skipif(not cpu_prefill_attention.WIDE[0], reason="bf16 prefill runs on the 16-lane passes or AMX only")
def test_bf16_model_prefills_on_the_16_lane_passes(monkeypatch, no_amx):
    """A bf16 model (head_dim 32) on a host without AMX: multi-token rows of 25 rows and up go to the kernel, and the
    logits' error against a float64 run of the same weights stays the size of SDPA's bf16 error."""
    ref = chunked_logits(torch.float64, "varlen")[2]
    sdpa = chunked_logits(torch.bfloat16, "varlen")[2]
    calls: list = []
    cfg, runner, got = chunked_logits(torch.bfloat16, "auto", monkeypatch, calls)
    assert runner.uses_cpu_prefill()
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    # the 10-token chunk after 290 cached tokens goes to the kernel only where its rows reach the threshold
    rows = cpu_prefill_attention.min_rows(torch.bfloat16, group, cfg.head_dim)
    per_layer = [([290], [290])] + ([([10], [300])] if 10 * group >= rows else [])
    assert sorted(calls) == sorted(per_layer * cfg.num_hidden_layers)
    err, base = (got - ref).abs().max().item(), (sdpa - ref).abs().max().item()
    assert err <= 1.5 * base + 1e-2, (err, base)


def test_bf16_threshold_is_the_kernel_that_runs(monkeypatch):
    """bf16 rows go to the AMX kernel from AMX_MIN_ROWS, to the 16-lane passes from BF16_MIN_ROWS (from
    BF16_PAIRS_MIN_ROWS with the score pass on bf16 pairs): on an AMX host whose shapes the tiles do not take (a block
    size not a multiple of 16), the 16-lane threshold applies, as in paged_prefill's dispatch."""
    monkeypatch.setattr(cpu_prefill_attention, "PAIRS", [True])
    if cpu_prefill_attention.pairs.works():
        assert cpu_prefill_attention.min_rows(torch.bfloat16, 3, 64, 8) == cpu_prefill_attention.BF16_PAIRS_MIN_ROWS
        assert worth(6, 3, torch.bfloat16, 64, 8) and not worth(5, 3, torch.bfloat16, 64, 8)
    monkeypatch.setattr(cpu_prefill_attention.pairs, "works", lambda: False)   # a host that cannot run them
    assert cpu_prefill_attention.min_rows(torch.bfloat16, 3, 64, 8) == cpu_prefill_attention.BF16_MIN_ROWS
    monkeypatch.setattr(cpu_prefill_attention, "PAIRS", [False])
    monkeypatch.setattr(cpu_prefill_attention.amx, "HOST_AMX", True)
    bf16 = torch.bfloat16
    assert cpu_prefill_attention.min_rows(bf16, 3, 64, 16) == cpu_prefill_attention.AMX_MIN_ROWS
    assert cpu_prefill_attention.min_rows(bf16, 3, 64, 8) == cpu_prefill_attention.BF16_MIN_ROWS
    assert worth(9, 3, bf16, 64, 8) and not worth(9, 3, bf16, 64, 16)
    assert not worth(8, 3, bf16, 64, 8) and cpu_prefill_attention.min_rows(torch.float32, 3, 64, 8) == 12


def test_short_rows_stay_with_sdpa():
    assert not worth(2, 2) and not worth(4, 2) and not worth(2, 3) and not worth(11, 1)
    assert worth(4, 3) and worth(8, 2) and worth(12, 1) and worth(2048, 3)


def _runner(kernel: str, dtype=torch.float32):
    from tokenplane.engine.loader import load_model
    from tokenplane.engine.model_runner import ModelRunner

    cfg, model = load_model("test-small", dtype=dtype, seed=3)
    return cfg, ModelRunner(model, cfg, num_blocks=48, block_size=4, prefill_kernel=kernel)


def _prefill_then_chunk(runner):
    """A whole prompt and a chunked one (its second chunk attends to cached context) in one batch each; returns the
    logits of both runs."""
    from tokenplane.engine.sequence import Sequence

    a = Sequence("a", list(range(3, 40)))
    b = Sequence("b", [(7 * i) % 500 for i in range(29)])
    for s in (a, b):
        assert runner.prepare(s)
    first = runner.run([a, b], num_new_tokens=[37, 11])   # b: the first 11 tokens only
    second = runner.run([b])                              # b: the other 18, over 11 cached tokens
    return first.logits, second.logits


def test_runner_uses_the_kernel_for_multi_token_rows(monkeypatch):
    calls = []
    real = attention_module.paged_prefill

    def counting(q, k_cache, v_cache, q_starts, q_lens, context_lens, *args):  # noqa: ANN001, ANN002
        calls.append((q_lens.tolist(), context_lens.tolist()))
        real(q, k_cache, v_cache, q_starts, q_lens, context_lens, *args)

    def no_sdpa(*args, **kwargs):  # noqa: ANN002, ANN003
        raise AssertionError("multi-token rows went to SDPA")

    cfg, varlen = _runner("varlen")
    ref = _prefill_then_chunk(varlen)
    cfg, runner = _runner("auto")
    assert runner.uses_cpu_prefill()
    monkeypatch.setattr(attention_module, "paged_prefill", counting)
    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", no_sdpa)
    got = _prefill_then_chunk(runner)
    layers = cfg.num_hidden_layers
    assert calls == [([37, 11], [37, 11])] * layers + [([18], [29])] * layers
    for x, y in zip(got, ref):
        assert (x - y).abs().max().item() < 1e-5


def test_runner_keeps_sdpa_where_the_kernel_does_not_apply(monkeypatch):
    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003
        raise AssertionError("the cpu prefill kernel ran")

    monkeypatch.setattr(attention_module, "paged_prefill", refuse)
    _prefill_then_chunk(_runner("varlen")[1])
    _prefill_then_chunk(_runner("auto", torch.float64)[1])
    cfg, runner = _runner("auto")
    torch.set_num_threads(2)   # measured at 1 thread only; with more, SDPA's kernel runs in parallel and this does not
    try:
        assert not runner.uses_cpu_prefill()
        _prefill_then_chunk(runner)
    finally:
        torch.set_num_threads(1)   # one_thread is module-scoped
    with pytest.raises(ValueError):
        _runner("cpu", torch.float64)

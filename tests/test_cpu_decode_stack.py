"""The compiled decode path (cpu_qkv_rope, cpu_decode_stack) against the PyTorch ops and model path it replaces."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenplane.engine import ModelRunner, Sequence, cpu_decode_stack, load_model
from tokenplane.engine.cpu_decode_stack import applies, stack_for
from tokenplane.engine.cpu_qkv_rope import applies as qkv_applies
from tokenplane.engine.cpu_qkv_rope import qkv_rope_write
from tokenplane.engine.layers import RotaryEmbedding, apply_rope, rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("T,d", [(1, 16), (5, 16), (1, 64), (7, 64)])
def test_qkv_rope_write_matches_torch(dtype, norm, T, d):
    """head_dim 64: the 16-lane kernel on AVX-512 hosts (float32 / bf16), 16: the scalar one."""
    h, kvh, slots_n = 6, 2, 64
    g = torch.Generator().manual_seed(T * 10 + norm)
    qkv = torch.randn(T, (h + 2 * kvh) * d, generator=g, dtype=dtype) * 2
    qw, kw = torch.randn(d, generator=g, dtype=dtype), torch.randn(d, generator=g, dtype=dtype)
    positions = torch.tensor([3, 17, 40, 41, 1000, 1001, 7000][:T])
    cos, sin = RotaryEmbedding(d, 10000.0, None)(positions, dtype)
    slots = torch.randperm(slots_n, generator=g)[:T]
    k_cache, v_cache = torch.zeros(kvh, slots_n, d, dtype=dtype), torch.zeros(kvh, slots_n, d, dtype=dtype)
    assert qkv_applies(qkv, k_cache)
    q = qkv_rope_write(qkv, h, kvh, d, qw if norm else None, kw if norm else None, 1e-6, cos, sin, k_cache, v_cache,
                       slots)
    # the torch path of DecoderAttention.forward
    qk = qkv[:, :(h + kvh) * d].view(T, h + kvh, d)
    if norm:
        qk = rms_norm(qk, torch.cat((qw.expand(h, d), kw.expand(kvh, d))), 1e-6)
    qk = apply_rope(qk, cos, sin)
    want_v = qkv[:, (h + kvh) * d:].view(T, kvh, d)
    assert torch.equal(v_cache[:, slots].transpose(0, 1), want_v)
    untouched = torch.ones(slots_n, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[:, untouched].any() and not v_cache[:, untouched].any()
    got_k = k_cache[:, slots].transpose(0, 1)
    if norm and dtype == torch.bfloat16:   # each bf16 step rounded where torch rounds: a sum-order flip is rare
        assert (q != qk[:, :h]).float().mean() <= 0.01 and (got_k != qk[:, h:]).float().mean() <= 0.01
        assert (q.float() - qk[:, :h].float()).abs().max() <= 2 ** -7 * qk.float().abs().max()
    elif norm:   # the norm's sum runs in another order: last-bit differences
        tol = 4e-6 if dtype == torch.float32 else 1e-14
        assert (q - qk[:, :h]).abs().max() <= tol * qk.abs().max()
        assert (got_k - qk[:, h:]).abs().max() <= tol * qk.abs().max()
    else:      # the rope alone is bit-identical to apply_rope
        assert torch.equal(q, qk[:, :h]) and torch.equal(got_k, qk[:, h:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_rope_vector_kernel_equals_scalar(dtype, monkeypatch):
    """The 16-lane kernel against the scalar one on the same inputs, NaN and infinities among them: the rope (no norm)
    bit for bit, NaN bits included (torch's quiet NaN in bf16); with the norm, within its sum-order difference."""
    from tokenplane.engine import cpu_qkv_rope

    if not cpu_qkv_rope._vector_applies(dtype, 64):
        pytest.skip("the 16-lane kernel needs an AVX-512 host")
    h, kvh, d, T, n = 9, 3, 64, 33, 80
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(T, (h + 2 * kvh) * d, generator=g, dtype=dtype) * 3
    qkv[2, 5] = float("nan")
    qkv[3, 70] = float("inf")
    qkv[4, d * h + 1] = float("-inf")
    qkv[6, :] = 1e-30                       # subnormal-range squares in the norm
    qw, kw = torch.randn(d, generator=g, dtype=dtype), torch.randn(d, generator=g, dtype=dtype)
    cos, sin = RotaryEmbedding(d, 10000.0, None)(torch.arange(T) * 13 + 2, dtype)
    slots = torch.randperm(n, generator=g)[:T]
    outs = {}
    for vector in (False, True):
        monkeypatch.setattr(cpu_qkv_rope, "VECTOR", [vector])
        for norm in (False, True):
            kc, vc = torch.zeros(kvh, n, d, dtype=dtype), torch.zeros(kvh, n, d, dtype=dtype)
            q = qkv_rope_write(qkv, h, kvh, d, qw if norm else None, kw if norm else None, 1e-6, cos, sin, kc, vc,
                               slots)
            outs[vector, norm] = (q, kc, vc)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for a, b in zip(outs[False, False], outs[True, False]):
        assert torch.equal(a.view(bits), b.view(bits))
    assert torch.equal(outs[False, True][2], outs[True, True][2])
    for a, b in zip(outs[False, True][:2], outs[True, True][:2]):
        finite = a.isfinite() & b.isfinite()
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
        tol = 2 ** -7 if dtype == torch.bfloat16 else 4e-6
        assert (a[finite].double() - b[finite].double()).abs().max() <= tol * a[finite].double().abs().max()


def test_qkv_rope_not_applicable():
    assert not qkv_applies(torch.zeros(1, 8, dtype=torch.float16), torch.zeros(1, 4, 2, dtype=torch.float16))
    assert not qkv_applies(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(1, 4, 2))
    assert not qkv_applies(torch.zeros(1, 8), None)
    assert not qkv_applies(torch.zeros(8, 2).t(), torch.zeros(1, 4, 2))


@pytest.mark.parametrize("preset", ["test-small", "test-llama"])
def test_decode_stack_matches_model_path(preset, monkeypatch):
    """Decode steps of 1-3 rows, interleaved block tables, positions crossing the rope table's first size (256):
    the compiled stack's logits equal the torch path's within float rounding (its one difference is the SwiGLU's
    exp), and the same greedy tokens."""
    torch.set_num_threads(1)
    cfg, model = load_model(preset, dtype=torch.float32, seed=0)
    calls = []
    forward = cpu_decode_stack.DecodeStack.forward
    monkeypatch.setattr(cpu_decode_stack.DecodeStack, "forward", lambda *a: calls.append(1) or forward(*a))
    results = {}
    for on in (False, True):
        model.model.decode_stack = on
        runner = ModelRunner(model, cfg, num_blocks=64, block_size=16)
        seqs = [Sequence(f"s{i}", [(7 * i + 3 * t) % 500 + 1 for t in range(n)]) for i, n in enumerate((37, 250, 5))]
        for s in seqs:
            assert runner.prepare(s)
        runner.run(seqs)
        outs = []
        for step in range(20):
            batch = seqs if step % 3 else seqs[:1]
            for s in batch:
                s.append_token((step * 13 + s.num_tokens) % 500 + 1)
                assert runner.prepare(s)
            if on:
                assert stack_for(model.model) is not None
            outs.append(runner.run(batch).logits)
        results[on] = outs
        assert len(calls) == (20 if on else 0)   # every decode step, and only those, took the stack
    model.model.decode_stack = True
    for a, b in zip(results[False], results[True]):
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, a.abs().max().item())
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_decode_stack_not_applicable():
    """float64 models keep the torch path (no panel copies), and so do steps with a multi-token row."""
    torch.set_num_threads(1)
    cfg, model = load_model("test-small", dtype=torch.float64, seed=0)
    ModelRunner(model, cfg, num_blocks=8, block_size=16)
    assert stack_for(model.model) is None
    cfg, model = load_model("test-small", dtype=torch.float32, seed=0)
    runner = ModelRunner(model, cfg, num_blocks=8, block_size=16)
    assert stack_for(model.model) is not None
    s = Sequence("a", list(range(1, 20)))
    assert runner.prepare(s)
    meta = runner._metadata([s], [(0, 19)], list(range(19)), padded=False)
    assert not applies(torch.zeros(19, dtype=torch.long), meta)


def _logits_with_stack_off_and_on(model, cfg, prompt_lens, sizes, mult):  # noqa: ANN001, ANN202
    """{False: logits, True: logits} of the same decode steps (the first `n` sequences for each n in sizes, one
    token each) with model.model.decode_stack off and on, each on a fresh runner."""
    results = {}
    for on in (False, True):
        model.model.decode_stack = on
        runner = ModelRunner(model, cfg, num_blocks=256, block_size=16)
        seqs = [Sequence(f"s{i}", [(mult * i + 3 * t) % 500 + 1 for t in range(n)]) for i, n in enumerate(prompt_lens)]
        for s in seqs:
            assert runner.prepare(s)
        runner.run(seqs)
        outs = []
        for n in sizes:
            batch = seqs[:n]
            for s in batch:
                s.append_token((n * 13 + s.num_tokens) % 500 + 1)
                assert runner.prepare(s)
            outs.append(runner.run(batch).logits)
        results[on] = outs
    model.model.decode_stack = True
    return results


def test_decode_stack_matches_model_path_at_9_to_16_rows(monkeypatch):
    """Decode steps of 9-16 rows (the row counts of routing steps at concurrency 16) run the compiled stack, with
    the torch path's logits within float rounding and the same greedy tokens; past MAX_ROWS the torch path runs."""
    torch.set_num_threads(1)
    cfg, model = load_model("test-small", dtype=torch.float32, seed=1)
    top = cpu_decode_stack.MAX_ROWS
    calls = []
    forward = cpu_decode_stack.DecodeStack.forward
    monkeypatch.setattr(cpu_decode_stack.DecodeStack, "forward", lambda *a: calls.append(a[1].shape[0]) or forward(*a))
    sizes = (9, 12, top, top + 1, top, 13)
    results = _logits_with_stack_off_and_on(model, cfg, [9 + 5 * i for i in range(top + 1)], sizes, 11)
    assert calls == [n for n in sizes if n <= top]
    for a, b in zip(results[False], results[True]):
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, a.abs().max().item())
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("k", [64, 256, 576])
def test_decode_stack_linears_sum_in_f_linears_order(k):
    """The stack's GEMMs take cpu_small_gemm's block size for their K and put the bias first: every row equals F.linear
    (transformers' call, at 40 rows) bit for bit, so decode steps match transformers' linears exactly."""
    from tokenplane.engine import cpu_small_gemm
    from tokenplane.engine.cpu_decode_stack import _linear_of, _matmul
    from tokenplane.engine.layers import Linear

    if cpu_small_gemm.probe_k_block(k) is None:
        pytest.skip(f"this torch's BLAS sums a {k}-long dot product in no order the kernel mirrors")
    torch.manual_seed(k)
    for bias in (False, True):
        lin = Linear(k, 72, bias=bias)
        with torch.no_grad():
            lin.weight.normal_(0, 0.05)
            if bias:
                lin.bias.normal_()
        lin.pack_cpu()
        x = torch.randn(40, k)
        with torch.no_grad():
            ref = F.linear(x, lin.weight, lin.bias)
        stacked = _linear_of(lin, False)
        for rows in (1, 2, 5, 16):
            assert torch.equal(torch.from_numpy(_matmul(x[:rows].numpy(), stacked)), ref[:rows])


@pytest.mark.parametrize("preset", ["test-small", "test-llama"])
def test_bf16_decode_stack_equals_model_path_bit_for_bit(preset, monkeypatch):
    """bfloat16 decode steps of 1-8 rows (AVX-512 panels) or 1-16 (AMX tiles) run the compiled stack on the torch
    path's own kernels (cpu_bf16_gemv's panels, the dtype's rope and attention kernels): logits equal bit for bit,
    interleaved block tables, positions crossing the rope table's first size; one row more takes the torch path."""
    from tokenplane.engine import cpu_bf16_gemv
    from tokenplane.engine.cpu_simd import HOST_AVX512

    if not HOST_AVX512:
        pytest.skip("the bf16 decode panels need 16-lane vectors")
    torch.set_num_threads(1)
    cfg, model = load_model(preset, dtype=torch.bfloat16, seed=2)
    calls = []
    forward = cpu_decode_stack.DecodeStack.forward
    monkeypatch.setattr(cpu_decode_stack.DecodeStack, "forward", lambda *a: calls.append(a[1].shape[0]) or forward(*a))
    top = min(cpu_bf16_gemv.MAX_ROWS, cpu_decode_stack.MAX_ROWS)
    sizes = (1, 3, 1, top, top + 1, 2) * 3
    lens = [37, 250, 5, 16, 17, 90, 3, 64, 20, 41, 8, 130, 12, 77, 29, 55, 6][:top + 1]
    results = _logits_with_stack_off_and_on(model, cfg, lens, sizes, 7)
    assert stack_for(model.model) is not None and stack_for(model.model).bf16
    assert calls == [n for n in sizes if n <= top]
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)

"""cpu_small_gemm (the few-row float32 linear of decode steps) against float64 F.linear, and the layers that take it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenplane.engine import cpu_small_gemm
from tokenplane.engine.layers import Linear, VocabProjection


@pytest.mark.parametrize("n,k", [(1, 1), (17, 5), (100, 37), (48, 64), (3072, 512), (49152, 96)])
def test_linear_matches_float64_reference(n, k):
    """Every row count the kernel is given (6-, 4-, 2- and 1-row passes and their mixes), out_features not a multiple
    of the panel width (padding columns dropped), with and without bias."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g)
    panels = cpu_small_gemm.pack(w)
    assert panels.shape == (-(-n // cpu_small_gemm.PANEL), k, cpu_small_gemm.PANEL)
    for rows in [*range(1, 41), 63, 64, 65, 127, cpu_small_gemm.MAX_ROWS, cpu_small_gemm.VOCAB_MAX_ROWS]:
        x = torch.randn(rows, k, generator=g)
        ref = F.linear(x.double(), w.double())
        y = cpu_small_gemm.linear(x, panels, n)
        yb = cpu_small_gemm.linear(x, panels, n, b)
        assert y.shape == (rows, n) and y.dtype == torch.float32 and y.is_contiguous()
        # float32 accumulation of k products of size ~0.05 * 1: a few ulps of the sum
        tol = 1e-6 * max(1.0, k ** 0.5)
        assert (y.double() - ref).abs().max().item() < tol
        assert (yb.double() - ref - b.double()).abs().max().item() < tol + 1e-6


def test_a_rows_values_do_not_depend_on_the_batch_around_it():
    """Each pass sums a row in the same order, so a row computed alone, in a 6-row pass or in any mix equals itself
    bit for bit (batch invariance: a sequence's greedy tokens do not depend on what else is in the step)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(200, 150, generator=g) * 0.05
    panels = cpu_small_gemm.pack(w)
    x = torch.randn(cpu_small_gemm.VOCAB_MAX_ROWS, 150, generator=g)
    alone = torch.cat([cpu_small_gemm.linear(x[i:i + 1], panels, 200) for i in range(x.shape[0])])
    for rows in (2, 5, 6, 7, 13, 17, cpu_small_gemm.VOCAB_MAX_ROWS):
        assert torch.equal(cpu_small_gemm.linear(x[:rows], panels, 200), alone[:rows])


@pytest.mark.parametrize("n,k", [(1, 1), (17, 5), (48, 64), (200, 150), (3072, 512), (49152, 96)])
def test_8_and_16_lane_kernels_sum_alike(n, k):
    """The AVX-512 kernel (cpu_small_gemm16: two panels a pass, up to 12 rows) equals the 8-lane one bit for bit at
    every row count, odd and even panel counts, with and without bias (on a host without AVX-512 LLVM splits its
    vectors in two: slower, the same sums)."""
    from tokenplane.engine import cpu_small_gemm16

    g = torch.Generator().manual_seed(n + 7 * k)
    w = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g)
    panels = cpu_small_gemm.pack(w)
    kernel = cpu_small_gemm._KERNEL[0]
    try:
        for rows in [*range(1, 30), 35, 64, 256]:
            x = torch.randn(rows, k, generator=g)
            out = {}
            for name, fn in (("8", cpu_small_gemm._gemm), ("16", cpu_small_gemm16.gemm)):
                cpu_small_gemm._KERNEL[0] = fn
                out[name] = (cpu_small_gemm.linear(x, panels, n), cpu_small_gemm.linear(x, panels, n, bias))
            assert torch.equal(out["8"][0], out["16"][0]) and torch.equal(out["8"][1], out["16"][1]), rows
    finally:
        cpu_small_gemm._KERNEL[0] = kernel


def _remainder_case(n: int, k: int, seed: int):
    """(generator, weight, bias, panels, panel count, padded width, k block) of a remainder-policy test."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g)
    panels = cpu_small_gemm.pack(w)
    npan = panels.shape[0]
    return g, w, bias, panels, npan, npan * cpu_small_gemm.PANEL, cpu_small_gemm.k_block(k)


@pytest.mark.parametrize("n,k", [(1, 1), (17, 5), (200, 150), (3072, 512)])
def test_one_pass_remainders_sum_alike_and_store_only_their_rows(n, k):
    """The 16-lane kernel's remainder policies (cpu_small_gemm16.gemm_with: the passes of 6, 4, 2, 1 rows, or
    passes of 12, 6, 4 rows over zero-padded inputs) give the 8-lane kernel's sums bit for bit, with and without
    bias (acc), and write nothing past the rows asked for (sentinels after them stay)."""
    from tokenplane.engine import cpu_small_gemm16 as g16

    g, w, bias, panels, npan, width, kb = _remainder_case(n, k, 3 * n + k)
    one_pass = np.array([0, 1, 2, 4, 4, 6, 6, 12, 12, 12, 12, 12], np.int64)   # every padded shape, 12 from 7 rows
    for rows in [*range(1, 30), 35]:
        x = torch.randn(rows, k, generator=g)
        for with_bias in (False, True):
            want = torch.zeros(rows, width) if with_bias else torch.empty(rows, width)
            if with_bias:
                want[:, :n] = bias
            cpu_small_gemm._gemm(x.numpy().reshape(-1), rows, k, panels.numpy().reshape(-1), npan,
                                 want.numpy().reshape(-1), width, kb, with_bias)
            for cover in (g16.SPLIT, g16.PAD_ODD, one_pass):
                out = torch.full((rows + 12, width), 7.0)
                out[:rows] = 0.0
                if with_bias:
                    out[:rows, :n] = bias
                g16.gemm_with(x.numpy().reshape(-1), rows, k, panels.numpy().reshape(-1), npan,
                              out.numpy().reshape(-1), width, kb, with_bias, cover, g16.prefetch_elements(k, 4))
                assert torch.equal(out[:rows], want), (rows, with_bias)
                assert bool((out[rows:] == 7.0).all()), (rows, with_bias)


@pytest.mark.parametrize("n,k", [(1, 1), (17, 5), (200, 150), (3072, 512)])
def test_8_lane_pass_plans_sum_alike_and_store_only_their_rows(n, k):
    """The 8-lane kernel's pass plans (cpu_small_gemm.gemm_with: SPLIT, the rows after the 6-row passes through passes
    of 4, 2 and 1 rows; FIT, the rows left as one pass of their count, 9 as 5 + 4) give the same sums bit for bit, with
    and without bias, and write nothing past the rows asked for (sentinels after them stay)."""
    g, w, bias, panels, npan, width, kb = _remainder_case(n, k, 5 * n + k)
    for rows in [*range(1, 24), 25, 29, 31]:
        x = torch.randn(rows, k, generator=g)
        for with_bias in (False, True):
            outs = []
            for plan in (cpu_small_gemm.SPLIT, cpu_small_gemm.FIT):
                out = torch.full((rows + 6, width), 7.0)
                out[:rows] = 0.0
                if with_bias:
                    out[:rows, :n] = bias
                cpu_small_gemm.gemm_with(x.numpy().reshape(-1), rows, k, panels.numpy().reshape(-1), npan,
                                         out.numpy().reshape(-1), width, kb, with_bias, plan)
                assert bool((out[rows:] == 7.0).all()), (rows, with_bias)
                outs.append(out[:rows])
            assert torch.equal(outs[0], outs[1]), (rows, with_bias)
            want = x.double() @ w.double().t() + (bias.double() if with_bias else 0.0)
            assert (outs[1][:, :n].double() - want).abs().max().item() < 1e-3 * (1 + k ** 0.5)


def test_fit_plan_covers_every_row_count_with_6_row_passes_first():
    """FIT's schedule (`_tail_rows` + the plan's tail): every row count covered exactly, 6-row passes first, then one
    pass of the rows left, but 5 + 4 for 9 rows left after at least one 6-row pass."""
    for rows in range(1, 80):
        t = int(cpu_small_gemm._tail_rows(rows, cpu_small_gemm.FIT))
        tail = [int(v) for v in cpu_small_gemm.FIT[t] if v]
        assert (rows - t) % 6 == 0 and rows - t >= 0 and sum(tail) == t, rows
        want = [rows % 6] if rows % 6 else []
        if rows % 6 == 3 and rows >= 9:
            want = [5, 4]
        assert tail == want, (rows, tail)


@pytest.mark.parametrize("n,k", [(1, 1), (33, 7), (100, 130), (5000, 256), (4000, 576), (300, 1536)])
def test_columns_are_the_kernels_values_bit_for_bit(n, k):
    """cpu_small_gemm.columns (a few output columns of one row from the unpacked weight: the greedy screen's exact
    recompute) equals both kernels' outputs bit for bit, at one k block and at several (K = 576, 1536)."""
    from tokenplane.engine import cpu_small_gemm16

    g = torch.Generator().manual_seed(n * 3 + k)
    w = torch.randn(n, k, generator=g) * 0.05
    panels = cpu_small_gemm.pack(w)
    kernel = cpu_small_gemm._KERNEL[0]
    try:
        for rows in (1, 5, 13):
            x = torch.randn(rows, k, generator=g)
            cols = np.unique(np.random.default_rng(n).integers(0, n, min(n, 300)))
            for fn in (cpu_small_gemm._gemm, cpu_small_gemm16.gemm):
                cpu_small_gemm._KERNEL[0] = fn
                full = cpu_small_gemm.linear(x, panels, n).numpy()
                for r in range(rows):
                    got = cpu_small_gemm.columns(x[r], w, cols)
                    assert np.array_equal(got.view(np.uint32), full[r, cols].view(np.uint32)), (rows, r)
    finally:
        cpu_small_gemm._KERNEL[0] = kernel


@pytest.mark.parametrize("n,k", [(96, 64), (100, 200), (768, 256), (960, 576), (576, 1536), (49152, 576)])
def test_linear_sums_in_f_linears_order(n, k):
    """The block size `probe_k_block` finds on a 16 x k x 32 product carries over to other weights, widths, every row
    count and a bias: each row equals F.linear's (transformers' call; taken on 40 rows, its BLAS path) bit for bit."""
    kb = cpu_small_gemm.probe_k_block(k)
    if kb is None:
        pytest.skip(f"this torch's BLAS sums a {k}-long dot product in no order the kernel mirrors")
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g)
    x = torch.randn(40, k, generator=g)
    ref, refb = F.linear(x, w), F.linear(x, w, b)
    panels = cpu_small_gemm.pack(w)
    for rows in (1, 2, 3, 4, 5, 6, 7, 12, 16, 32):
        assert torch.equal(cpu_small_gemm.linear(x[:rows], panels, n), ref[:rows])
        assert torch.equal(cpu_small_gemm.linear(x[:rows], panels, n, b), refb[:rows])


def test_linear_reads_strided_inputs_and_rejects_a_wrong_width():
    w = torch.randn(32, 24)
    x = torch.randn(24, 3).t()                     # non-contiguous [3, 24]
    assert (cpu_small_gemm.linear(x, cpu_small_gemm.pack(w), 32) - F.linear(x, w)).abs().max().item() < 1e-5
    with pytest.raises(ValueError):
        cpu_small_gemm.linear(torch.randn(2, 23), cpu_small_gemm.pack(w), 32)


def test_applies_only_to_few_float32_rows_on_one_thread(one_thread):
    assert cpu_small_gemm.applies(torch.zeros(1, 8)) and cpu_small_gemm.applies(torch.zeros(8, 8))
    assert not cpu_small_gemm.applies(torch.zeros(cpu_small_gemm.MAX_ROWS + 1, 8))
    assert not cpu_small_gemm.applies(torch.zeros(2, 8, dtype=torch.float64))
    assert not cpu_small_gemm.applies(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert not cpu_small_gemm.applies(torch.zeros(8))
    torch.set_num_threads(2)
    try:
        assert not cpu_small_gemm.applies(torch.zeros(2, 8))
    finally:
        torch.set_num_threads(1)   # one_thread is module-scoped: later tests expect one thread


def test_packed_linear_and_vocab_projection_take_the_kernel_for_decode_rows(one_thread, monkeypatch):
    """Linear (after pack_cpu) routes 1-MAX_ROWS fp32 rows through the kernel, VocabProjection 1-VOCAB_MAX_ROWS, and
    larger batches through F.linear: every row equals transformers' F.linear over the whole batch bit for bit (the
    kernel sums in its order: test_linear_sums_in_f_linears_order)."""
    if cpu_small_gemm.probe_k_block(64) is None:
        pytest.skip("this torch's BLAS sums a 64-long dot product in no order the kernel mirrors")
    torch.manual_seed(0)
    lin = Linear(64, 96, bias=True)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        lin.bias.normal_()
    lin.pack_cpu()
    assert lin.cpu_panels is not None and lin.cpu_packed is None   # fp32 keeps no oneDNN copy
    vp = VocabProjection(lin.weight)
    calls = []
    real = cpu_small_gemm.linear
    monkeypatch.setattr(cpu_small_gemm, "linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    top = max(cpu_small_gemm.MAX_ROWS, cpu_small_gemm.VOCAB_MAX_ROWS)
    x = torch.randn(top + 1, 64)
    counts = (1, 3, 16, 17, 64, cpu_small_gemm.MAX_ROWS, cpu_small_gemm.MAX_ROWS + 1, cpu_small_gemm.VOCAB_MAX_ROWS,
              cpu_small_gemm.VOCAB_MAX_ROWS + 1)
    expected = []
    with torch.inference_mode():
        ref, refb = F.linear(x, lin.weight), F.linear(x, lin.weight, lin.bias)
        for rows in counts:
            assert torch.equal(lin(x[:rows]), refb[:rows])
            assert torch.equal(vp(x[:rows]), ref[:rows])
            expected += [rows] * ((rows <= cpu_small_gemm.MAX_ROWS) + (rows <= cpu_small_gemm.VOCAB_MAX_ROWS))
    assert calls == expected and cpu_small_gemm.MAX_ROWS + 1 not in calls
    lin.unpack_cpu()
    assert lin.cpu_panels is None and lin.cpu_packed is None


def test_pack_is_the_panel_layout_on_2mib_pages_when_large():
    """pack's copy holds the same values as the plain panel layout; a copy of 2 MiB or more starts on a 2 MiB
    boundary (cpu_malloc.huge_page_empty), a smaller one is a plain tensor."""
    from tokenplane.engine.cpu_malloc import huge_page_empty

    for n, k in ((1000, 576), (40, 24)):
        w = torch.randn(n, k)
        panels = cpu_small_gemm.pack(w)
        pad = torch.cat([w, w.new_zeros(panels.shape[0] * cpu_small_gemm.PANEL - n, k)])
        assert torch.equal(panels, pad.reshape(-1, cpu_small_gemm.PANEL, k).transpose(1, 2).contiguous())
        assert panels.is_contiguous()
        if panels.numel() * 4 >= 2 << 20:
            assert panels.data_ptr() % (2 << 20) == 0
    assert huge_page_empty(10).numel() == 10


def test_engine_kernels_cache_under_the_sources_key():
    """numba checks a cached kernel against its own file only, while the engine's kernels compile in cpu_simd's
    intrinsics from another file: their caches live under a key of every engine source (engine/numbacache.py), so
    a change to cpu_simd.py cannot leave this module's cached kernels on the old intrinsics; numba's own setting is
    restored for other code's kernels."""
    import os

    from numba import njit
    from numba.core import config

    from tokenplane.engine import cpu_small_gemm16, numbacache
    from tokenplane.route import entropy

    keyed = str(numbacache.cache_dir())
    for fn in (cpu_small_gemm16.prefetch_elements, entropy._entropy32):
        assert fn._cache._cache_path.startswith(keyed + os.sep)
    assert not njit(cache=True)(lambda x: x + 1)._cache._cache_path.startswith(keyed)
    assert config.CACHE_DIR != keyed

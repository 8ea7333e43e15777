"""The compiled CPU decode-attention kernel against PyTorch's SDPA over the same K/V gathered by block table.

Adversarial cases: scattered and repeated block ids (two rows reading the same prefix blocks), context lengths of 1,
exact block multiples and one past, GQA groups 1-4, rows out of order in a larger token batch (mixed batches), large
score magnitudes (the max-subtraction must hold), float32, float64 and bfloat16. Model-level exactness (logits vs transformers,
random schedules with rollbacks and prefix-cache hits) runs the kernel through tests/test_engine.py's "cpu" cases.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenplane.engine.cpu_decode_attention import available, paged_decode


def reference(q, kc, vc, table, n, bs, group, scale):
    """SDPA in float64 over the gathered K/V, and the largest |score| (the rounding error of a score is relative to
    it, and exp turns that into a relative error of the weights)."""
    q, kc, vc = q.double(), kc.double(), vc.double()
    kvh, d = kc.shape[0], kc.shape[2]
    blocks = torch.tensor(table[:-(-n // bs)])
    k = kc.unflatten(1, (-1, bs)).index_select(1, blocks).flatten(1, 2)[:, :n]
    v = vc.unflatten(1, (-1, bs)).index_select(1, blocks).flatten(1, 2)[:, :n]
    qh = q[:kvh * group].reshape(1, kvh, group, d)
    max_score = (qh @ k[None].transpose(-1, -2)).abs().max().item() * scale
    return F.scaled_dot_product_attention(qh, k[None], v[None], scale=scale).reshape(-1), max_score


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("kvh,group,d,bs", [(2, 2, 16, 4), (3, 3, 64, 16), (1, 4, 8, 16), (4, 1, 32, 3)])
def test_kernel_matches_sdpa(dtype, kvh, group, d, bs, prefetch):
    g = torch.Generator().manual_seed(kvh * 100 + group * 10 + bs)
    num_blocks = 64
    kc = torch.randn(kvh, num_blocks * bs, d, generator=g, dtype=dtype)
    vc = torch.randn(kvh, num_blocks * bs, d, generator=g, dtype=dtype)
    lens = [1, bs, bs + 1, 3 * bs - 1, 7 * bs, 5]
    rng = np.random.default_rng(bs)
    width = max(-(-n // bs) for n in lens)
    table = np.zeros((len(lens), width), dtype=np.int64)
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        table[i, :nb] = rng.choice(num_blocks, nb, replace=False)
    table[5, 0] = table[4, 0]   # two rows share a block (a prefix-cache hit)
    T = len(lens) + 3
    # q as the model passes it: the first heads of a wider [T, heads + kv_heads, d] tensor (a non-contiguous view);
    # scaled up so scores reach the hundreds and an unshifted exp would overflow in float32
    qk = torch.randn(T, kvh * group + kvh, d, generator=g, dtype=dtype) * 30
    q = qk[:, :kvh * group]
    rows = np.array([7, 0, 3, 1, 8, 5], dtype=np.int64)
    out = torch.full((T, kvh * group * d), float("nan"), dtype=dtype)
    scale = d ** -0.5
    paged_decode(q, kc, vc, table, np.array(lens, dtype=np.int64), rows, out, bs, group, scale, prefetch)
    # bfloat16 computes in float32 and rounds once at the end (half an ulp of bfloat16 on top of float32's error)
    eps = torch.finfo(torch.float32 if dtype == torch.bfloat16 else dtype).eps
    for i, n in enumerate(lens):
        ref, max_score = reference(q[rows[i]], kc, vc, table[i], n, bs, group, scale)
        err = (out[rows[i]].double() - ref).abs()
        if dtype == torch.bfloat16:
            err = (err - ref.abs() * torch.finfo(dtype).eps / 2).clamp(min=0)
        err = err.max().item()
        # about one rounding of each score (relative to the largest), and of a d-term and an n-term sum of values
        assert err < 2 * eps * (max_score + d + n) * max(1.0, vc.abs().max().item()), (i, err)
    untouched = sorted(set(range(T)) - set(rows.tolist()))
    assert torch.isnan(out[untouched]).all()   # rows that are not decode rows are left to the other kernel


def test_available_only_for_cpu_float32_float64_bfloat16():
    cpu = torch.device("cpu")
    assert available(torch.float32, cpu) and available(torch.float64, cpu) and available(torch.bfloat16, cpu)
    assert not available(torch.float16, cpu) and not available(torch.float32, torch.device("cuda"))


def test_bfloat16_rounding_matches_torch():
    """The store's float32 -> bfloat16 rounding is torch's (nearest even, NaN quiet), on values at every tie."""
    from numba import njit

    from tokenplane.engine.cpu_decode_attention import _store

    @njit
    def store_all(values):
        out = np.empty(values.shape[0], dtype=np.uint16)
        for i in range(values.shape[0]):
            out[i] = _store(values[i], out[i])
        return out

    bits = np.arange(0, 1 << 32, 65521, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([bits, (bits & 0xFFFF0000) | 0x8000, (bits & 0xFFFF0000) | 0x7FFF,
                           np.array([0x7F800000, 0xFF800000, 0x7FC00001, 0x7F7FFFFF], dtype=np.uint32)])
    f = bits.view(np.float32)
    got = store_all(f)
    want = torch.from_numpy(f.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(f)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.isnan(torch.from_numpy(got[nan].view(np.int16)).view(torch.bfloat16).float().numpy()).all()


def test_float32_softmax_exp_is_within_3_ulp():
    """The kernel's float32 exp (a polynomial, so it vectorizes) against exp in float64, on a dense grid of the
    softmax numerators' range [-87, 0] and on its edges; float64 keeps libm's exp."""
    from numba import njit

    from tokenplane.engine.cpu_decode_attention import _exp_nonpos

    @njit
    def apply(xs):  # noqa: ANN001, ANN202
        out = np.empty_like(xs)
        for i in range(xs.shape[0]):
            out[i] = _exp_nonpos(xs[i])
        return out

    xs = np.concatenate([np.linspace(-87, 0, 1_000_001, dtype=np.float32),
                         np.array([0.0, -0.0, -1e-30, -1e-8, -0.34657359, 0.34657359 * -3], np.float32)])
    got = apply(xs).astype(np.float64)
    ref = np.exp(xs.astype(np.float64))
    ulp = np.spacing(ref.astype(np.float32)).astype(np.float64)
    assert (np.abs(got - ref) <= 3 * ulp).all()
    assert apply(np.array([0.0], np.float32))[0] == 1.0
    far = apply(np.array([-88.0, -1e4], np.float32))          # below the clamp: tiny, never above e^-87
    assert (far > 0).all() and (far <= np.float32(np.exp(-87.0)) * 1.000001).all()
    assert apply(np.array([-2.0]))[0] == np.exp(-2.0)          # float64: libm's exp itself


def test_16_lane_softmax_numerators_match_float64():
    """softmax_numerators(16) (exponents on 16 lanes, float32 lane sums per 1,024 scores): every exponent within 3
    ulp of exp in float64, the returned sum within 1e-6 relative, the maximum subtracted, a tail past the last 16
    left to the scalar form; lengths around the vector and block edges."""
    from numba import njit

    from tokenplane.engine.cpu_decode_paging import softmax_numerators

    softmax = softmax_numerators(16)

    @njit
    def run(scores, r0, ctx):  # noqa: ANN001, ANN202
        tmp = np.empty(16, np.float32)
        return softmax(scores, r0, ctx, tmp)

    rng = np.random.default_rng(5)
    for ctx in (1, 15, 16, 17, 1023, 1024, 1040, 3001):
        for spread in (1.0, 30.0, 200.0):
            x = (rng.standard_normal(ctx + 7) * spread).astype(np.float32)
            work = x.copy()
            tot = run(work, 3, ctx)
            seg = x[3:3 + ctx]
            shifted = (seg - seg.max()).astype(np.float64)     # the kernel's float32 difference, then exact exp
            ref = np.exp(np.maximum(shifted, -87.0))
            ulp = np.spacing(ref.astype(np.float32)).astype(np.float64)
            assert (np.abs(work[3:3 + ctx] - ref) <= 3 * ulp).all()
            assert abs(tot - work[3:3 + ctx].astype(np.float64).sum()) <= 1e-6 * tot
            assert (work[:3] == x[:3]).all() and (work[3 + ctx:] == x[3 + ctx:]).all()


def mixed_tables(lens: list[int], bs: int, scatter_from: int, num_blocks: int, seed: int) -> np.ndarray:
    """Block tables for contexts of `lens` tokens: falling runs (as the block manager hands out a finished sequence's
    blocks), climbing runs, and blocks scattered over [scatter_from, num_blocks), in turn."""
    table = np.zeros((len(lens), max(-(-n // bs) for n in lens)), dtype=np.int64)
    rng = np.random.default_rng(seed)
    start = 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        if i % 3 == 0:
            table[i, :nb] = np.arange(start + nb - 1, start - 1, -1)
        elif i % 3 == 1:
            table[i, :nb] = np.arange(start, start + nb)
        else:
            table[i, :nb] = rng.choice(np.arange(scatter_from, num_blocks), nb, replace=False)
        start += nb if i % 3 != 2 else 0
    return table


@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_float32_vector_kernel_matches_generic_on_long_falling_and_scattered_tables(group):
    """float32 runs cpu_decode_attention_vec's kernel (KS = 8 / group keys scored together, d walked in parts):
    against SDPA and against the generic kernel over long contexts whose block tables fall (read in reverse), climb,
    or are scattered, with context lengths that end mid-block and mid-group of keys."""
    from tokenplane.engine import cpu_decode_attention_vec
    from tokenplane.engine.cpu_decode_attention import _descending, _kernel, kernel_for

    kvh, d, bs = 2, 64, 16
    assert kernel_for(torch.float32, d, group) is cpu_decode_attention_vec.kernel(d, group)
    assert kernel_for(torch.float64, d, group) is _kernel(d, group)
    g = torch.Generator().manual_seed(group)
    num_blocks = 200
    kc = torch.randn(kvh, num_blocks * bs, d, generator=g)
    vc = torch.randn(kvh, num_blocks * bs, d, generator=g)
    lens = [517, 300, 33, 1, 16 * 40, 250]
    table = mixed_tables(lens, bs, 150, num_blocks, group)
    assert _descending(table, 0, -(-lens[0] // bs)) and not _descending(table, 1, -(-lens[1] // bs))
    q = torch.randn(len(lens), kvh * group, d, generator=g) * 3
    rows = np.arange(len(lens), dtype=np.int64)
    ctx = np.array(lens, dtype=np.int64)
    scale = d ** -0.5
    out = torch.full((len(lens), kvh * group * d), float("nan"))
    paged_decode(q, kc, vc, table, ctx, rows, out, bs, group, scale)
    generic = np.full((len(lens), kvh * group * d), np.nan, dtype=np.float32)
    _kernel(d, group)(q.numpy(), kc.numpy(), vc.numpy(), table, ctx, rows, generic, bs, scale, True,
                      np.empty(0, np.float32))
    eps = torch.finfo(torch.float32).eps
    for i, n in enumerate(lens):
        ref, max_score = reference(q[i], kc, vc, table[i], n, bs, group, scale)
        tol = 2 * eps * (max_score + d + n) * vc.abs().max().item()
        assert (out[i].double() - ref).abs().max().item() < tol, i
        assert np.abs(generic[i] - ref.numpy()).max() < tol, i
    from tokenplane.engine.cpu_simd import HOST_AVX512
    for width in (8, 16) if HOST_AVX512 else (8,):     # each vector width of the kernel, whatever the default
        got = np.full((len(lens), kvh * group * d), np.nan, dtype=np.float32)
        cpu_decode_attention_vec.kernel(d, group, width)(q.numpy(), kc.numpy(), vc.numpy(), table, ctx, rows, got, bs,
                                                         scale, True, np.empty(0, np.float32))
        for i, n in enumerate(lens):
            ref, max_score = reference(q[i], kc, vc, table[i], n, bs, group, scale)
            tol = 2 * eps * (max_score + d + n) * vc.abs().max().item()
            assert np.abs(got[i] - ref.numpy()).max() < tol, (width, i)


@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_bfloat16_vector_kernel_equals_the_generic_bf16_kernel(group):
    """bfloat16 caches on AVX-512 hosts run the vector form on 16 lanes: within one bf16 rounding of the generic bf16
    kernel (both compute in float32 from the same exactly widened values and round once) and of SDPA in float64,
    over long falling / climbing / scattered tables with contexts ending mid-block."""
    from tokenplane.engine import cpu_decode_attention_vec
    from tokenplane.engine.cpu_decode_attention import _kernel, kernel_for
    from tokenplane.engine.cpu_elements import as_array

    kvh, d, bs = 2, 64, 16
    if not cpu_decode_attention_vec.applies_bf16(d, group):
        assert kernel_for(torch.bfloat16, d, group) is _kernel(d, group)
        pytest.skip("no 16-lane vectors on this host: bfloat16 runs the generic kernel")
    assert kernel_for(torch.bfloat16, d, group) is cpu_decode_attention_vec.kernel(d, group, 16, True)
    g = torch.Generator().manual_seed(10 + group)
    num_blocks = 120
    kc = torch.randn(kvh, num_blocks * bs, d, generator=g).bfloat16()
    vc = torch.randn(kvh, num_blocks * bs, d, generator=g).bfloat16()
    lens = [517, 300, 33, 1, 16 * 20, 250]
    table = mixed_tables(lens, bs, 90, num_blocks, group)
    q = (torch.randn(len(lens), kvh * group, d, generator=g) * 3).bfloat16()
    rows = np.arange(len(lens), dtype=np.int64)
    ctx = np.array(lens, dtype=np.int64)
    scale = d ** -0.5
    out = torch.full((len(lens), kvh * group * d), float("nan")).bfloat16()
    paged_decode(q, kc, vc, table, ctx, rows, out, bs, group, scale)
    generic = torch.full_like(out, float("nan"))
    _kernel(d, group)(as_array(q), as_array(kc), as_array(vc), table, ctx, rows, as_array(generic), bs, scale, True,
                      np.empty(0, np.float32))
    ulp = 2.0 ** -7
    for i, n in enumerate(lens):
        ref, max_score = reference(q[i].double(), kc.double(), vc.double(), table[i], n, bs, group, scale)
        a, b = out[i].double(), generic[i].double()
        assert ((a - b).abs() <= ulp * torch.maximum(a.abs(), b.abs()) + 1e-6).all(), i
        tol = ulp * ref.abs() + 4 * torch.finfo(torch.float32).eps * (max_score + d + n) * 4
        assert ((a - ref).abs() <= tol).all(), i


@pytest.mark.parametrize("d,group,width", [(16, 3, 16), (48, 3, 16), (16, 1, 16), (24, 3, 8), (8, 3, 8), (48, 2, 8)])
def test_float32_vector_kernel_shapes_with_odd_accumulator_counts(d, group, width):
    """Head sizes and groups where the value accumulators (group x chunks per part) are odd or the chunks of d do
    not split evenly: every output within the float32 bound of float64 SDPA, and the kernel's buffers untouched past
    their ends (each accumulator loaded and stored only if it exists)."""
    from tokenplane.engine import cpu_decode_attention_vec
    from tokenplane.engine.cpu_simd import HOST_AVX512

    if width == 16 and not HOST_AVX512:
        pytest.skip("16-lane kernels run on AVX-512 hosts only")
    kvh, bs = 2, 16
    g = torch.Generator().manual_seed(d * 10 + group)
    kc = torch.randn(kvh, 60 * bs, d, generator=g)
    vc = torch.randn(kvh, 60 * bs, d, generator=g)
    lens = [1, 37, 300]
    table = np.arange(3 * 19, dtype=np.int64).reshape(3, 19)
    q = torch.randn(3, kvh * group, d, generator=g) * 2
    out = np.full((3, kvh * group * d + 16), 7.0, dtype=np.float32)     # 16 guard floats past the row
    scale = d ** -0.5
    cpu_decode_attention_vec.kernel(d, group, width)(q.numpy(), kc.numpy(), vc.numpy(), table, np.array(lens),
                                                     np.arange(3, dtype=np.int64), out, bs, scale, True,
                                                     np.empty(0, np.float32))
    assert (out[:, kvh * group * d:] == 7.0).all()
    eps = torch.finfo(torch.float32).eps
    for i, n in enumerate(lens):
        ref, max_score = reference(q[i], kc, vc, table[i], n, bs, group, scale)
        tol = 2 * eps * (max_score + d + n) * vc.abs().max().item()
        assert np.abs(out[i, :kvh * group * d] - ref.numpy()).max() < tol


@pytest.mark.parametrize("d,group,bs", [(64, 3, 16), (64, 1, 16), (32, 2, 8), (128, 4, 32), (64, 3, 32), (96, 2, 16)])
def test_bfloat16_even_odd_kernel_matches_the_vector_form_and_sdpa(d, group, bs):
    """cpu_decode_attention_bf16 (even/odd widening, 16-wide score reduction): within one bf16 rounding of the vector
    form and of float64 SDPA, with contexts ending mid-block and mid-group of keys, falling / climbing / scattered
    tables, and NaN in every slot past a row's context (the kernel scores those slots with their group and must drop
    them) and in the rows it must not write."""
    from tokenplane.engine import cpu_decode_attention_bf16, cpu_decode_attention_vec
    from tokenplane.engine.cpu_decode_attention import kernel_for
    from tokenplane.engine.cpu_elements import as_array

    if not cpu_decode_attention_bf16.applies(d, group, bs):
        pytest.skip("no AVX-512 on this host: bfloat16 runs the other kernels")
    assert kernel_for(torch.bfloat16, d, group, bs) is cpu_decode_attention_bf16.kernel(d, group)
    assert kernel_for(torch.bfloat16, d, group, bs, False) is not cpu_decode_attention_bf16.kernel(d, group)
    kvh, num_blocks = 2, 160
    g = torch.Generator().manual_seed(d + group + bs)
    kc = torch.randn(kvh, num_blocks * bs, d, generator=g).bfloat16()
    vc = torch.randn(kvh, num_blocks * bs, d, generator=g).bfloat16()
    # the longest context climbs (read in table order), so scores written past a context would land on the next
    # head's first scores after they were computed
    lens = [300, 517, 33, 1, bs * 20, 250, bs + 3]
    table = mixed_tables(lens, bs, 120, num_blocks, group)
    used = {int(table[i, t // bs]) * bs + t % bs for i, n in enumerate(lens) for t in range(n)}
    for i, n in enumerate(lens):   # poison the slots past each context in its last block (no other row's)
        last = int(table[i, -(-n // bs) - 1])
        for slot in range(last * bs + n % bs if n % bs else (last + 1) * bs, (last + 1) * bs):
            if slot not in used:
                kc[:, slot] = vc[:, slot] = float("nan")
    T = len(lens) + 2
    q = (torch.randn(T, kvh * group, d, generator=g) * 3).bfloat16()
    rows = np.array([1, 0, 3, 2, 6, 5, 8], dtype=np.int64)
    ctx = np.array(lens, dtype=np.int64)
    scale = d ** -0.5
    out = torch.full((T, kvh * group * d), float("nan")).bfloat16()
    paged_decode(q, kc, vc, table, ctx, rows, out, bs, group, scale)
    other = torch.full_like(out, float("nan"))
    if cpu_decode_attention_vec.applies_bf16(d, group):
        kernel_for(torch.bfloat16, d, group, bs, False)(as_array(q), as_array(kc), as_array(vc), table, ctx, rows,
                                                         as_array(other), bs, scale, True, np.empty(0, np.float32))
    ulp = 2.0 ** -7
    for i, n in enumerate(lens):
        r = rows[i]
        ref, max_score = reference(q[r].double(), kc.double(), vc.double(), table[i], n, bs, group, scale)
        a = out[r].double()
        assert torch.isfinite(a).all(), i
        if cpu_decode_attention_vec.applies_bf16(d, group):
            b = other[r].double()
            assert ((a - b).abs() <= ulp * torch.maximum(a.abs(), b.abs()) + 1e-6).all(), i
        tol = ulp * ref.abs() + 4 * torch.finfo(torch.float32).eps * (max_score + d + n) * 4
        assert ((a - ref).abs() <= tol).all(), i
    assert torch.isnan(out[[4, 7]]).all()


def test_bfloat16_even_odd_kernel_needs_blocks_its_key_groups_divide():
    from tokenplane.engine import cpu_decode_attention_bf16 as k

    assert [k.keys_per_group(g) for g in (1, 2, 3, 4)] == [16, 8, 4, 4]
    assert not k.applies(64, 3, 6) and not k.applies(48, 2, 16) and not k.applies(64, 5, 16)

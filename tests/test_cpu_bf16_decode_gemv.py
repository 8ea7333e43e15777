"""cpu_bf16_gemv's bfloat16 decode path (`linear_bf16_io`, `swiglu_bf16_io`; AVX-512 panels, or AMX tiles where the
host has them) against float64 references, oneDNN's packed bf16 path and each other, and its use by Linear / SwiGLU at
1-MAX_ROWS rows."""
from __future__ import annotations

import pytest
import torch

from tokenplane.engine import cpu_amx, cpu_bf16_gemv
from tokenplane.engine.cpu_simd import HOST_AVX512
from tokenplane.engine.layers import SwiGLU, cpu_pack, cpu_packing_supported, cpu_swiglu

pytestmark = pytest.mark.skipif(not HOST_AVX512, reason="the bf16 decode panels need 16-lane vectors")

# N past a multiple of 16 / 32, K past one of 16 (AVX-512 panels even on AMX hosts) or a multiple of 32 (AMX there)
SHAPES = [(960, 576), (40, 24), (17, 48), (100, 72), (50, 96)]
MAX = cpu_bf16_gemv.MAX_ROWS


def _ulp_bound(ref: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp of each value plus a float32-sum margin: a correctly rounded result of a float32 sum lies within
    it."""
    return ref.abs() * 2.0 ** -7 + 1e-6


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 16, 20, 33, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_within_one_ulp_of_float64(one_thread, n, k, rows, with_bias):
    g = torch.Generator().manual_seed(n * 100 + k + rows)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    b = (torch.randn(n, generator=g) * 0.1).bfloat16() if with_bias else None
    x = torch.randn(rows, k, generator=g).bfloat16()
    out = cpu_bf16_gemv.linear_bf16_io(x, cpu_bf16_gemv.decode_panels_for(w), n, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    assert ((out.double() - ref).abs() <= _ulp_bound(ref)).all()


@pytest.mark.skipif(not cpu_packing_supported(torch.bfloat16), reason="no oneDNN bf16 on this CPU")
@pytest.mark.parametrize("rows", [1, 4, 8, 16])
def test_linear_and_swiglu_agree_with_onednn(one_thread, rows):
    """Both sum in float32 and round once (SwiGLU: twice, as cpu_swiglu's two stages): outputs equal but for values
    that the summation order moves across a rounding boundary."""
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(384, 256, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, 256, generator=g).bfloat16()
    out = cpu_bf16_gemv.linear_bf16_io(x, cpu_bf16_gemv.decode_panels_for(w), 384)
    ref = torch.ops.mkldnn._linear_pointwise(x, cpu_pack(w), None, "none", [], "")
    assert (out == ref).float().mean().item() >= 0.99
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2.0 ** -7 + 1e-6).all()
    f = 192
    gate, up = w[:f].contiguous(), w[f:].contiguous()
    h = cpu_bf16_gemv.swiglu_bf16_io(x, cpu_bf16_gemv.decode_panels_for(w), f)
    h_ref = cpu_swiglu(x, cpu_pack(gate), cpu_pack(up), None, None)
    assert (h == h_ref).float().mean().item() >= 0.99
    assert ((h.float() - h_ref.float()).abs() <= h_ref.float().abs() * 2.0 ** -6 + 1e-5).all()


@pytest.mark.parametrize("f,k,rows", [(40, 32, 3), (48, 64, 20), (64, 96, 40), (40, 96, 5)])
def test_swiglu_matches_float64_silu_mul(one_thread, f, k, rows):
    """F a multiple of 16 and K of 32 take the AMX pass that pairs gate and up panels (where the host has AMX); the
    others the sums first."""
    g = torch.Generator().manual_seed(7 + f + rows)
    w = (torch.randn(2 * f, k, generator=g) * 0.3).bfloat16()
    b = (torch.randn(2 * f, generator=g) * 0.1).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    h = cpu_bf16_gemv.swiglu_bf16_io(x, cpu_bf16_gemv.decode_panels_for(w), f, b)
    s = x.double() @ w.double().T + b.double()
    ref = torch.nn.functional.silu(s[:, :f]) * s[:, f:]
    assert h.shape == (rows, f)
    assert ((h.double() - ref).abs() <= ref.abs() * 2.0 ** -6 + 1e-5).all()


def test_modules_take_the_panels_at_1_to_max_rows_only(one_thread, monkeypatch):
    torch.manual_seed(0)
    mlp = SwiGLU(64, 96, bias=False).bfloat16()
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        lin.weight.data.normal_(0, 0.1)
    mlp.gate_up_proj.pack_cpu()
    mlp.down_proj.pack_cpu()
    mlp.pack_cpu()
    calls = []
    real_linear, real_swiglu = cpu_bf16_gemv.linear_bf16_io, cpu_bf16_gemv.swiglu_bf16_io
    monkeypatch.setattr(cpu_bf16_gemv, "linear_bf16_io", lambda *a: calls.append("linear") or real_linear(*a))
    monkeypatch.setattr(cpu_bf16_gemv, "swiglu_bf16_io", lambda *a: calls.append("swiglu") or real_swiglu(*a))
    x8, x9 = torch.randn(MAX, 64).bfloat16(), torch.randn(MAX + 1, 64).bfloat16()
    y8 = mlp(x8)
    assert calls == ["swiglu", "linear"]
    calls.clear()
    y9 = mlp(x9)
    assert calls == []
    gu = x8.double() @ mlp.gate_up_proj.weight.double().T
    ref = (torch.nn.functional.silu(gu[:, :96]) * gu[:, 96:]) @ mlp.down_proj.weight.double().T
    assert ((y8.double() - ref).abs() <= ref.abs().max() * 2.0 ** -5).all()
    assert y9.shape == (MAX + 1, 64)
    mlp.gate_up_proj.unpack_cpu()
    assert mlp.gate_up_proj.cpu_bf16_panels is None


def test_switch_off_keeps_no_panel_copy():
    w = torch.randn(32, 16).bfloat16()
    cpu_bf16_gemv.DECODE_PANELS[0] = False
    try:
        assert cpu_bf16_gemv.decode_panels_for(w) is None
    finally:
        cpu_bf16_gemv.DECODE_PANELS[0] = True
    assert cpu_bf16_gemv.decode_panels_for(w) is not None
    assert cpu_bf16_gemv.decode_panels_for(w.float()) is None
    assert not cpu_bf16_gemv.applies(torch.zeros(MAX + 1, 16, dtype=torch.bfloat16))


def test_bf16_vocab_projection_takes_the_panels_at_1_to_max_rows(one_thread, monkeypatch):
    from tokenplane.engine.layers import VocabProjection

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(1000, 64, generator=g) * 0.1).bfloat16()
    vp = VocabProjection(w)
    assert vp.bf16_panels is not None
    calls = []
    real = cpu_bf16_gemv.linear_bf16_io
    monkeypatch.setattr(cpu_bf16_gemv, "linear_bf16_io", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, MAX, MAX + 1):
        h = torch.randn(rows, 64, generator=g).bfloat16()
        out = vp(h)
        ref = h.double() @ w.double().T
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 1000)
        assert ((out.double() - ref).abs() <= _ulp_bound(ref)).all()
    assert calls == [1, MAX]
    assert VocabProjection(w.float()).bf16_panels is None


@pytest.mark.skipif(not cpu_amx.HOST_AMX, reason="no AMX tiles on this host")
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 40, 70])
def test_amx_sums_equal_avx512_panels_but_for_order(one_thread, rows):
    """The AMX tiles and the AVX-512 panels both sum exact bf16 products in float32 (different orders): every sum
    within float32 rounding of the float64 sum, and the two kernels' bf16 outputs equal for >= 99% of values."""
    g = torch.Generator().manual_seed(rows)
    n, k = 200, 96
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    amx_panels = cpu_bf16_gemv.decode_panels_for(w)
    assert cpu_bf16_gemv.panel_shape(amx_panels) == (13, k, True)
    avx_panels = cpu_bf16_gemv.pack_bf16(w.float())
    assert cpu_bf16_gemv.panel_shape(avx_panels) == (13, k, False)
    a = cpu_bf16_gemv.linear_bf16_io(x, amx_panels, n)
    b = cpu_bf16_gemv.linear_bf16_io(x, avx_panels, n)
    assert (a == b).float().mean().item() >= 0.99
    sums = torch.empty(rows, 13 * 16)
    cpu_amx.sums(x.view(torch.int16).numpy().view("uint16").reshape(-1), rows, k, amx_panels.reshape(-1), 13,
                 sums.numpy().reshape(-1))
    ref = x.double() @ w.double().T
    gamma = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)
    bound = gamma * (x.double().abs() @ w.double().abs().T)
    assert ((sums[:, :n].double() - ref).abs() <= bound + 1e-30).all()
    assert (sums[:, n:] == 0).all()      # the padding columns


@pytest.mark.skipif(not cpu_amx.HOST_AMX or not cpu_packing_supported(torch.bfloat16),
                    reason="no AMX tiles or no oneDNN bf16 on this host")
def test_onednn_runs_after_an_amx_kernel_released_the_tiles(one_thread):
    """oneDNN's bf16 linears use the same tiles; a kernel here releases them, and oneDNN's result is unchanged."""
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(256, 512, generator=g) * 0.05).bfloat16()
    x = torch.randn(64, 512, generator=g).bfloat16()
    packed = cpu_pack(w)
    before = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    cpu_bf16_gemv.linear_bf16_io(x[:5], cpu_bf16_gemv.decode_panels_for(w), 256)
    after = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    assert torch.equal(before, after)


def test_swiglu_epilogue_over_wide_gate_values():
    """The epilogue's swish (sigmoid from exp(-|g|), 16 lanes at a time) against float64 over gates from -60 to 60,
    zeros and ties included, every row length off a multiple of 16: within the two bf16 roundings."""
    g = torch.linspace(-60.0, 60.0, 3 * 37).reshape(3, 37)
    g[0, :5] = 0.0
    up = torch.randn(3, 37, generator=torch.Generator().manual_seed(5))
    acc = torch.cat([g, up], dim=1).contiguous()
    out = torch.empty(3, 37, dtype=torch.bfloat16)
    cpu_bf16_gemv._swiglu_out(acc.numpy().reshape(-1), 3, 74, out.view(torch.int16).numpy().view("uint16").reshape(-1),
                              37)
    gd = g.double()
    s = (gd * torch.sigmoid(gd)).bfloat16().double()
    ref = up.double() * s
    assert torch.isfinite(out.float()).all()
    assert ((out.double() - ref).abs() <= ref.abs() * 2.0 ** -6 + 1e-30).all()


@pytest.mark.skipif(not cpu_amx.HOST_AMX, reason="no AMX tiles on this host")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_vector_stream_over_amx_panels_equals_the_avx512_panels(one_thread, rows):
    """`gemv_vnni` reads the AMX copy (k pairs interleaved) with the AVX-512 panels' chain of fused multiply-adds over
    k in order: the same float32 sums bit for bit, an odd panel count included."""
    g = torch.Generator().manual_seed(40 + rows)
    n, k = 208, 64
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    x = torch.randn(rows, k, generator=g)
    a = torch.empty(rows, n)
    b = torch.empty(rows, n)
    cpu_bf16_gemv.gemv_vnni(x.numpy().reshape(-1), rows, k, cpu_amx.pack(w).reshape(-1), n // 16, a.numpy().reshape(-1),
                            n)
    cpu_bf16_gemv.gemv_bf16(x.numpy().reshape(-1), rows, k, cpu_bf16_gemv.pack_bf16(w.float()).reshape(-1), n // 16,
                            b.numpy().reshape(-1), n)
    assert torch.equal(a, b)

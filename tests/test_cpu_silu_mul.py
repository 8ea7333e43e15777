"""cpu_silu_mul (SwiGLU's silu(gate) * up on float32 rows) against float64, its whole vectors against its padded row
tails, and its use by the model path (one thread) and the compiled decode stack."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenplane.engine.cpu_silu_mul import silu_mul_flat
from tokenplane.engine.layers import SwiGLU


def _reference(gu: torch.Tensor, ffn: int) -> torch.Tensor:
    g = gu[:, :ffn].double()
    return g * torch.sigmoid(g) * gu[:, ffn:2 * ffn].double()


def _run(gu: torch.Tensor, ffn: int) -> torch.Tensor:
    rows = gu.shape[0]
    out = torch.full((rows, ffn), float("nan"))
    silu_mul_flat(gu.contiguous().numpy().reshape(-1), rows, gu.shape[1], ffn, out.numpy().reshape(-1))
    return out


@pytest.mark.parametrize("rows,ffn", [(1, 8), (3, 100), (16, 1536), (64, 17), (5, 7)])
def test_within_a_few_ulp_of_float64(rows, ffn):
    g = torch.Generator().manual_seed(rows * 1000 + ffn)
    gu = torch.randn(rows, 2 * ffn, generator=g) * 6
    out = _run(gu, ffn)
    ref = _reference(gu, ffn)
    # the exponent is within 3 ulp, then a division and two products: 8 ulp of float32 bounds the product
    assert ((out.double() - ref).abs() <= ref.abs() * 8 * 2.0 ** -24 + 1e-30).all()


def test_extremes():
    """Gates far below zero (exp(-|g|) at its floor e^-87: silu is g * e^-87, under 1e-33 of |g|, never NaN), far
    above (silu = g), zero, and signed zeros."""
    gate = torch.tensor([-1e4, -200.0, -87.0, -20.0, -0.0, 0.0, 1e-30, 20.0, 200.0, 1e4, 3.0, -3.0, 0.5, -0.5, 1.0, -1.0])
    up = torch.full_like(gate, 2.0)
    out = _run(torch.cat([gate, up])[None], gate.numel())[0]
    assert torch.isfinite(out).all()
    ref = _reference(torch.cat([gate, up])[None].double(), gate.numel())[0]
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-33 * 2e4)
    assert (out[:3] <= 0).all()
    assert out[7].item() == 2 * 20.0 and out[9].item() == 2 * 1e4


def test_whole_vectors_equal_the_padded_tail():
    """Every element alone: the same values computed by whole vectors (ffn 448) and as row tails (rows of 7,
    below any vector width) are the same bits."""
    g = torch.Generator().manual_seed(7)
    vals = torch.randn(2, 7 * 64, generator=g) * 10
    whole = torch.cat([vals[0], vals[1]])[None]                      # one row: 448 gates, then 448 ups
    tail = torch.cat([vals[0].reshape(64, 7), vals[1].reshape(64, 7)], dim=1)   # 64 rows of 7 gates, 7 ups
    assert torch.equal(_run(whole, 448).reshape(-1), _run(tail, 7).reshape(-1))


def test_rows_are_independent_of_the_stride():
    """Rows read at their stride (a padded product) give the rows computed alone."""
    g = torch.Generator().manual_seed(3)
    gu = torch.randn(4, 2 * 40 + 24, generator=g)
    rows = _run(gu, 40)
    for r in range(4):
        assert torch.equal(rows[r], _run(gu[r:r + 1, :80], 40)[0])


def test_model_path_uses_it_on_one_thread(one_thread):
    mlp = SwiGLU(32, 48, bias=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(torch.randn(96, 32, generator=g) * 0.3)
        mlp.down_proj.weight.copy_(torch.randn(32, 48, generator=g) * 0.3)
    x = torch.randn(20, 32, generator=g)
    with torch.no_grad():
        out = mlp(x)
        gu = x @ mlp.gate_up_proj.weight.T
        expect = mlp.down_proj(_run(gu, 48))
        ref = (_reference(gu.double(), 48) @ mlp.down_proj.weight.double().T)
    assert torch.equal(out, expect)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)
    assert not np.isnan(out.numpy()).any()

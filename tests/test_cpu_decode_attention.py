"""The compiled CPU decode-attention kernel against PyTorch's SDPA over the same K/V gathered by block table.

Adversarial cases: scattered and repeated block ids (two rows reading the same prefix blocks), context lengths of 1,
exact block multiples and one past, GQA groups 1-4, rows out of order in a larger token batch (mixed batches), large
score magnitudes (the max-subtraction must hold), float32 and float64. Model-level exactness (logits vs transformers,
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
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
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
    eps = torch.finfo(dtype).eps
    for i, n in enumerate(lens):
        ref, max_score = reference(q[rows[i]], kc, vc, table[i], n, bs, group, scale)
        err = (out[rows[i]].double() - ref).abs().max().item()
        # about one rounding of each score (relative to the largest), and of a d-term and an n-term sum of values
        assert err < 2 * eps * (max_score + d + n) * max(1.0, vc.abs().max().item()), (i, err)
    untouched = sorted(set(range(T)) - set(rows.tolist()))
    assert torch.isnan(out[untouched]).all()   # rows that are not decode rows are left to the other kernel


def test_available_only_for_cpu_float32_float64():
    cpu = torch.device("cpu")
    assert available(torch.float32, cpu) and available(torch.float64, cpu)
    assert not available(torch.bfloat16, cpu) and not available(torch.float32, torch.device("cuda"))

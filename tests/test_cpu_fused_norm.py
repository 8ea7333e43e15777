"""The fused residual add + RMSNorm against the PyTorch ops it replaces, and the model's fused / row-pruned paths
against its plain one."""
from __future__ import annotations

import pytest
import torch

from tokenplane.engine import ModelRunner, Sequence, load_model
from tokenplane.engine.cpu_fused_norm import add_rms_norm_, fused_norm_applies
from tokenplane.engine.layers import rms_norm


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-14)])
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 576), (300, 96)])
def test_add_rms_norm_matches_torch(dtype, tol, rows, dim):
    g = torch.Generator().manual_seed(rows * dim)
    a = torch.randn(rows, dim, generator=g, dtype=dtype) * 3
    x = torch.randn(rows, dim, generator=g, dtype=dtype)
    w = torch.randn(dim, generator=g, dtype=dtype)
    assert fused_norm_applies(a, w)
    want_sum = a + x
    want = rms_norm(want_sum, w, 1e-6)
    got = add_rms_norm_(a, x, w, 1e-6)
    assert torch.equal(a, want_sum)   # the residual stream: the same IEEE add, in place
    assert (got - want).abs().max().item() <= tol * want.abs().max().item()
    plain = add_rms_norm_(want_sum.clone(), None, w, 1e-6)   # no add: the norm alone
    assert torch.equal(plain, got)


@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 576), (300, 96)])
def test_add_rms_norm_bf16_rounds_where_torch_rounds(rows, dim):
    """bf16: the residual add bit for bit (an fp32 add rounded to nearest even), the normed rows equal transformers'
    bf16 RMSNorm but where the float32 sum of squares, summed in another order, crosses a rounding boundary."""
    g = torch.Generator().manual_seed(rows + dim)
    a = (torch.randn(rows, dim, generator=g) * 3).to(torch.bfloat16)
    x = torch.randn(rows, dim, generator=g).to(torch.bfloat16)
    w = (torch.rand(dim, generator=g) + 0.5).to(torch.bfloat16)
    assert fused_norm_applies(a, w)
    want_sum = a + x
    want = rms_norm(want_sum, w, 1e-6)
    got = add_rms_norm_(a, x, w, 1e-6)
    assert torch.equal(a, want_sum)
    assert (got != want).float().mean().item() <= 0.01
    assert (got.float() - want.float()).abs().max().item() <= 2 ** -7 * want.float().abs().max().item()


def test_not_applicable_off_cpu_dtypes():
    assert not fused_norm_applies(torch.zeros(2, 4, dtype=torch.float16), torch.zeros(4, dtype=torch.float16))
    assert not fused_norm_applies(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(4))
    assert not fused_norm_applies(torch.zeros(2, 2, 4), torch.zeros(4))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12), (torch.bfloat16, 0.1)])
def test_model_paths_agree(dtype, tol):
    """fused_norm and prune_rows on/off: the same last-position logits within float rounding, chunked prefill too."""
    torch.set_num_threads(1)
    cfg, model = load_model("test-small", dtype=dtype, seed=0)
    runner = ModelRunner(model, cfg, num_blocks=64, block_size=16)
    prompts = [[(7 * i + 3 * t) % 500 + 1 for t in range(n)] for i, n in enumerate((37, 64, 5))]
    results = []
    for fused, prune in ((False, False), (True, False), (False, True), (True, True)):
        model.model.fused_norm, model.model.prune_rows = fused, prune
        seqs = [Sequence(f"s{fused}{prune}{i}", p) for i, p in enumerate(prompts)]
        for s in seqs:
            assert runner.prepare(s)
        last: dict[int, torch.Tensor] = {}
        while len(last) < len(seqs):   # chunks of 16: steps where no prompt ends sample nothing (pruned to 0 rows)
            live = [i for i in range(len(seqs)) if i not in last]
            out = runner.run([seqs[i] for i in live], [16] * len(live))
            assert out.rows is not None and out.logits.shape[0] == len(out.rows)
            for k, r in enumerate(out.rows):
                last[live[r]] = out.logits[k]
        results.append(torch.stack([last[i] for i in range(len(seqs))]))
        for s in seqs:
            runner.free(s)
    model.model.fused_norm = model.model.prune_rows = True
    for r in results[1:]:
        assert r.shape == results[0].shape == (3, cfg.vocab_size)
        assert (r - results[0]).abs().max().item() < tol

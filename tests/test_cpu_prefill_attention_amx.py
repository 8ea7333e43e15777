"""The bfloat16 prefill-attention kernel on AMX tiles against float64 attention, with PyTorch's bf16 SDPA (what the
engine ran before) as the yardstick for the error: both round the probabilities to bf16 for the value product and the
output once, so the kernel's error must stay that size (not merely below a loose bound).

Adversarial cases: GQA groups 1-16, head sizes 32-128, scattered and shared blocks, block sizes 16 and 32, chunks after
cached context (the diagonal offset), lengths around the 16-key tiles, 32-key chunks and 256-key softmax blocks,
sequences out of order in a wider token batch next to rows the kernel must not touch, large scores; causality exact
(changing the keys and values after a row's position leaves its output bit for bit); the runner's use of it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from prefill_runner import chunked_logits

from tokenplane.engine import attention as attention_module
from tokenplane.engine import cpu_prefill_attention_amx as amx
from tokenplane.engine.cpu_prefill_attention import AMX_MIN_ROWS, available, paged_prefill, worth

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not amx.HOST_AMX, reason="needs a CPU with AMX-BF16 (and the kernel's permission)")]


def gathered(cache, table, n, bs):
    blocks = torch.tensor(table[:-(-n // bs)])
    return cache.unflatten(1, (-1, bs)).index_select(1, blocks).flatten(1, 2)[:, :n]


def attend(q, k, v, q_len, n, group, scale, dtype):
    """Causal attention of q (positions n - q_len .. n - 1) over k/v [kvh, n, d] in `dtype` (float64: the reference;
    bfloat16: SDPA's CPU flash kernel, as attention.py calls it)."""
    mask = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]
    qh = q.to(dtype).transpose(0, 1)[None]
    o = F.scaled_dot_product_attention(qh, k.to(dtype)[None], v.to(dtype)[None], attn_mask=mask, scale=scale,
                                       enable_gqa=True)
    return o[0].transpose(0, 1).reshape(q_len, -1).double()


def batch(kvh, group, d, bs, spans, seed, q_scale=1.0):
    """Caches, a block table per span (scattered; spans 2 and 3 share their first block), token rows out of order
    with a gap row, and q as the model passes it (the first heads of a wider tensor)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // bs) for _, n in spans) + 8
    kc = torch.randn(kvh, num_blocks * bs, d, generator=g).bfloat16()
    vc = torch.randn(kvh, num_blocks * bs, d, generator=g).bfloat16()
    rng = np.random.default_rng(seed)
    width = max(-(-n // bs) for _, n in spans)
    table = np.zeros((len(spans), width), dtype=np.int64)
    free = list(rng.permutation(num_blocks))
    for i, (_, n) in enumerate(spans):
        for j in range(-(-n // bs)):
            table[i, j] = free.pop()
    if len(spans) > 3:
        table[3, 0] = table[2, 0]   # a shared prefix block
    order = list(rng.permutation(len(spans)))
    starts, t = {}, 0
    for i in order:
        starts[i] = t
        t += spans[i][0] + (1 if i == order[0] else 0)   # a row no sequence owns
    qk = (torch.randn(t, kvh * group + kvh, d, generator=g) * q_scale).bfloat16()
    q = qk[:, :kvh * group]
    return kc, vc, table, starts, q


def run(q, kc, vc, table, starts, spans, bs, group, scale):
    out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), float("nan"), dtype=torch.bfloat16)
    paged_prefill(q, kc, vc, np.array([starts[i] for i in range(len(spans))], dtype=np.int64),
                  np.array([s[0] for s in spans], dtype=np.int64), np.array([s[1] for s in spans], dtype=np.int64),
                  table, out, bs, group, scale)
    return out


@pytest.mark.parametrize("kvh,group,d,bs", [(2, 1, 64, 16), (2, 2, 128, 16), (3, 3, 64, 16), (1, 4, 32, 32),
                                            (1, 16, 32, 16), (2, 5, 96, 16)])
def test_kernel_error_is_sdpa_bf16_sized(kvh, group, d, bs):
    tq = 16 // group
    spans = [(2, 2), (tq + 5, tq + 5), (3, 300), (2 * tq + 7, 2 * tq + 7 + 257), (16, 16), (33, 33),
             (300, 300), (5, 5), (40, 600)]
    kc, vc, table, starts, q = batch(kvh, group, d, bs, spans, seed=kvh * 100 + group * 10 + d, q_scale=4.0)
    scale = d ** -0.5
    out = run(q, kc, vc, table, starts, spans, bs, group, scale)
    touched = set()
    for i, (q_len, n) in enumerate(spans):
        rows = slice(starts[i], starts[i] + q_len)
        touched.update(range(starts[i], starts[i] + q_len))
        k, v = gathered(kc, table[i], n, bs), gathered(vc, table[i], n, bs)
        ref = attend(q[rows], k, v, q_len, n, group, scale, torch.float64)
        sdpa = attend(q[rows], k, v, q_len, n, group, scale, torch.bfloat16)
        err = (out[rows].double() - ref).abs()
        base = (sdpa - ref).abs()
        # the output's own bf16 rounding (2^-9 relative) dominates both; allow a little more than SDPA's worst and mean
        assert err.max().item() <= 1.5 * base.max().item() + 2e-3, (i, err.max().item(), base.max().item())
        assert err.mean().item() <= 1.2 * base.mean().item() + 1e-5, (i, err.mean().item(), base.mean().item())
    untouched = sorted(set(range(q.shape[0])) - touched)
    assert untouched and torch.isnan(out[untouched].float()).all()


def test_keys_after_a_position_weigh_exactly_zero():
    """Rows before position p give the same bits whatever the keys and values from p on hold (a masked weight is
    exactly 0, not exp's floor), across 16-key tiles, 32-key chunks and 256-key blocks."""
    kvh, group, d, bs = 3, 3, 64, 16
    spans = [(700, 700)]
    kc, vc, table, starts, q = batch(kvh, group, d, bs, spans, seed=7, q_scale=3.0)
    out = run(q, kc, vc, table, starts, spans, bs, group, d ** -0.5)
    for p in (1, 15, 16, 31, 255, 256, 600):
        k2, v2 = kc.clone(), vc.clone()
        for j in range(p, 700):
            slot = int(table[0, j // bs]) * bs + j % bs
            k2[:, slot] = torch.randn(kvh, d).bfloat16() * 50
            v2[:, slot] = torch.randn(kvh, d).bfloat16() * 1000
        out2 = run(q, k2, v2, table, starts, spans, bs, group, d ** -0.5)
        s = starts[0]
        assert torch.equal(out2[s:s + p], out[s:s + p]), p
        assert not torch.equal(out2[s + p:s + 700], out[s + p:s + 700])


def test_available_and_worth_for_bf16():
    cpu = torch.device("cpu")
    assert available(torch.bfloat16, cpu, 64, 3, 16) and available(torch.bfloat16, cpu, 128, 2, 32)
    assert not available(torch.bfloat16, cpu, 16, 2, 16)       # head_dim not a multiple of 32
    assert not available(torch.bfloat16, cpu, 64, 2, 8)        # a 16-key tile would span blocks
    assert not available(torch.bfloat16, torch.device("cuda"), 64, 2, 16)
    assert worth(AMX_MIN_ROWS // 3, 3, torch.bfloat16) and not worth(AMX_MIN_ROWS // 3 - 1, 3, torch.bfloat16)
    assert worth(AMX_MIN_ROWS // 3 - 1, 3)                      # float32 keeps its own threshold


def test_runner_uses_the_kernel_for_long_bf16_rows(monkeypatch):
    """A bf16 model with head_dim 32: a prompt long enough goes to the kernel (a short chunk after it stays with SDPA),
    and the logits' error against a float64 run of the same weights is SDPA's size."""
    ref = chunked_logits(torch.float64, "varlen")[2]
    sdpa = chunked_logits(torch.bfloat16, "varlen")[2]
    calls: list = []
    cfg, runner, got = chunked_logits(torch.bfloat16, "auto", monkeypatch, calls)
    assert runner.prefill_kernel == "auto" and runner.uses_cpu_prefill()
    assert calls == [([290], [290])] * cfg.num_hidden_layers     # the 10-token chunk: SDPA
    err, base = (got - ref).abs().max().item(), (sdpa - ref).abs().max().item()
    assert err <= 1.5 * base + 1e-2, (err, base)


def test_warm_kernels_reaches_the_amx_kernel(monkeypatch):
    """ModelRunner.warm_kernels' first prefill is long enough for the kernel, so its compile never lands on a
    serving step."""
    from tokenplane.engine.config import PRESETS
    from tokenplane.engine.loader import load_model
    from tokenplane.engine.model_runner import ModelRunner

    rows = []
    real = attention_module.paged_prefill

    def counting(q, k_cache, v_cache, q_starts, q_lens, context_lens, *args):  # noqa: ANN001, ANN002
        rows.append(int(q_lens.max()))
        real(q, k_cache, v_cache, q_starts, q_lens, context_lens, *args)

    cfg, model = load_model(dict(PRESETS["test-small"], head_dim=32), dtype=torch.bfloat16, seed=5)
    runner = ModelRunner(model, cfg, num_blocks=64, block_size=16)
    monkeypatch.setattr(attention_module, "paged_prefill", counting)
    free = runner.block_manager.num_free_blocks
    assert runner.warm_kernels() > 0
    assert runner.block_manager.num_free_blocks == free
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    assert rows and max(rows) * group >= AMX_MIN_ROWS

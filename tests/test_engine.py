"""Engine exactness: the paged runner against transformers, and against itself across batch shapes and cache states.

Tolerances. float32 vs transformers: 1e-4 absolute on logits of magnitude ~1 (different kernels and op fusion).
float64 vs transformers: 1e-10, after making transformers' RMSNorm compute at input precision (it rounds to float32
even in float64 models; its RoPE rounds cos/sin to float32 too, which ours does identically). Runner vs runner in
float64: 1e-12 and identical argmax, not bit equality: as vLLM notes, different batch shapes (a token batch of 1 vs 7,
a cache hit's suffix vs a full prefill) run different GEMM shapes that may differ in the last ULP, and that difference
travels through the residual stream.
"""
from __future__ import annotations

import collections
import contextlib

import pytest
import torch

from tokenplane.engine import LLMEngine, ModelRunner, SamplingParams, Sequence, load_model, save_pretrained_like

transformers = pytest.importorskip("transformers")

PRESETS = ["test-small", "test-llama"]
TOL = {torch.float32: 1e-4, torch.float64: 1e-10}


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: 1 torch thread for the module


@contextlib.contextmanager
def hf_norm_at_input_precision():
    """transformers' RMSNorm casts to float32 even for float64 inputs; compute at input precision for the test."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3 import modeling_qwen3

    def forward(self, x):
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)

    classes = [modeling_qwen3.Qwen3RMSNorm, modeling_llama.LlamaRMSNorm]
    saved = [c.forward for c in classes]
    for c in classes:
        c.forward = forward
    try:
        yield
    finally:
        for c, f in zip(classes, saved):
            c.forward = f


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """(preset, dtype) -> (our cfg, our model, transformers model with the same weights via save_pretrained_like)."""
    cache = {}

    def get(preset, dtype):
        if (preset, dtype) not in cache:
            cfg, model = load_model(preset, dtype=dtype, seed=7)
            d = save_pretrained_like(model, cfg, tmp_path_factory.mktemp(preset))
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype, attn_implementation="sdpa")
            cache[preset, dtype] = (cfg, model, hf.eval())
        return cache[preset, dtype]

    return get


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad(), hf_norm_at_input_precision():
        return hf(torch.tensor([ids])).logits[0].double()


def prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kernel", ["cpu", "varlen", "padded"])
def test_prefill_and_decode_match_transformers(hf_pair, preset, dtype, kernel):
    cfg, model, hf = hf_pair(preset, dtype)
    assert type(hf).__name__ == {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[cfg.architecture]
    runner = ModelRunner(model, cfg, num_blocks=64, block_size=4, decode_kernel=kernel)
    a, b = Sequence("a", prompt(13, 1)), Sequence("b", prompt(6, 2))
    for s in (a, b):
        assert runner.prepare(s)
    out = runner.run([a, b])
    for i, s in enumerate((a, b)):
        ref = hf_logits(hf, s.token_ids)[-1]
        assert (out.logits[i].double() - ref).abs().max().item() < TOL[dtype]
    # Decode both in one batch; they grow block by block, interleaved, so block tables are not consecutive and the
    # gather path runs, and decode crosses block boundaries.
    for step in range(7):
        for s in (a, b):
            s.append_token((s.token_ids[-1] * 31 + step) % cfg.vocab_size)
            assert runner.prepare(s)
        out = runner.run([a, b])
        for i, s in enumerate((a, b)):
            ref = hf_logits(hf, s.token_ids)[-1]
            assert (out.logits[i].double() - ref).abs().max().item() < TOL[dtype]
    assert a.block_table != list(range(a.block_table[0], a.block_table[0] + len(a.block_table)))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("fused,length", [(True, 13), (False, 13), (True, 37)])
def test_bf16_prefill_and_decode_match_transformers(hf_pair, preset, fused, length):
    """bf16 on CPU (the compiled add + RMSNorm and qkv/rope kernels, or the plain torch ops): each step's logits within
    two bf16 ulps of the largest of transformers' bf16 logits (the two round in the same places; they sum in
    different orders). 37 tokens: a prefill the packed GEMMs run padded to their 40-row bucket."""
    cfg, model, hf = hf_pair(preset, torch.bfloat16)
    model.model.fused_norm = fused
    try:
        runner = ModelRunner(model, cfg, num_blocks=64, block_size=4, max_num_batched_tokens=64)
        a = Sequence("a", prompt(length, 1))
        assert runner.prepare(a)
        for step in range(6):
            out = runner.run([a])
            ref = hf_logits(hf, a.token_ids)[-1]
            assert (out.logits[0].double() - ref).abs().max().item() <= 2 * 2 ** -8 * ref.abs().max().item()
            a.append_token((a.token_ids[-1] * 31 + step) % cfg.vocab_size)
            assert runner.prepare(a)
    finally:
        model.model.fused_norm = True


def test_final_hidden_matches_transformers(hf_pair):
    cfg, model, hf = hf_pair("test-small", torch.float64)
    runner = ModelRunner(model, cfg, num_blocks=32, block_size=4)
    s = Sequence("a", prompt(9, 3))
    runner.prepare(s)
    out = runner.run([s])
    with torch.no_grad(), hf_norm_at_input_precision():
        ref = hf(torch.tensor([s.token_ids]), output_hidden_states=True).hidden_states[-1][0, -1]
    assert (out.hidden[0] - ref).abs().max().item() < 1e-10


def test_loader_roundtrip_and_determinism(tmp_path):
    cfg, m1 = load_model("test-llama", seed=3)
    _, m2 = load_model("test-llama", seed=3)
    _, m3 = load_model("test-llama", seed=4)
    _, m64 = load_model("test-llama", seed=3, dtype=torch.float64)
    sd1, sd2, sd3, sd64 = (m.state_dict() for m in (m1, m2, m3, m64))
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert not torch.equal(sd1["model.embed_tokens.weight"], sd3["model.embed_tokens.weight"])
    assert all(torch.equal(sd1[k].double(), sd64[k]) for k in sd1)  # float64 holds the float32 draws exactly
    assert cfg.tie_word_embeddings and m1.lm_head is None
    save_pretrained_like(m1, cfg, tmp_path)
    cfg2, loaded = load_model(str(tmp_path))
    assert cfg2 == cfg and all(torch.equal(sd1[k], loaded.state_dict()[k]) for k in sd1)


def test_batched_equals_unbatched_float64():
    cfg, model = load_model("test-large", dtype=torch.float64, seed=1)
    lens = [5, 17, 1, 9]
    alone = []
    for i, n in enumerate(lens):
        r = ModelRunner(model, cfg, num_blocks=64, block_size=4)
        s = Sequence(str(i), prompt(n, 10 + i))
        r.prepare(s)
        o1 = r.run([s])
        s.append_token(int(o1.logits[0].argmax()))
        r.prepare(s)
        alone.append((o1.logits[0], r.run([s]).logits[0]))
    r = ModelRunner(model, cfg, num_blocks=64, block_size=4)
    seqs = [Sequence(str(i), prompt(n, 10 + i)) for i, n in enumerate(lens)]
    # Mixed batch: seqs 0 and 1 prefill first; then 2 and 3 prefill together with 0 and 1 decoding.
    for s in seqs[:2]:
        r.prepare(s)
    first = {0: None, 1: None}
    o = r.run(seqs[:2])
    first[0], first[1] = o.logits[0], o.logits[1]
    for i in (0, 1):
        seqs[i].append_token(int(first[i].argmax()))
    for s in seqs:
        r.prepare(s)
    o = r.run(seqs)
    for i in (2, 3):
        first[i] = o.logits[i]
    for i in (0, 1):
        assert torch.equal(first[i].argmax(), alone[i][0].argmax())
        assert (first[i] - alone[i][0]).abs().max().item() < 1e-12
        assert torch.equal(o.logits[i].argmax(), alone[i][1].argmax())
        assert (o.logits[i] - alone[i][1]).abs().max().item() < 1e-12
    for i in (2, 3):
        assert torch.equal(first[i].argmax(), alone[i][0].argmax())
        assert (first[i] - alone[i][0]).abs().max().item() < 1e-12


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_prefix_cache_hit_equals_miss(dtype, tol):
    cfg, model = load_model("test-small", dtype=dtype, seed=2)
    shared = prompt(20, 5)
    r = ModelRunner(model, cfg, num_blocks=64, block_size=4)
    a = Sequence("a", shared)
    r.prepare(a)
    r.run([a])
    r.free(a)  # freed blocks stay hashed
    b = Sequence("b", shared + [7, 8, 9])
    r.prepare(b)
    assert b.num_computed_tokens == 20 and b.num_cached_tokens == 20
    assert r.block_manager.num_hit_blocks == 5
    hit = r.run([b]).logits[0]
    miss_runner = ModelRunner(model, cfg, num_blocks=64, block_size=4)
    c = Sequence("c", shared + [7, 8, 9])
    miss_runner.prepare(c)
    assert c.num_computed_tokens == 0
    miss = miss_runner.run([c]).logits[0]
    assert torch.equal(hit.argmax(), miss.argmax()) and (hit - miss).abs().max().item() < tol
    # A prompt equal to the cached prefix still computes its last block (never a zero-token run).
    d = Sequence("d", shared)
    r.prepare(d)
    assert d.num_computed_tokens == 16


def test_peer_catch_up_equals_own_decoding():
    cfg, model = load_model("test-small", dtype=torch.float64, seed=4)
    p = prompt(11, 6)
    own_runner, peer_runner = (ModelRunner(model, cfg, num_blocks=64, block_size=4) for _ in range(2))
    own, peer = Sequence("own", p), Sequence("peer", p)
    for r, s in ((own_runner, own), (peer_runner, peer)):
        r.prepare(s)
        r.run([s])
    written = []
    for step in range(6):  # `own` decodes six tokens itself
        tok = (own.token_ids[-1] * 17 + step) % cfg.vocab_size
        written.append(tok)
        own.append_token(tok)
        own_runner.prepare(own)
        last = own_runner.run([own])
    peer.token_ids.extend(written)  # a peer wrote the same six tokens
    assert peer.num_tokens - peer.num_computed_tokens == 6
    peer_runner.prepare(peer)
    other = Sequence("other", prompt(3, 9))  # caught up inside a mixed batch
    peer_runner.prepare(other)
    out = peer_runner.run([other, peer])
    assert peer.num_computed_tokens == peer.num_tokens
    assert torch.equal(out.logits[1].argmax(), last.logits[0].argmax())
    assert (out.logits[1] - last.logits[0]).abs().max().item() < 1e-12
    assert (out.hidden[1] - last.hidden[0]).abs().max().item() < 1e-12


def test_generate_greedy_matches_transformers(hf_pair):
    cfg, model, hf = hf_pair("test-small", torch.float64)
    prompts = [prompt(n, 20 + n) for n in (3, 11, 6)]
    engine = LLMEngine("test-small", dtype=torch.float64, seed=7, num_blocks=64, block_size=4)
    got = engine.generate(prompts, SamplingParams(max_tokens=10))
    for p, out in zip(prompts, got):
        ids = list(p)
        for _ in range(10):
            ids.append(int(hf_logits(hf, ids)[-1].argmax()))
        assert out == ids[len(p):]


def test_generate_with_logit_adjustments_matches_transformers(hf_pair):
    """Penalties and logit_bias (greedy) and top-k / min-p (seeded draws) through the engine, against transformers'
    logits adjusted by vLLM's formulas and drawn by the same counter-based sampler; one engine is tight enough to
    preempt (recompute), which must not change a penalized request's history."""
    from tokenplane.engine.sampler import sample

    cfg, model, hf = hf_pair("test-small", torch.float64)
    prompts = [prompt(n, 60 + n) for n in (7, 13, 4)]
    params = [SamplingParams(max_tokens=10, repetition_penalty=1.6, frequency_penalty=0.7, presence_penalty=0.5),
              SamplingParams(max_tokens=10, logit_bias=((5, 3.0), (int(prompts[1][0]), -2.0)), repetition_penalty=0.8),
              SamplingParams(max_tokens=10, temperature=0.9, top_k=5, min_p=0.05, seed=21, frequency_penalty=1.2)]
    expect = []
    for pr, sp in zip(prompts, params):
        ids = list(pr)
        for step in range(sp.max_tokens):
            ids.append(sample(hf_logits(hf, ids)[-1:], [sp], [step], [(pr, ids[len(pr):])])[0])
        expect.append(ids[len(pr):])
    plain = LLMEngine("test-small", dtype=torch.float64, seed=7, num_blocks=64, block_size=4)
    assert plain.generate(prompts, params) == expect
    unadjusted = plain.generate(prompts, [SamplingParams(max_tokens=10)] * 2 + [
        SamplingParams(max_tokens=10, temperature=0.9, seed=21)])
    assert sum(a != b for a, b in zip(unadjusted, expect)) >= 2, (unadjusted, expect)   # the adjustments act
    tight = LLMEngine("test-small", dtype=torch.float64, seed=7, num_blocks=9, block_size=4, max_num_seqs=3,
                      max_num_batched_tokens=16)
    assert tight.generate(prompts, params) == expect
    assert tight.scheduler.num_preemptions > 0


def test_min_tokens_holds_off_stop_ids_and_eos():
    prompts = [prompt(n, 70 + n) for n in (5, 9)]
    engine = LLMEngine("test-small", dtype=torch.float64, seed=7, num_blocks=64, block_size=4)
    free = engine.generate(prompts, SamplingParams(max_tokens=8))
    stops = tuple({o[0] for o in free})
    stopped = engine.generate(prompts, SamplingParams(max_tokens=8, stop_token_ids=stops))
    assert all(len(o) == 1 for o in stopped)            # each ends on its first token
    held = engine.generate(prompts, SamplingParams(max_tokens=8, stop_token_ids=stops, min_tokens=4))
    for o in held:
        assert len(o) >= 4 and not set(o[:3]) & set(stops)


def test_engine_preemption_and_limits_keep_results():
    prompts = [prompt(n, 40 + n) for n in (9, 14, 5, 12)]
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=11),
              SamplingParams(max_tokens=12), SamplingParams(max_tokens=5, temperature=1.0, seed=12)]
    roomy = LLMEngine("test-small", dtype=torch.float64, num_blocks=128, block_size=4)
    expect = roomy.generate(prompts, params)
    tight = LLMEngine("test-small", dtype=torch.float64, num_blocks=10, block_size=4, max_num_seqs=3,
                      max_num_batched_tokens=24)
    seen_batch = []
    for p, sp in zip(prompts, params):
        tight.add_request(p, sp)
    outs: dict[str, list[int]] = {}
    while tight.has_unfinished():
        step = tight.step()
        seen_batch.append(len(step))
        for o in step:
            outs.setdefault(o.seq_id, []).append(o.token)
    assert tight.scheduler.num_preemptions > 0
    assert max(seen_batch) <= 3
    assert [outs[f"req-{i}"] for i in range(4)] == expect
    assert [len(o) for o in expect] == [12, 9, 12, 5]
    bm = tight.runner.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_graph_block_bucket_pads_by_at_most_a_quarter():
    """Decode graphs are captured per block-table width; the width a step replays covers its rows, never exceeds the
    cap, pads by at most 25% past 8 blocks (none below), and takes few distinct values (graphs to capture)."""
    from tokenplane.engine.model_runner import graph_block_bucket

    widths = [graph_block_bucket(n, 4096) for n in range(1, 4097)]
    assert all(w >= n and (w == n if n <= 8 else w <= 1.25 * n) for n, w in zip(range(1, 4097), widths))
    assert widths == sorted(widths) and len(set(widths)) == 8 + 4 * 9
    assert graph_block_bucket(100, 90) == 90 and graph_block_bucket(0, 64) == 1
    assert [graph_block_bucket(n, 4096, 1) for n in (1, 3, 5, 9, 33)] == [1, 4, 8, 16, 64]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_matches_eager():
    cfg, model = load_model("test-small", device="cuda", dtype=torch.float32, seed=1)
    results = []
    for eager in (True, False):
        r = ModelRunner(model, cfg, num_blocks=64, block_size=4, device="cuda", enforce_eager=eager, max_num_seqs=8)
        seqs = [Sequence(str(i), prompt(3 + 4 * i, i)) for i in range(5)]
        logits = []
        for s in seqs:
            r.prepare(s)
        o = r.run(seqs)
        for _ in range(6):
            for i, s in enumerate(seqs):
                s.append_token(int(o.logits[i].argmax()))
                r.prepare(s)
            o = r.run(seqs)
            logits.append(o.logits.cpu())
        results.append(torch.stack(logits))
    assert (results[0] - results[1]).abs().max().item() < 1e-4


@pytest.mark.parametrize("kernel", ["cpu", "varlen", "padded"])
def test_random_schedule_matches_fresh_prefill(kernel):
    """Random interleaving of prefills, decodes, peer catch-ups, prefix-cache hits, rollbacks (truncate) and frees on
    one small paged cache (block_size 4, so block tables fragment); after every run each sequence's logits must equal
    a fresh single-sequence prefill of its tokens (float64, 1e-10: different GEMM shapes, see module docstring)."""
    import random

    cfg, model = load_model("test-small", dtype=torch.float64, seed=5)
    ref_cfg, ref_model = load_model("test-small", dtype=torch.float64, seed=5)
    runner = ModelRunner(model, cfg, num_blocks=40, block_size=4, decode_kernel=kernel)

    def reference(tokens):
        r = ModelRunner(ref_model, ref_cfg, num_blocks=-(-len(tokens) // 4) + 1, block_size=4)
        s = Sequence("ref", tokens)
        r.prepare(s)
        return r.run([s]).logits[0]

    rng = random.Random(0)
    base = prompt(12, 99)  # shared prefix so prefix-cache hits happen
    live: list[Sequence] = []
    hits_before = 0
    seen = collections.Counter()
    for op in range(40):
        choice = rng.random()
        if len(live) < 2 or (choice < 0.25 and len(live) < 4):
            n = rng.randint(1, 14)
            toks = (base[:rng.randint(0, 12)] + prompt(n, op))[:20] or [1]
            live.append(Sequence(f"s{op}", toks))
        elif choice < 0.35:
            victim = live.pop(rng.randrange(len(live)))
            runner.free(victim)
        elif choice < 0.45:
            s = rng.choice([s for s in live if s.block_table] or live)
            if s.block_table and s.num_tokens > 2:
                runner.block_manager.truncate(s, rng.randint(1, s.num_tokens - 1))
                seen["truncate"] += 1
        batch = []
        for s in live:
            if rng.random() < 0.7:
                k = rng.choice([1, 1, 1, 2, 5])  # own decode, or a peer's k tokens
                if s.num_computed_tokens or s.block_table:
                    s.token_ids.extend(rng.randrange(cfg.vocab_size) for _ in range(k))
                if s.num_tokens <= 40 and runner.prepare(s):
                    batch.append(s)
                    seen["catch-up"] += s.num_uncomputed_tokens > 1 and s.num_computed_tokens > 0
                else:
                    runner.free(s)
                    live.remove(s)
        if not batch:
            continue
        seen["decode-only"] += all(s.num_uncomputed_tokens == 1 for s in batch)
        seen["mixed"] += len({s.num_uncomputed_tokens == 1 for s in batch}) == 2
        seen["gather"] += any(s.block_table != list(range(s.block_table[0], s.block_table[0] + len(s.block_table)))
                              for s in batch)
        out = runner.run(batch)
        for i, s in enumerate(batch):
            ref = reference(s.token_ids)
            assert torch.equal(out.logits[i].argmax(), ref.argmax())
            assert (out.logits[i] - ref).abs().max().item() < 1e-10, (op, s)
        hits_before = runner.block_manager.num_hit_blocks
    for s in live:
        runner.free(s)
    bm = runner.block_manager
    assert bm.num_free_blocks == bm.num_blocks and hits_before > 0
    assert all(seen[k] > 0 for k in ("truncate", "catch-up", "decode-only", "mixed", "gather")), seen


class ReplayGraph:
    """CPU stand-in for a captured CUDA graph: replay re-runs the captured forward into the same output tensor."""

    def __init__(self, forward, out):
        self.forward, self.out = forward, out

    def replay(self):
        self.out.copy_(self.forward())


def test_cuda_graph_bookkeeping_on_cpu(monkeypatch):
    """The decode-graph path minus CUDA: static buffers, batch buckets with padding rows (scratch slot), block-count
    buckets, restore after capture. Must equal eager varlen decoding."""
    cfg, model = load_model("test-small", dtype=torch.float64, seed=8)
    ref_cfg, ref_model = load_model("test-small", dtype=torch.float64, seed=8)
    graph_runner = ModelRunner(model, cfg, num_blocks=64, block_size=4, max_num_seqs=6)
    monkeypatch.setattr(graph_runner, "use_cuda_graphs", True)
    def capture(forward):
        out = forward()
        return ReplayGraph(forward, out), out

    monkeypatch.setattr(graph_runner, "_graph_capture", capture)
    eager = ModelRunner(ref_model, ref_cfg, num_blocks=64, block_size=4)
    a = [Sequence(str(i), prompt(2 + 3 * i, 60 + i)) for i in range(5)]
    b = [Sequence(str(i), list(s.token_ids)) for i, s in enumerate(a)]
    for r, seqs in ((graph_runner, a), (eager, b)):
        for s in seqs:
            r.prepare(s)
        r.run(seqs)  # prefill: eager in both
    for step in range(9):
        n = [3, 5, 1, 2, 5, 4, 5, 3, 5][step]  # batch buckets 4, 6 (max), 1, 2: padding rows in most steps
        for seqs, r in ((a, graph_runner), (b, eager)):
            for s in seqs[:n]:
                s.append_token((s.token_ids[-1] * 13 + step) % cfg.vocab_size)
                r.prepare(s)
        got = graph_runner.run(a[:n])
        want = eager.run(b[:n])
        assert (got.logits - want.logits).abs().max().item() < 1e-10
        assert (got.hidden - want.hidden).abs().max().item() < 1e-10
    assert {k[0] for k in graph_runner._graphs} >= {1, 2, 4, 6} and len({k[1] for k in graph_runner._graphs}) >= 2

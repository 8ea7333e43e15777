"""Block manager accounting, prefix-cache hashing and eviction, sampler determinism. No model needed."""
from __future__ import annotations

import collections

import pytest
import torch

from tokenplane.engine.block_manager import BlockManager
from tokenplane.engine.sampler import SamplingParams, sample, uniform
from tokenplane.engine.sequence import Sequence, SequenceStatus


def computed(bm: BlockManager, seq: Sequence) -> None:
    """What the runner does after a run: all tokens computed, full blocks hashed."""
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_blocks(seq)


def test_allocate_append_free_no_leaks():
    bm = BlockManager(8, 4)
    a, b = Sequence("a", list(range(10))), Sequence("b", list(range(100, 103)))
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.block_table) == 3 and len(b.block_table) == 1 and bm.num_used_blocks == 4
    assert a.num_computed_tokens == 0
    for t in range(6):
        a.append_token(50 + t)
        assert bm.can_append(a)
        bm.append_slots(a)
    assert len(a.block_table) == 4 and bm.num_free_blocks == 3
    assert len(set(a.block_table) | set(b.block_table)) == 5
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    assert all(blk.ref_count == 0 for blk in bm.blocks)
    assert a.block_table == [] and a.num_computed_tokens == 0


def test_out_of_blocks_is_reported_not_overcommitted():
    bm = BlockManager(3, 4)
    big = Sequence("big", list(range(13)))  # 4 blocks
    assert not bm.can_allocate(big)
    with pytest.raises(RuntimeError):
        bm.allocate(big)
    s = Sequence("s", list(range(12)))
    bm.allocate(s)
    s.append_token(1)
    assert not bm.can_append(s)
    with pytest.raises(RuntimeError):
        bm.append_slots(s)
    with pytest.raises(ValueError):
        bm.allocate(s)  # already has blocks


def test_prefix_hit_shares_blocks_with_ref_counts():
    bm = BlockManager(16, 4)
    a = Sequence("a", list(range(11)))
    bm.allocate(a)
    computed(bm, a)  # 2 full blocks hashed; the third is partial
    b = Sequence("b", list(range(8)) + [99, 98, 97])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed_tokens == 8 == b.num_cached_tokens
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert b.block_table[2] != a.block_table[2]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16
    # Freed blocks stay hashed: a third sequence still hits them.
    c = Sequence("c", list(range(9)))
    bm.allocate(c)
    assert c.num_computed_tokens == 8 and bm.num_hit_blocks == 4


def test_chain_hash_depends_on_the_prefix_and_tokens_are_checked():
    bm = BlockManager(16, 4)
    a = Sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    bm.allocate(a)
    computed(bm, a)
    # Same second block after a different first block: no hit on either.
    b = Sequence("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    # Forge a collision: the hash maps to a block whose stored tokens differ -> treated as a miss.
    first = bm.blocks[a.block_table[0]]
    first.token_ids = (1, 2, 3, 99)
    c = Sequence("c", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    bm.allocate(c)
    assert c.num_computed_tokens == 0


def test_last_block_is_never_a_hit():
    bm = BlockManager(16, 4)
    a = Sequence("a", list(range(8)))
    bm.allocate(a)
    computed(bm, a)
    b = Sequence("b", list(range(8)))  # identical, block aligned: only the first block may hit
    bm.allocate(b)
    assert b.num_computed_tokens == 4 and b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]


def test_eviction_prefers_uncached_then_oldest_freed():
    bm = BlockManager(4, 2)
    a = Sequence("a", [1, 2, 3, 4, 5])  # 3 blocks, 2 full
    bm.allocate(a)
    computed(bm, a)
    a_blocks = list(a.block_table)
    cached = set(a_blocks[:2])
    bm.free(a)
    assert len(bm.hash_to_block) == 2
    x = Sequence("x", [7, 7, 7])  # needs 2 blocks: the never-hashed ones go first
    bm.allocate(x)
    assert not set(x.block_table) & cached and len(bm.hash_to_block) == 2
    y = Sequence("y", [8])  # one block: the oldest-freed cached one, the tail of `a` (prefix outlives tail)
    bm.allocate(y)
    assert y.block_table == [a_blocks[1]] and len(bm.hash_to_block) == 1
    again = Sequence("again", [1, 2, 3, 4, 5])
    assert bm.can_allocate(again) is False  # 3 blocks needed, 1 hit in the free list, 1 other free block
    bm.free(x)
    bm.allocate(again)
    assert again.num_computed_tokens == 2 and again.block_table[0] == a_blocks[0]  # prefix still cached
    bm.free(again)
    bm.free(y)
    z = Sequence("z", [6, 6, 6, 6, 6, 6, 6])  # 4 blocks: everything, evicting every cached block
    bm.allocate(z)
    assert len(bm.hash_to_block) == 0 and all(bm.blocks[i].hash is None for i in z.block_table)
    bm.free(z)
    last = Sequence("last", [1, 2, 3, 4, 5])
    bm.allocate(last)
    assert last.num_computed_tokens == 0  # evicted: miss


def test_decode_filled_blocks_become_hits():
    bm = BlockManager(16, 4)
    a = Sequence("a", [1, 2, 3])
    bm.allocate(a)
    computed(bm, a)
    for t in (4, 5, 6, 7, 8):
        a.append_token(t)
        bm.append_slots(a)
        computed(bm, a)
    b = Sequence("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(b)
    assert b.num_computed_tokens == 8


def test_truncate_releases_and_never_keeps_a_shared_partial_block():
    bm = BlockManager(16, 4)
    a = Sequence("a", list(range(10)))
    bm.allocate(a)
    computed(bm, a)
    bm.truncate(a, 9)  # keeps 3 blocks; the partial third is private and unhashed
    assert len(a.block_table) == 3 and a.num_computed_tokens == 9 and a.num_tokens == 9
    bm.truncate(a, 6)  # cut inside block 1, which is hashed (full, cached): drop it and recompute from 4
    assert len(a.block_table) == 1 and a.num_computed_tokens == 4 and a.token_ids == list(range(6))
    bm.append_slots(a)
    assert len(a.block_table) == 2
    bm.free(a)
    assert bm.num_free_blocks == 16


def test_status_finished_range():
    assert not SequenceStatus.PREEMPTED.finished and SequenceStatus.FINISHED_ABORTED.finished
    assert SequenceStatus.FINISHED_STOPPED.finished and not SequenceStatus.RUNNING.finished


# -- sampler ------------------------------------------------------------------------------------------------------
def test_greedy_is_argmax():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    assert sample(logits, [SamplingParams()] * 5, [0] * 5) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_independent_of_batching():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in (1, 2, 3, 4)]
    steps = [0, 5, 5, 9]
    batched = sample(logits, params, steps)
    alone = [sample(logits[i:i + 1], [params[i]], [steps[i]])[0] for i in range(4)]
    reordered = sample(logits.flip(0), params[::-1], steps[::-1])[::-1]
    assert batched == alone == reordered
    other_steps = [sample(logits[:1], [params[0]], [s])[0] for s in range(40)]
    assert len(set(other_steps)) > 5  # the step counter changes the draw


def test_sampling_distribution_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(temperature=1.0, seed=123)
    counts = collections.Counter(sample(logits, [p], [s])[0] for s in range(4000))
    for tok, prob in enumerate([0.5, 0.3, 0.15, 0.05]):
        assert abs(counts[tok] / 4000 - prob) < 0.03
    top = SamplingParams(temperature=1.0, top_p=0.75, seed=123)  # keeps {0, 1}: 0.5 < 0.75 <= 0.8
    kept = collections.Counter(sample(logits, [top], [s])[0] for s in range(2000))
    assert set(kept) == {0, 1} and abs(kept[0] / 2000 - 0.5 / 0.8) < 0.04
    tiny = SamplingParams(temperature=5.0, top_p=1e-6, seed=1)
    assert {sample(logits, [tiny], [s])[0] for s in range(50)} == {0}


def test_uniform_counter_is_reproducible():
    assert uniform(7, 3) == uniform(7, 3) and uniform(7, 3) != uniform(7, 4) != uniform(8, 3)
    vals = [uniform(0, s) for s in range(1000)]
    assert 0 <= min(vals) and max(vals) < 1 and abs(sum(vals) / 1000 - 0.5) < 0.05


def test_sampling_params_validation():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize("scale", [0.5, 4.0, 20.0])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_nucleus_equals_full_sort(scale, top_p):
    from tokenplane.engine.sampler import nucleus

    probs = torch.softmax(torch.randn(5000, generator=torch.Generator().manual_seed(3)).double() * scale, -1)
    got_p, got_i = nucleus(probs, top_p)
    ref_p, ref_i = torch.sort(probs, descending=True, stable=True)
    keep = int((torch.cumsum(ref_p, -1) < top_p).sum()) + 1
    assert torch.equal(got_i, ref_i[:keep]) and torch.equal(got_p, ref_p[:keep])


# -- vLLM's logit adjustments: each against a direct float64 transcription of vLLM's formulas ----------------------
def _vllm_adjusted(row, params, prompt, output):
    """vLLM's sampler on one row, written out: logit_bias added, then repetition over prompt + output tokens,
    then frequency and presence over the output tokens' counts."""
    x = row.double().clone()
    for t, b in params.logit_bias:
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t, c in collections.Counter(output).items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    return x


@pytest.mark.parametrize("kw", [
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.7},
    {"frequency_penalty": 0.8},
    {"presence_penalty": -1.5},
    {"logit_bias": ((3, 5.0), (9, -100.0))},
    {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.4, "logit_bias": ((1, 2.5),)},
])
def test_adjusted_logits_follow_vllm(kw):
    from tokenplane.engine.sampler import adjusted, token_set

    g = torch.Generator().manual_seed(5)
    row = torch.randn(64, generator=g) * 3
    prompt, output = [1, 2, 2, 40, 63], [2, 7, 7, 7, 9, 3]
    params = SamplingParams(**kw)
    assert params.needs_logits
    got = adjusted(row, params, (prompt, output))
    assert torch.equal(got, _vllm_adjusted(row, params, prompt, output))
    assert torch.equal(adjusted(row, params, (token_set(prompt), output)), got)   # the precomputed prompt form
    assert torch.equal(row, row.clone())   # the input is not modified
    # greedy on the adjusted logits, through the batch entry point (one penalized row among plain ones)
    logits = torch.stack([row, row, -row])
    plain = SamplingParams()
    toks = sample(logits, [plain, params, plain], [0, 6, 0], [None, (prompt, output), None])
    assert toks == [int(row.argmax()), int(got.argmax()), int((-row).argmax())]


def test_penalties_move_the_greedy_token():
    row = torch.tensor([1.0, 4.0, 3.9, -2.0])
    assert sample(row[None], [SamplingParams()], [0])[0] == 1
    assert sample(row[None], [SamplingParams(repetition_penalty=1.1)], [0], [([1], [])])[0] == 2   # 4/1.1 < 3.9
    assert sample(row[None], [SamplingParams(presence_penalty=0.2)], [1], [([], [1])])[0] == 2
    assert sample(row[None], [SamplingParams(logit_bias=((3, 100.0),))], [0])[0] == 3
    assert sample(row[None], [SamplingParams(logit_bias=((1, -100.0),))], [0])[0] == 2
    with pytest.raises(ValueError, match="prompt and output"):
        sample(row[None], [SamplingParams(repetition_penalty=1.1)], [0])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sample(row[None], [SamplingParams(logit_bias=((4, 1.0),))], [0])


def test_min_p_and_top_k_restrict_the_draw():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    logits = torch.log(probs)[None]

    def drawn(**kw):
        p = SamplingParams(temperature=1.0, seed=11, **kw)
        return collections.Counter(sample(logits, [p], [s])[0] for s in range(3000))

    assert set(drawn(top_k=2)) == {0, 1}
    assert set(drawn(top_k=1)) == {0}
    assert set(drawn(min_p=0.45)) == {0, 1, 2}           # >= 0.45 x 0.4 = 0.18
    assert set(drawn(min_p=0.45, top_k=2)) == {0, 1}
    assert set(drawn(top_k=3, top_p=0.6)) == {0, 1}      # top-p over the renormalized top 3: 0.4/0.9 < 0.6
    c = drawn(top_k=2)
    assert abs(c[0] / 3000 - 0.4 / 0.7) < 0.04
    assert set(drawn(top_k=-1)) == set(drawn()) == {0, 1, 2, 3, 4}
    ties = torch.tensor([[2.0, 2.0, 1.0]])               # a tie at the k-th value is kept (vLLM's threshold)
    p = SamplingParams(temperature=1.0, top_k=1, seed=3)
    assert {sample(ties, [p], [s])[0] for s in range(200)} == {0, 1}
    # at temperature 0 they change nothing: the raw argmax, and no logits needed for it
    assert not SamplingParams(top_k=3, min_p=0.2).needs_logits


@pytest.mark.parametrize("kw", [{"top_k": -2}, {"min_p": 1.5}, {"presence_penalty": 2.5},
                                {"frequency_penalty": -3}, {"repetition_penalty": 0}, {"repetition_penalty": 2.5},
                                {"logit_bias": ((-1, 1.0),)}, {"logit_bias": ((5, 101.0),)}])
def test_adjustment_params_validation(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_min_tokens_bans_the_ending_ids_until_reached():
    row = torch.tensor([0.0, 5.0, 1.0, 4.0])
    p = SamplingParams(max_tokens=8, min_tokens=3)
    assert p.needs_logits and p.needs_history
    for out, want in (([], 3), ([7], 3), ([7, 7], 3), ([7, 7, 7], 1)):
        assert sample(row[None], [p], [len(out)], [([0], out, (1,))])[0] == want
    hot = SamplingParams(max_tokens=8, min_tokens=2, temperature=1.0, seed=4)
    assert {sample(row[None], [hot], [s], [([0], [], (1, 3))])[0] for s in range(300)} <= {0, 2}
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="ids that end it"):
        sample(row[None], [p], [0])


def test_cache_blocks_hashes_only_new_blocks_and_rehashes_after_a_rewrite():
    """cache_blocks starts at the sequence's hashed_tokens; a rewrite below it (a peer's tokens replacing ours, as
    route.scheduler._sync_seq does: new token_ids and num_computed_tokens lowered to the common prefix) lowers the mark,
    so the rewritten blocks are hashed again with their new tokens and the old content is no longer a hit."""
    bm = BlockManager(16, 4)
    a = Sequence("a", list(range(12)))
    bm.allocate(a)
    computed(bm, a)
    assert a.hashed_tokens == 12
    first = [bm.blocks[b].hash for b in a.block_table]
    a.append_token(12)
    bm.append_slots(a)
    computed(bm, a)
    assert a.hashed_tokens == 12 and [bm.blocks[b].hash for b in a.block_table[:3]] == first
    a.token_ids = list(range(5)) + [99] * 8       # a rewrite from position 5
    a.num_computed_tokens = 5
    assert a.hashed_tokens == 5
    computed(bm, a)
    assert a.hashed_tokens == 12
    hashes = [bm.blocks[b].hash for b in a.block_table[:3]]
    assert hashes[0] == first[0] and hashes[1] != first[1] and hashes[2] != first[2]
    old = Sequence("old", list(range(13)))          # the old tokens: only the untouched first block hits
    assert bm.num_cached_prefix_tokens(old) == 4
    new = Sequence("new", list(range(5)) + [99] * 8)
    assert bm.num_cached_prefix_tokens(new) == 12

"""Paged KV block accounting with a prefix cache (nano-vllm / vLLM v1 style).

Full blocks are identified by a chain hash hash((parent_hash, tokens)), and a hit also compares the stored tokens, so
a hash collision can only cost a miss. A block is hashed once its KV has been computed (`cache_blocks`, called by the
runner after each run), never at allocation, so nobody can hit a block whose KV is not written yet. Freed blocks keep
their hash and stay reusable until the free list hands them out again; the free list is LRU (oldest freed first),
with never-used blocks handed out before any cached one.
"""
from __future__ import annotations

from collections import OrderedDict

from tokenplane.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_hit_blocks = 0     # prefix-cache hits, in blocks
        self.num_query_blocks = 0   # full blocks looked up
        self.num_hit_tokens = 0

    # -- accounting -----------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------------------------------
    def _cache_hits(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix. The block holding the last token is never a hit, so every run
        computes at least one token and never writes into a shared block."""
        hits: list[int] = []
        parent = None
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq`'s longest cached prefix, the ones `allocate` would reuse: whole blocks only, and never the
        block holding the last token, so at most floor((num_tokens - 1) / block_size) * block_size."""
        return len(self._cache_hits(seq)) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._cache_hits(seq)
        in_use = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return self.blocks_needed(seq.num_tokens) - in_use <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give a new sequence blocks for all its tokens, reusing the cached prefix; sets num_computed_tokens."""
        if seq.block_table:
            raise ValueError(f"{seq.seq_id}: already has blocks; use append_slots")
        if not self.can_allocate(seq):
            raise RuntimeError(f"{seq.seq_id}: not enough free KV blocks (check can_allocate first)")
        hits = self._cache_hits(seq)
        self.num_query_blocks += (seq.num_tokens - 1) // self.block_size
        self.num_hit_blocks += len(hits)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
        seq.block_table = hits
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        self.num_hit_tokens += seq.num_cached_tokens
        self.append_slots(seq)

    def cache_blocks(self, seq: Sequence) -> None:
        """Hash the sequence's full blocks whose KV is computed, from its `hashed_tokens` on (blocks before it were
        hashed with the tokens they still hold: anything that changes those tokens lowers num_computed_tokens, and
        with it hashed_tokens). Idempotent; a step's call costs only its newly full blocks."""
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        start = min(seq.hashed_tokens // bs, full)
        parent = self.blocks[seq.block_table[start - 1]].hash if start else None
        for i in range(start, full):
            block = self.blocks[seq.block_table[i]]
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            if block.hash is not None and block.token_ids == tokens:
                parent = block.hash
                continue
            h = chain_hash(parent, tokens)
            if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids = h, tokens
            # An equal block cached by another sequence keeps the mapping; either copy serves a hit.
            self.hash_to_block.setdefault(h, block.block_id)
            parent = h
        seq.hashed_tokens = full * bs

    # -- growth and release ---------------------------------------------------------------------------------------
    def can_append(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq.num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def append_slots(self, seq: Sequence) -> None:
        """Grow the block table to cover num_tokens (one new token or a peer's k tokens)."""
        need = self.blocks_needed(seq.num_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise RuntimeError(f"{seq.seq_id}: not enough free KV blocks (check can_append first)")
        for _ in range(need):
            seq.block_table.append(self._take_free_block())

    def prepare(self, seq: Sequence) -> bool:
        """Allocate (new sequence: prefix-cache lookup) or grow blocks to cover num_tokens; False if out of blocks."""
        if not seq.block_table:
            if not self.can_allocate(seq):
                return False
            self.allocate(seq)
        else:
            if not self.can_append(seq):
                return False
            self.append_slots(seq)
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: the cached content is about to be overwritten
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll a sequence back to its first num_tokens tokens (a token dropped for regeneration). Blocks past the
        cut are released; a kept partial block that is shared or cached is released too and recomputed, so no run
        ever writes into KV another sequence may hit."""
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"{seq.seq_id}: cannot truncate {seq.num_tokens} tokens to {num_tokens}")
        del seq.token_ids[num_tokens:]
        seq.num_prompt_tokens = min(seq.num_prompt_tokens, num_tokens)
        keep = self.blocks_needed(num_tokens)
        if num_tokens % self.block_size and keep <= len(seq.block_table):
            last = self.blocks[seq.block_table[keep - 1]]
            if last.ref_count > 1 or last.hash is not None:
                keep -= 1
        self._release(seq.block_table[keep:])
        del seq.block_table[keep:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens, keep * self.block_size)
        seq.num_cached_tokens = min(seq.num_cached_tokens, seq.num_computed_tokens)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (last block first, so a prefix outlives its tails in the LRU)."""
        self._release(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    def _release(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:  # nothing cached: hand it out before any cached block
                    self.free_blocks[block_id] = None
                    self.free_blocks.move_to_end(block_id, last=False)
                else:
                    self.free_blocks[block_id] = None

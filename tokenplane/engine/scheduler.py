"""Continuous batching for one model with chunked prefill: each step computes at most max_num_batched_tokens tokens.

A step's batch, within the token budget and max_num_seqs rows: running decodes first (one token each), then running
sequences with a prefill left (their next chunk), then waiting ones in FIFO order (a preempted one was put back at the
front), each taking a chunk of what the budget leaves. A long prompt is computed over several steps beside the
decodes, so no step runs for seconds; a chunk samples nothing until the prompt's last chunk is computed.

KV memory: admission allocates what the prompt needs (after prefix-cache hits), and blocks grow by one as decoding
crosses a block boundary. When a running sequence cannot grow, the most recently admitted sequence not in this step's
batch is preempted (blocks freed, recomputed later; its full blocks stay in the prefix cache, so recomputation is
mostly cache hits); with none left, the sequence itself. A request that could never fit the pool, even alone, is
refused when it is added.
"""
from __future__ import annotations

from collections import deque

from tokenplane.engine.block_manager import BlockManager
from tokenplane.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()   # admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens >= self.max_model_len:
            raise ValueError(f"{seq.seq_id}: prompt of {seq.num_tokens} tokens leaves no room in max_model_len "
                             f"{self.max_model_len}")
        most = min(seq.num_tokens + seq.params.max_tokens, self.max_model_len)
        if self.bm.blocks_needed(most) > self.bm.num_blocks:
            raise ValueError(f"{seq.seq_id}: {most} tokens (prompt {seq.num_tokens} + max_tokens "
                             f"{seq.params.max_tokens}) can never fit the KV cache's {self.bm.num_blocks} blocks of "
                             f"{self.bm.block_size} tokens ({self.bm.num_blocks * self.bm.block_size} tokens)")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], list[int]]:
        """This step's sequences and how many of each one's uncomputed tokens to compute (ModelRunner.run's
        num_new_tokens)."""
        budget = self.max_num_batched_tokens
        batch: list[Sequence] = []
        counts: list[int] = []
        # 1. running sequences: decodes first, then prefill chunks, each group in admission order.
        for seq in sorted(self.running, key=lambda s: s.num_uncomputed_tokens > 1):
            if budget <= 0 or len(batch) >= self.max_num_seqs:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue   # preempted while an earlier sequence grew
            if not self._grow(seq, batch):
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            batch.append(seq)
            counts.append(n)
            budget -= n
        # 2. admit waiting sequences (FIFO) while rows, budget and blocks last.
        while self.waiting and len(batch) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not self.bm.can_allocate(seq):
                break
            self.bm.allocate(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            batch.append(seq)
            counts.append(n)
            budget -= n
        return batch, counts

    def _grow(self, seq: Sequence, batch: list[Sequence]) -> bool:
        """Blocks for all of a running sequence's tokens; preempts the most recently admitted sequence outside the
        batch while the pool is out, then the sequence itself (False)."""
        while not self.bm.can_append(seq):
            victims = [s for s in self.running if s is not seq and s not in batch]
            if not victims:
                self._preempt(seq)
                return False
            self._preempt(victims[-1])
        self.bm.append_slots(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Append each sampled token (seqs: the ones that sampled); finish and free the sequences that stop.
        Returns the finished ones."""
        finished = []
        for seq, token in zip(seqs, tokens):
            seq.append_token(token)
            p = seq.params
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                seq.status = SequenceStatus.FINISHED_STOPPED
            elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.status = SequenceStatus.FINISHED_LENGTH
            else:
                continue
            self.bm.free(seq)
            self.running.remove(seq)
            finished.append(seq)
        return finished

"""Continuous batching for one model: decode the running sequences, admit waiting ones into the same mixed batch.

Admission control: a waiting sequence is admitted only when its uncomputed tokens fit the step's token budget
(max_num_batched_tokens), the batch has a free row (max_num_seqs) and the block manager can allocate it. When a running
sequence cannot grow, the most recently admitted one is preempted (blocks freed, recomputed later; its full blocks stay
in the prefix cache, so recomputation is mostly cache hits).
"""
from __future__ import annotations

from collections import deque

from tokenplane.engine.block_manager import BlockManager
from tokenplane.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens >= self.max_model_len:
            raise ValueError(f"{seq.seq_id}: prompt of {seq.num_tokens} tokens leaves no room in max_model_len "
                             f"{self.max_model_len}")
        if seq.num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"{seq.seq_id}: prompt of {seq.num_tokens} tokens exceeds max_num_batched_tokens "
                             f"{self.max_num_batched_tokens} (no chunked prefill)")
        if self.bm.blocks_needed(seq.num_tokens + 1) > self.bm.num_blocks:
            raise ValueError(f"{seq.seq_id}: needs more KV blocks than the cache holds")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        # 1. running sequences grow by their uncomputed tokens (one after a decode step).
        kept: deque[Sequence] = deque()
        while self.running:
            seq = self.running.popleft()
            while not self.bm.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    seq = None
                    break
            if seq is not None:
                self.bm.append_slots(seq)
                budget -= seq.num_uncomputed_tokens
                kept.append(seq)
                scheduled.append(seq)
        self.running = kept
        # 2. admit waiting sequences (FIFO; a preempted one was put back at the front).
        while self.waiting and len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            # A sequence longer than the whole budget (a preempted one that grew) still runs, alone.
            if (seq.num_tokens > budget and scheduled) or not self.bm.can_allocate(seq):
                break
            self.bm.allocate(seq)
            budget -= seq.num_uncomputed_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Append each sampled token; finish and free the sequences that stop. Returns the finished ones."""
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

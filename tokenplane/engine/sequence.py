"""A request's token state as the engine sees it (vLLM's counter model).

Tokens in [num_computed_tokens, num_tokens) are what the next run computes: a prompt prefill, one decoded token, a
prefix-cache hit's remainder, or k tokens a peer model wrote while this model was not looking. One code path.
"""
from __future__ import annotations

from enum import IntEnum

import torch

from tokenplane.engine.sampler import SamplingParams, token_set


class SequenceStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # finished range: status > PREEMPTED
    FINISHED_STOPPED = 3   # sampled a stop/eos token
    FINISHED_LENGTH = 4    # hit max_tokens or the model length
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self > SequenceStatus.PREEMPTED


class Sequence:
    def __init__(self, seq_id: str, token_ids: list[int], params: SamplingParams | None = None) -> None:
        self.seq_id = seq_id
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        # leading tokens whose full blocks BlockManager.cache_blocks has hashed; lowered with num_computed_tokens,
        # which every change to tokens below it lowers too (truncate, a peer's rewrite, free)
        self.hashed_tokens = 0
        self._num_computed_tokens = 0
        self.num_cached_tokens = 0     # of those, how many came from the prefix cache at allocation
        self.block_table: list[int] = []
        self.params = params if params is not None else SamplingParams()
        self.status = SequenceStatus.WAITING
        self._prompt_set: torch.Tensor | None = None

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is in this model's cache."""
        return self._num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self._num_computed_tokens = value
        if value < self.hashed_tokens:
            self.hashed_tokens = value

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_set(self) -> torch.Tensor:
        """The prompt's distinct token ids (sampler.token_set), computed once: the repetition penalty reads them
        every step."""
        if self._prompt_set is None:
            self._prompt_set = token_set(self.token_ids[:self.num_prompt_tokens])
        return self._prompt_set

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)}, {self.status.name})")

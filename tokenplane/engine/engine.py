"""LLMEngine: one model, continuous batching, nano-vllm's three-line step (schedule -> run -> postprocess).

Used by tests, as the single-model reference, and as the standard-serving baseline.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from tokenplane.engine.loader import load_model
from tokenplane.engine.model_runner import GreedyOutput, ModelRunner
from tokenplane.engine.sampler import SamplingParams, sample, splitmix64
from tokenplane.engine.scheduler import Scheduler
from tokenplane.engine.sequence import Sequence, SequenceStatus


@dataclass
class StepOutput:
    seq_id: str
    token: int
    finished: bool
    finish_reason: str | None  # "stop" | "length" | None


class LLMEngine:
    def __init__(self, source: Any, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0, num_blocks: int = 512, block_size: int = 16, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None, enforce_eager: bool = False,
                 decode_kernel: str = "auto", num_threads: int | None = None, prefill_kernel: str = "auto",
                 greedy_screen: bool = True) -> None:
        """num_threads: torch's intra-op threads for this process (torch.set_num_threads), set before the model loads;
        None leaves the process setting alone. Pin the process to cores from outside (taskset, or the serving
        runtime's per-sub-server cores): one engine per process, so its thread count is the process's.
        greedy_screen: a step whose sequences are all greedy without logprobs asks the runner for tokens
        (`ModelRunner.run_greedy`: the same tokens, from a bf16 screen of the vocabulary projection where the model
        has one) instead of full logits; False always projects in full (the baseline)."""
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError("num_threads must be >= 1")
            torch.set_num_threads(num_threads)
        self.cfg, model = load_model(source, device=device, dtype=dtype, seed=seed)
        self.runner = ModelRunner(model, self.cfg, num_blocks=num_blocks, block_size=block_size, device=device,
                                  dtype=dtype, enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
                                  decode_kernel=decode_kernel, prefill_kernel=prefill_kernel,
                                  max_num_batched_tokens=max_num_batched_tokens)
        self.runner.warm_kernels(greedy=greedy_screen)   # compile the CPU kernels now, not on the first requests
        limit = min(self.cfg.max_position_embeddings, num_blocks * block_size)
        eos = self.cfg.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        self.scheduler = Scheduler(self.runner.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=min(limit, max_model_len or limit), eos_token_ids=eos_ids)
        self.seed = seed
        self.greedy_screen = greedy_screen
        self._ids = itertools.count()

    def _history(self, s: Sequence) -> tuple:
        """A sequence's sampler.History: its prompt's token set, its output, the ids that end it."""
        p = s.params
        ends = p.stop_token_ids + (() if p.ignore_eos else self.scheduler.eos_token_ids)
        return s.prompt_set, s.output_token_ids, ends

    @property
    def model_runner(self) -> ModelRunner:
        return self.runner

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        n = next(self._ids)
        if params.temperature > 0 and params.seed is None:
            # Reproducible per engine seed and arrival order instead of per process.
            params = dataclasses.replace(params, seed=splitmix64(self.seed * 7919 + n) >> 1)
        rid = request_id if request_id is not None else f"req-{n}"
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        self.scheduler.add(Sequence(rid, [int(t) for t in prompt_ids], params))
        return rid

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        """One schedule -> run -> postprocess step. Returns a token for each sequence that sampled this step (a
        prefill chunk that is not a prompt's last samples nothing)."""
        batch, counts = self.scheduler.schedule()
        if not batch:
            raise RuntimeError("nothing schedulable: the KV cache is too small for any waiting request")
        greedy = self.greedy_screen and not any(s.params.needs_logits for s in batch)
        out = self.runner.run_greedy(batch, counts) if greedy else self.runner.run(batch, counts)
        seqs = [batch[i] for i in out.rows] if out.rows is not None else batch
        if not seqs:
            return []
        tokens = (out.tokens if isinstance(out, GreedyOutput)
                  else sample(out.logits, [s.params for s in seqs], [s.num_output_tokens for s in seqs],
                              [self._history(s) if s.params.needs_history else None for s in seqs]))
        finished = {s.seq_id for s in self.scheduler.postprocess(seqs, tokens)}
        reasons = {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH: "length"}
        return [StepOutput(s.seq_id, t, s.seq_id in finished, reasons.get(s.status)) for s, t in zip(seqs, tokens)]

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[list[int]]:
        """Output token ids per prompt (prompt excluded), in prompt order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                if o.seq_id in outputs:
                    outputs[o.seq_id].append(o.token)
        return [outputs[rid] for rid in ids]

"""Runs one mixed batch (varlen prefill + decode + catch-up) over the paged KV cache; CUDA graphs for decode.

`run(seqs)` computes every sequence's uncomputed tokens [num_computed_tokens, num_tokens) in one forward pass over a
flat token batch and returns logits and final hidden states at each sequence's last position. Callers give each
sequence blocks first (`block_manager.allocate` / `append_slots`, or `prepare`).

`run(seqs, num_new_tokens)` computes only the first n uncomputed tokens of each sequence (chunked prefill) and projects
onto the vocabulary only the rows whose sequence is then complete, the ones a scheduler samples (`RunnerOutput.rows`).
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenplane.engine import cpu_decode_attention, cpu_prefill_attention
from tokenplane.engine.attention import AttentionMetadata, SeqAttention, causal_mask
from tokenplane.engine.block_manager import BlockManager
from tokenplane.engine.config import ModelConfig
from tokenplane.engine.cpu_malloc import retain_freed_memory
from tokenplane.engine.layers import Linear, SwiGLU, warm_packed
from tokenplane.engine.sampler import greedy
from tokenplane.engine.sequence import Sequence


@dataclass
class RunnerOutput:
    logits: torch.Tensor  # [B, V] float32 (float64 for float64 models, so equivalence tests keep full precision)
    hidden: torch.Tensor  # [B, H] final-norm hidden state at the same positions, same dtype as logits
    rows: list[int] | None = None  # with num_new_tokens: the batch rows these B rows belong to (complete sequences)


@dataclass
class GreedyOutput:
    tokens: list[int]     # per row: sampler.greedy of the logits `run` would return (their first maximum)
    hidden: torch.Tensor  # as RunnerOutput.hidden
    project: Callable[[int], torch.Tensor]   # row i -> the [V] logits `run` would return for it
    rows: list[int] | None = None  # as RunnerOutput.rows
    screened: bool = False  # True: the model's greedy screen gave them (no full vocabulary projection ran)
    top: torch.Tensor | None = None  # run_greedy(top_k=k): each row's k largest logits, descending [B, min(k, V)]


def _block_table_array(tables: list[list[int]], context_lens: list[int], bs: int) -> np.ndarray:
    """One [rows, max_blocks] int64 table for the compiled kernels; entries past a row's context are never read."""
    width = max(-(-n // bs) for n in context_lens)
    out = np.zeros((len(tables), width), dtype=np.int64)
    for i, (bt, n) in enumerate(zip(tables, context_lens)):
        nb = -(-n // bs)
        out[i, :nb] = bt[:nb]
    return out


def graph_block_bucket(need: int, cap: int, steps: int = 8) -> int:
    """The block-table width a decode graph is captured for, for rows of up to `need` blocks: the next multiple of
    1/`steps` of the power of two at or above `need` (steps 8: `need` itself up to 8, then four widths an octave;
    steps 1: powers of two), at most `cap`.
    The padded attention a graph replays reads every slot of that width for every row, so its cost follows the width:
    powers of two alone padded up to 2x (measured on an H200, qwen3-0.6b bf16, 541-token contexts: a graph step at
    batch 128 took 45.7 ms against 28.4 eager); an eighth of the octave pads by at most 25%."""
    need = max(1, need)
    octave = 1 << (need - 1).bit_length()
    step = max(1, octave // steps)
    return min(-(-need // step) * step, cap)


def _graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class ModelRunner:
    def __init__(self, model: nn.Module, cfg: ModelConfig, *, num_blocks: int, block_size: int = 16,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 enforce_eager: bool = False, max_num_seqs: int = 256, decode_kernel: str = "auto",
                 prefill_kernel: str = "auto", max_num_batched_tokens: int | None = None) -> None:
        """decode_kernel: "cpu" (one compiled call per layer for all one-token rows, reading the paged KV in place;
        CPU float32/float64 only), "varlen" (per-sequence SDPA), "padded" (one masked SDPA over the padded batch) or
        "auto" (cpu where it applies, else varlen on CPU; padded on CUDA where it is what the graphs capture). A model
        serves one runner at a time: the runner binds its KV cache into the model's attention layers.
        prefill_kernel (rows of several tokens): "cpu" (one compiled call per layer for all of them, reading the paged
        KV in place; CPU float32 with head_dim a multiple of 16, or bfloat16 with head_dim a multiple of 32 on AMX
        tiles or AVX-512 vectors), "varlen" (per-sequence SDPA) or "auto" (cpu where it applies and the step runs on
        1 torch thread, the setting it was measured faster at; varlen otherwise). Either way rows too short to gain
        (cpu_prefill_attention.worth) stay with SDPA.
        max_num_batched_tokens: the step's token budget; given, every oneDNN-packed GEMM (CPU bf16) is built at
        each row bucket up to it now, not on a serving step (layers.packed_rows; `warm_up_s` says how long)."""
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = dtype if dtype is not None else param.dtype
        # logits and hidden states leave the runner in float32 (float64 for float64 models: equivalence tests)
        self.out_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        if param.device != self.device or param.dtype != self.dtype:
            model = model.to(device=self.device, dtype=self.dtype)
        if decode_kernel not in ("auto", "cpu", "varlen", "padded"):
            raise ValueError(f"decode_kernel must be auto, cpu, varlen or padded, not {decode_kernel!r}")
        if decode_kernel == "cpu" and not cpu_decode_attention.available(self.dtype, self.device):
            raise ValueError(f"decode_kernel 'cpu' needs a CPU float32/float64 model, not {self.device} {self.dtype}")
        if prefill_kernel not in ("auto", "cpu", "varlen"):
            raise ValueError(f"prefill_kernel must be auto, cpu or varlen, not {prefill_kernel!r}")
        prefill_ok = cpu_prefill_attention.available(self.dtype, self.device, cfg.head_dim,
                                                     cfg.num_attention_heads // cfg.num_key_value_heads, block_size)
        if prefill_kernel == "cpu" and not prefill_ok:
            raise ValueError(f"prefill_kernel 'cpu' needs a CPU float32 model with head_dim a multiple of 16 "
                             f"(bfloat16: an AMX or AVX-512 host and head_dim a multiple of 32), not "
                             f"{self.device} {self.dtype} head_dim {cfg.head_dim}")
        self.prefill_kernel = prefill_kernel if prefill_ok else "varlen"
        self.model, self.cfg = model, cfg
        if self.device.type == "cpu":
            retain_freed_memory()   # process-wide: large activations stop page-faulting in every step (cpu_malloc.py)
        self.block_size = block_size
        self.block_manager = BlockManager(num_blocks, block_size)
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads
        # One extra block at the end is the scratch target of CUDA-graph padding rows; the manager never hands it out.
        self.scratch_block = num_blocks
        self.kv_cache = torch.zeros(2, cfg.num_hidden_layers, cfg.num_key_value_heads, (num_blocks + 1) * block_size,
                                    cfg.head_dim, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache, attn.v_cache, attn.block_size = self.kv_cache[0, i], self.kv_cache[1, i], block_size
        # CPU fp32/bf16: oneDNN-packed weight copies (layers.cpu_pack); no-op elsewhere.
        self.cpu_packed = bool(getattr(model, "pack_cpu", lambda: False)())
        self.warm_up_s = 0.0
        if self.cpu_packed and max_num_batched_tokens is not None:
            self.warm_up_s = self._warm_packed(max_num_batched_tokens, max_num_seqs)
        is_cuda = self.device.type == "cuda"
        if decode_kernel == "auto":
            decode_kernel = ("padded" if is_cuda else
                             "cpu" if cpu_decode_attention.available(self.dtype, self.device) else "varlen")
        self.decode_kernel = decode_kernel
        self.use_cuda_graphs = is_cuda and not enforce_eager
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = min(num_blocks, -(-cfg.max_position_embeddings // block_size))
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_pool = None
        self._static: dict[str, torch.Tensor] = {}
        self.graph_batch_sizes = _graph_batch_sizes(max_num_seqs)
        self.graph_width_steps = 8   # graph_block_bucket's steps: 8 pads by at most 25%; 1 (powers of two) the baseline

    def _warm_packed(self, max_tokens: int, max_seqs: int) -> float:
        """Seconds spent running every distinct oneDNN-packed GEMM once at each row bucket a step can use
        (layers.warm_packed): the linears up to the step's token budget, the vocabulary projection up to the rows
        that sample (one per sequence)."""
        t0 = time.perf_counter()
        shapes: dict[tuple[int, int, bool], tuple[torch.Tensor, torch.Tensor | None, int]] = {}
        swiglus: dict[tuple[int, int, bool], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                   torch.Tensor | None, int]] = {}
        for m in self.model.modules():
            if isinstance(m, Linear) and m.cpu_packed is not None:
                shapes.setdefault((m.in_features, m.out_features, m.bias is not None),
                                  (m.cpu_packed, m.bias, m.in_features))
            elif isinstance(m, SwiGLU) and m.cpu_gate is not None and m.cpu_up is not None:
                width = m.gate_up_proj.in_features
                swiglus.setdefault((width, m.ffn, m.cpu_biases[0] is not None),
                                   (m.cpu_gate, m.cpu_up, *m.cpu_biases, width))
        with torch.inference_mode():
            warm_packed(list(shapes.values()), max_tokens, list(swiglus.values()))
            vocab = getattr(self.model, "vocab_projection", None)
            if vocab is not None and vocab.packed is not None:
                warm_packed([(vocab.packed, None, vocab.weight.shape[1])], max_seqs)
        return time.perf_counter() - t0

    def warm_kernels(self, greedy: bool = True) -> float:
        """Makes the compiled CPU kernels' first calls now instead of on a serving step: numba compiles each kernel
        signature on its first call (seconds each in a fresh install, cached on disk after; a routing run measured a
        first repeat at 7.7 s against 2.2-2.5 s once a model's catch-up kernels had compiled). Dummy sequences reach
        every path a step takes: a prefill long enough for the wide prefill kernel (`min_rows`; bf16 on AMX: 384
        rows), a catch-up chunk after cached context, decode steps of 1 and of 9 rows, full logits and (greedy) the
        greedy screen's tokens; their blocks are freed after. A pool too small for them is left as is (returns 0).
        Returns seconds; CPU only."""
        if self.device.type != "cpu":
            return 0.0
        bs, vocab = self.block_size, self.cfg.vocab_size
        first_len = 64
        if self.prefill_kernel != "varlen":   # bf16 kernels' rows can start higher (the AMX one's at 384)
            rows = cpu_prefill_attention.min_rows(self.dtype, self.group, self.cfg.head_dim, bs)
            first_len = max(first_len, -(-rows // self.group))
        lengths = [first_len] + [4] * 8   # tokens each sequence reaches before the decode steps
        steps = 6 + 2 + 2                 # the catch-up chunk and the decode steps, on the first sequence
        need = (-(-(lengths[0] + steps) // bs) + sum(-(-(n + 2) // bs) for n in lengths[1:]))
        if need > self.block_manager.num_free_blocks:
            return 0.0
        t0 = time.perf_counter()
        seqs = [Sequence(f"warm-kernels-{i}", [(31 * i + 7 * t + 3) % vocab for t in range(n)])
                for i, n in enumerate(lengths)]
        first, rest = seqs[0], seqs[1:]

        def step(batch: list[Sequence], tokens: int, screen: bool) -> bool:
            for s in batch:
                for _ in range(tokens):
                    s.append_token((s.token_ids[-1] * 17 + 5) % vocab)
                if not self.prepare(s):     # the pool refused (checked above; a guard, not an expected case)
                    return False
            if screen:
                self.run_greedy(batch)
            else:
                self.run(batch)
            return True
        plan = [([first], 0, False),         # prefill (wide prefill kernel)
                ([first], 6, False),         # catch-up chunk after cached context (narrow kernel)
                ([first], 1, False),         # one decode row, full logits
                (rest, 0, False),            # short prefills
                (seqs, 1, False)]            # nine decode rows
        if greedy:
            plan += [([first], 1, True), (seqs, 1, True)]
        try:
            for batch, tokens, screen in plan:
                if not step(batch, tokens, screen):
                    break
        finally:
            for s in seqs:
                self.free(s)
        return time.perf_counter() - t0

    # -- block helpers ----------------------------------------------------------------------------------------------
    def prepare(self, seq: Sequence) -> bool:
        """Allocate (new sequence, prefix cache lookup) or grow blocks to cover num_tokens; False if out of blocks."""
        return self.block_manager.prepare(seq)

    def free(self, seq: Sequence) -> None:
        self.block_manager.free(seq)

    # -- run --------------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_new_tokens: list[int] | None = None) -> RunnerOutput:
        hidden, rows = self._forward(seqs, num_new_tokens)
        logits = self.model.compute_logits(hidden) if hidden.shape[0] else hidden.new_empty(0, self.cfg.vocab_size)
        return RunnerOutput(logits=logits.to(self.out_dtype), hidden=hidden.to(self.out_dtype), rows=rows)

    @torch.inference_mode()
    def run_greedy(self, seqs: list[Sequence], num_new_tokens: list[int] | None = None,
                   top_k: int = 0) -> GreedyOutput:
        """`run`, answering each row's greedy token (and with top_k > 0 its top_k largest logits, the values
        torch.topk gives) instead of its logits: the model's greedy screen (greedy_screen.py: a bf16 pass over the
        vocabulary matrix, then the fp32 logits of the few rows that can be the maximum) where it applies and proves
        the answer, else the full projection. Either way the token `sampler.greedy(run(...).logits)` gives; each
        row's logits stay one call away (`GreedyOutput.project`)."""
        hidden, rows = self._forward(seqs, num_new_tokens)
        model, out_dtype, hidden_out = self.model, self.out_dtype, hidden.to(self.out_dtype)

        def project(i: int) -> torch.Tensor:   # one row's logits (a row's projection does not depend on its batch)
            with torch.inference_mode():
                return model.compute_logits(hidden[i:i + 1])[0].to(out_dtype)
        if not hidden.shape[0]:
            return GreedyOutput([], hidden_out, project, rows)
        screen = getattr(model, "greedy_tokens", None)
        got = screen(hidden, top_k) if screen is not None else None
        if got is not None:
            tokens, top = got
            return GreedyOutput(tokens, hidden_out, project, rows, screened=True,
                                top=None if top is None else torch.from_numpy(top).to(out_dtype))
        logits = model.compute_logits(hidden).to(out_dtype)
        k = min(top_k, logits.shape[-1])
        return GreedyOutput(greedy(logits).tolist(), hidden_out, project, rows,
                            top=torch.topk(logits, k).values if k > 0 else None)

    def _forward(self, seqs: list[Sequence], num_new_tokens: list[int] | None) -> tuple[torch.Tensor, list[int] | None]:
        """The model over every sequence's next tokens: (final-norm hidden states of the rows to project, rows)."""
        if not seqs:
            raise ValueError("run() needs at least one sequence")
        if num_new_tokens is not None and len(num_new_tokens) != len(seqs):
            raise ValueError("num_new_tokens needs one count per sequence")
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[tuple[int, int]] = []
        for i, seq in enumerate(seqs):
            if seq.num_tokens == 0:
                raise ValueError(f"{seq.seq_id}: empty sequence")
            # Everything computed already (e.g. asked for logits again): recompute the last token.
            start = min(seq.num_computed_tokens, seq.num_tokens - 1)
            end = seq.num_tokens
            if num_new_tokens is not None:
                if num_new_tokens[i] < 1:
                    raise ValueError(f"{seq.seq_id}: num_new_tokens must be >= 1")
                end = min(end, start + num_new_tokens[i])
            if len(seq.block_table) * bs < end:
                raise ValueError(f"{seq.seq_id}: block table covers {len(seq.block_table) * bs} < {end} tokens; "
                                 "call block_manager.allocate/append_slots (or runner.prepare) first")
            bt = seq.block_table
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(bt[p // bs] * bs + p % bs for p in range(start, end))
            spans.append((start, end))
        decode_only = len(ids) == len(seqs)
        rows = None if num_new_tokens is None else [i for i, (seq, (_, e)) in enumerate(zip(seqs, spans))
                                                     if e == seq.num_tokens]
        if decode_only and self.use_cuda_graphs and len(seqs) <= self.max_num_seqs:
            hidden = self._run_graph(ids, positions, slots, seqs, [e for _, e in spans])
            if rows is not None and len(rows) < len(seqs):
                hidden = hidden[rows]
        else:
            meta = self._metadata(seqs, spans, slots, padded=decode_only and self.decode_kernel == "padded")
            dev = self.device
            keep_t = None
            if not decode_only or (rows is not None and len(rows) < len(seqs)):
                last = list(itertools.accumulate(e - s for s, e in spans))
                keep = [last[i] - 1 for i in (rows if rows is not None else range(len(seqs)))]
                keep_t = torch.tensor(keep, dtype=torch.long, device=dev)
            # the model computes only the kept rows after the last layer's attention
            hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta, keep_t)
        for seq, (_, end) in zip(seqs, spans):
            seq.num_computed_tokens = end
            self.block_manager.cache_blocks(seq)
        return hidden, rows

    def _metadata(self, seqs: list[Sequence], spans: list[tuple[int, int]], slots: list[int],
                  padded: bool) -> AttentionMetadata:
        dev, bs = self.device, self.block_size
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=dev))
        if padded:
            nblk = max(-(-end // bs) for _, end in spans)
            rows = [seq.block_table[:nblk] + [self.scratch_block] * (nblk - len(seq.block_table[:nblk]))
                    for seq in seqs]
            meta.block_tables = torch.tensor(rows, device=dev)
            meta.context_lens = torch.tensor([end for _, end in spans], device=dev)
            return meta
        q_start = 0
        cpu_kernel = self.decode_kernel == "cpu"
        cpu_prefill = self.uses_cpu_prefill()
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefill: list[tuple[int, int, int, list[int]]] = []   # q_start, q_len, context_len, block table
        for seq, (start, end) in zip(seqs, spans):
            q_len = end - start
            if q_len == 1 and cpu_kernel:
                decode_rows.append(q_start)
                decode_tables.append(seq.block_table)
                decode_lens.append(end)
                q_start += 1
                continue
            if q_len > 1 and cpu_prefill and cpu_prefill_attention.worth(q_len, self.group, self.dtype,
                                                                         self.cfg.head_dim, bs):
                prefill.append((q_start, q_len, end, seq.block_table))
                q_start += q_len
                continue
            blocks = seq.block_table[:-(-end // bs)]
            s = SeqAttention(q_start=q_start, q_len=q_len, context_len=end)
            if blocks[-1] - blocks[0] == len(blocks) - 1 and blocks == list(range(blocks[0], blocks[-1] + 1)):
                s.kv_slice_start = blocks[0] * bs  # consecutive blocks: a view, no gather
            else:
                s.kv_blocks = torch.tensor(blocks, device=dev)
            if 1 < q_len < end:   # a chunk after cached tokens; q_len == end runs causal without a mask
                s.mask = causal_mask(q_len, end, dev)
            meta.seqs.append(s)
            q_start += q_len
        if decode_rows:
            # one [D, max_blocks] table; entries past a row's context are never read
            meta.decode_rows = np.array(decode_rows, dtype=np.int64)
            meta.decode_block_tables = _block_table_array(decode_tables, decode_lens, bs)
            meta.decode_context_lens = np.array(decode_lens, dtype=np.int64)
        if prefill:
            meta.prefill_q_starts = np.array([p[0] for p in prefill], dtype=np.int64)
            meta.prefill_q_lens = np.array([p[1] for p in prefill], dtype=np.int64)
            meta.prefill_context_lens = np.array([p[2] for p in prefill], dtype=np.int64)
            meta.prefill_block_tables = _block_table_array([p[3] for p in prefill], [p[2] for p in prefill], bs)
        return meta

    def uses_cpu_prefill(self) -> bool:
        """Whether this step's multi-token rows go to cpu_prefill_attention (see prefill_kernel)."""
        if self.prefill_kernel == "auto":
            return torch.get_num_threads() == 1
        return self.prefill_kernel == "cpu"

    # -- CUDA graphs (decode only) ------------------------------------------------------------------------------------
    def _run_graph(self, ids: list[int], positions: list[int], slots: list[int], seqs: list[Sequence],
                   ends: list[int]) -> torch.Tensor:
        B, bs = len(seqs), self.block_size
        batch = next(b for b in self.graph_batch_sizes if b >= B)
        nblk = graph_block_bucket(max(-(-end // bs) for end in ends), self.max_blocks_per_seq, self.graph_width_steps)
        st = self._static_buffers()
        self._reset_static(batch)
        dev = self.device
        st["input_ids"][:B] = torch.tensor(ids, device=dev)
        st["positions"][:B] = torch.tensor(positions, device=dev)
        st["slots"][:B] = torch.tensor(slots, device=dev)
        st["context_lens"][:B] = torch.tensor(ends, device=dev)
        rows = [seq.block_table[:nblk] + [self.scratch_block] * (nblk - len(seq.block_table[:nblk])) for seq in seqs]
        st["block_tables"][:B, :nblk] = torch.tensor(rows, device=dev)
        graph, out = self._graphs.get((batch, nblk)) or self._capture(batch, nblk)
        graph.replay()
        return out[:B].clone()

    def _static_buffers(self) -> dict[str, torch.Tensor]:
        if not self._static:
            n, dev = self.max_num_seqs, self.device
            self._static = {"input_ids": torch.zeros(n, dtype=torch.long, device=dev),
                            "positions": torch.zeros(n, dtype=torch.long, device=dev),
                            "slots": torch.zeros(n, dtype=torch.long, device=dev),
                            "context_lens": torch.ones(n, dtype=torch.long, device=dev),
                            "block_tables": torch.zeros(n, self.max_blocks_per_seq, dtype=torch.long, device=dev)}
        return self._static

    def _reset_static(self, batch: int) -> None:
        """Padding rows: token 0 at position 0 written to the scratch slot, attending to that one slot."""
        st = self._static
        st["input_ids"][:batch].zero_()
        st["positions"][:batch].zero_()
        st["slots"][:batch].fill_(self.scratch_block * self.block_size)
        st["context_lens"][:batch].fill_(1)
        st["block_tables"][:batch].fill_(self.scratch_block)

    def _capture(self, batch: int, nblk: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        st = self._static
        meta = AttentionMetadata(slot_mapping=st["slots"][:batch], block_tables=st["block_tables"][:batch, :nblk],
                                 context_lens=st["context_lens"][:batch])
        saved = {k: v[:batch].clone() for k, v in st.items()}
        self._reset_static(batch)  # warmup and capture write only to the scratch block

        def forward() -> torch.Tensor:
            return self.model(st["input_ids"][:batch], st["positions"][:batch], meta)

        graph, out = self._graph_capture(forward)
        for k, v in saved.items():
            st[k][:batch] = v
        self._graphs[(batch, nblk)] = (graph, out)
        return graph, out

    def _graph_capture(self, forward) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (as torch's CUDA-graph docs require), then capture into the shared pool. Graphs
        replay one at a time and their outputs are copied right after replay, so sharing one pool is safe."""
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = forward()
        if self._graph_pool is None:
            self._graph_pool = graph.pool()
        return graph, out

    def capture_graphs(self, batch_sizes: list[int] | None = None, max_context: int = 1024) -> int:
        """Capture decode graphs ahead of time (otherwise each (batch bucket, block bucket) is captured on first use).
        Returns the number of graphs held."""
        if not self.use_cuda_graphs:
            return 0
        self._static_buffers()
        need = -(-max_context // self.block_size)
        nblk_buckets = sorted({graph_block_bucket(n, self.max_blocks_per_seq, self.graph_width_steps)
                               for n in range(1, need + 1)})
        with torch.inference_mode():
            for b in sorted(batch_sizes or self.graph_batch_sizes, reverse=True):
                batch = next(x for x in self.graph_batch_sizes if x >= b)
                for nb in nblk_buckets:
                    if (batch, nb) not in self._graphs:
                        self._capture(batch, nb)
        return len(self._graphs)

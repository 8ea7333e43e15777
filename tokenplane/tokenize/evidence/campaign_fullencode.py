"""Full-encode differential campaign: the CPU path vs the reference, at the piece level and the ID level.

`run_campaign(family, texts)` checks every text twice:
  pieces  `pretokenize.pieces` vs `ReferenceEngine.pretokenize` (HF Split / Onig) on the normalized text;
  IDs     the CPU path (serial, and chunk-parallel with forced small chunks for long texts) vs
          `ReferenceEngine.encode_ordinary`.
It returns counts; any divergence carries a minimal reproduction (the text, shrunk by halving while it still fails).
`tokenplane verify` (campaign.py) calls it with `seconds=`/`seed=`/`corpus=` instead of a text list.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Iterable, Sequence

import numpy as np

from ..cpu import pretokenize
from ..cpu.parallel import CpuEncoder
from ..tokenizer import Tokenizer
from . import adversarial

_ENCODERS: dict[str, CpuEncoder] = {}


def _encoder(tok: Tokenizer) -> CpuEncoder:
    key = f"{tok.name}:{tok.content_hash}"
    enc = _ENCODERS.get(key)
    if enc is None:
        enc = _ENCODERS[key] = CpuEncoder(tok)
    return enc


def _shrink(text: str, fails) -> str:
    """Smaller text that still fails (drop halves/quarters while possible)."""
    step = len(text) // 2
    while step >= 1:
        changed = False
        i = 0
        while i < len(text):
            cand = text[:i] + text[i + step:]
            if cand and fails(cand):
                text = cand
                changed = True
            else:
                i += step
        if not changed:
            step //= 2
    return text


def check_text(tok: Tokenizer, enc: CpuEncoder, text: str, counts: dict) -> dict | None:
    """One text at both levels; updates counts; returns a divergence record or None."""
    norm = tok.reference.normalize(text)
    counts["texts"] += 1
    counts["chars"] += len(norm)
    ref_pieces = tok.reference.pretokenize(norm)
    got_pieces = pretokenize.pieces(tok.family, norm)
    counts["pieces_checked"] += len(ref_pieces)
    if got_pieces != ref_pieces:
        counts["piece_divergences"] += 1

        def fails(t):
            n = tok.reference.normalize(t)
            return pretokenize.pieces(tok.family, n) != tok.reference.pretokenize(n)
        return {"level": "pieces", "family": tok.name, "text": _shrink(text, fails)}
    ref_ids = tok.reference.encode_ordinary(text)
    got = enc.encode(text, parallel=False)
    counts["ids_checked"] += int(ref_ids.shape[0])
    if not np.array_equal(got, ref_ids):
        counts["id_divergences"] += 1

        def fails(t):
            return not np.array_equal(enc.encode(t, parallel=False), tok.reference.encode_ordinary(t))
        return {"level": "ids", "family": tok.name, "text": _shrink(text, fails)}
    if len(norm) >= 64 and enc.rule is not None:
        chunks = 2 + len(norm) // 4096
        # raw text: for qwen3 this is the path that cuts before NFC and normalizes per chunk
        par = enc.encode_parallel(text, n_chunks=chunks)
        counts["parallel_checked"] += 1
        if not np.array_equal(par, ref_ids):
            counts["parallel_divergences"] += 1
            return {"level": "parallel", "family": tok.name, "text": text, "chunks": chunks}
    return None


def run_campaign(family: Tokenizer | str, texts: Iterable[str] | None = None, *, seconds: float | None = None,
                 seed: int = 0, corpus: Sequence[str] = (), max_failures: int = 5) -> dict:
    """Counts of a differential run for one tokenizer (`family`: a Tokenizer or a registered name).

    With `texts`, every text is checked. Without, adversarial and corpus-derived texts are generated from `seed`
    for `seconds` (default 10 s)."""
    from ..registry import load

    tok = load(family) if isinstance(family, str) else family
    counts = {"family": tok.name, "texts": 0, "chars": 0, "pieces_checked": 0, "ids_checked": 0,
              "parallel_checked": 0, "piece_divergences": 0, "id_divergences": 0, "parallel_divergences": 0}
    failures: list[dict] = []
    if not pretokenize.supported(tok.family):
        counts.update(checks=0, divergences=0, skipped=f"no per-character pre-tokenizer for {tok.family.name}")
        return counts
    enc = _encoder(tok)
    if texts is None:
        rng = random.Random(seed)
        stream = adversarial.text_stream(rng, list(corpus or ()))
        deadline = time.monotonic() + (10.0 if seconds is None else seconds)
        texts = (next(stream) for _ in iter(lambda: time.monotonic() < deadline, False))
    for text in texts:
        fail = check_text(tok, enc, text, counts)
        if fail is not None:
            failures.append(fail)
            if len(failures) >= max_failures:
                break
    counts["divergences"] = counts["piece_divergences"] + counts["id_divergences"] + counts["parallel_divergences"]
    counts["checks"] = counts["texts"]
    if failures:
        counts["reproduction"] = failures
    return counts


def main_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", default=None, help="corpus directory from build_corpus.py")
    parser.add_argument("--families", default="cl100k_base,o200k_base,llama3,qwen3,deepseek_v4,smollm2")
    parser.add_argument("--max-chars", type=int, default=10 ** 7, help="characters per document")


def main(args: argparse.Namespace) -> int:
    import json
    import os

    docs: list[str] = []
    if args.corpus:
        for name in ("mixed.jsonl", "nonen.jsonl"):
            path = os.path.join(args.corpus, name)
            if os.path.exists(path):
                with open(path, encoding="utf-8") as fh:
                    docs += [json.loads(line)["text"][:args.max_chars] for line in fh]
    bad = 0
    for fam in args.families.split(","):
        res = run_campaign(fam, docs if docs else None)
        print(json.dumps(res, ensure_ascii=False), flush=True)
        bad += res["divergences"]
    return 1 if bad else 0

"""The k largest logits of each row, sorted descending (R2R's router input), without a full top-k over the vocabulary.

Why: torch.topk(k=100) over a 151936-entry float32 row took 0.39 ms per row on one core here (~3.4 ms of a C=16
small-model step at ~9 rows), plus a copy of the rows into one [B, V] tensor. Block maxima bound the answer instead:
with the row cut into blocks of 128, let L be the k-th largest block maximum. The k blocks whose maxima are >= L hold
k entries >= L, so the row's k-th largest value is >= L and every top-k entry is among the entries >= L (a few
hundred at most on real rows): one vectorized max pass, a top-k over ~1200 block maxima, a compare-and-select pass,
and a top-k over the candidates: 0.13 ms per row here (9 rows of 151936: 1.2 ms vs 2.5 ms for stack + torch.topk).

Exactness: the result is the same multiset of values, sorted descending, as torch.topk(row, k).values, so the same
tensor (ties are equal values; only the sign of a zero could differ between the two, which no sum sees). Rows with a
NaN (torch.topk orders NaN above everything), shorter than k blocks, or with more candidates than a quarter of the
row (nearly constant rows) take torch.topk.
"""

from __future__ import annotations

import torch

BLOCK = 128


def top_values(rows: list[torch.Tensor], k: int) -> torch.Tensor:
    """[len(rows), k]: each row's k largest values (rows: 1-D tensors of one length >= k), largest first."""
    return torch.stack([_row(r, k) for r in rows])


def _row(x: torch.Tensor, k: int) -> torch.Tensor:
    x = x.detach()
    v = x.shape[0]
    n = v // BLOCK
    if n < k or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return torch.topk(x, k).values
    body = x[:n * BLOCK].reshape(n, BLOCK).amax(-1)
    if v > n * BLOCK:
        body = torch.cat([body, x[n * BLOCK:].amax()[None]])
    if bool(torch.isnan(body).any()):
        return torch.topk(x, k).values
    bound = float(torch.topk(body, k).values[-1])
    a = x.numpy()
    cand = a[a >= bound]   # numpy's compare + select: 36 us on 151936 entries here, torch's masked select 250 us
    if cand.shape[0] > v // 4:
        return torch.topk(x, k).values
    return torch.topk(torch.from_numpy(cand), k).values


__all__ = ["top_values"]

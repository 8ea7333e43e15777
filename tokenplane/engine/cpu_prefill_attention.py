"""Causal prefill attention over the paged KV cache on CPU (float32, one thread): multi-token rows, flash-style.

Why a kernel of our own: PyTorch's CPU flash SDPA (the varlen path in attention.py) spent 92 ms a layer on a
2048-token SmolLM2-135M prefill (9 query heads / 3 KV heads, head_dim 64; torch.profiler, 1 thread) where vLLM's CPU
attention kernel spent 69 ms, and a sequence whose blocks are not consecutive first paid an index_select copy of its
whole K/V. Here K/V are read in place through the block table, and the `group` query heads of a KV head are one tile
of query rows, so each K/V tile is loaded once for all of them (enable_gqa SDPA walks each query head on its own).

Tiles: a query tile is TQ positions x G heads = R rows (row r = position r // G, head r % G), packed once, scaled, and
transposed to qt [D, R]; a key tile is TK keys read in place from the cache. Scores are kept transposed, s [TK, R],
so both products are vector loads along a contiguous axis times a broadcast scalar, with no transpose of K or V:
  s[j, r:r+24]  = sum_d K[j, d] (broadcast, from the cache) * qt[d, r:r+24]            (4 keys x 24 rows a pass)
  o[r, c:c+16] += sum_j s[j, r] (broadcast) * V[j, c:c+16] (from the cache)            (6 rows x 16 columns a pass)
and the online softmax's per-row max and sum run down the columns of s (vector max/add of whole rows of s); off the
diagonal the row max is taken while a score pass still holds its scores in registers, and exp and sum are one loop. Key
tiles above a query tile's last position are skipped (causal); on the tiles that cross the diagonal, the keys after
a row's position are masked to exp = 0 exactly. A chunk after cached context (q_len < context_len) is the same loop
with its positions offset by context_len - q_len.

Numerics: float32 throughout, fused multiply-adds; q is multiplied by the scale when packed (SDPA scales the product
instead), exp is cpu_decode_paging's exponent (at most 3 ulp; the scores' as vector operations at the pass width,
the same bits at both), the softmax is online (per key tile: new
row max, old sums and outputs rescaled by exp(old max - new max)), and the output is divided by the row sum at the
end, as in flash attention. Results differ from SDPA's in the last bits (other summation order); the differential
test (tests/test_cpu_prefill_attention.py) bounds the difference against float64.

Vector code: cpu_simd's <8 x float> llvmlite intrinsics (numba has no vector type), or on an AVX-512 host (head size a
multiple of 32) the same passes on <16 x float>: 48 rows a score pass and 32 columns a value pass, each lane's sum
over d or keys in the same order, so the two widths' outputs are equal bit for bit (tests/test_cpu_prefill_attention
.py). The passes live in cpu_prefill_passes.py; the scores' exponent and sum run a row block at a time as vector
operations, the other softmax loops are plain loops that LLVM vectorizes.

bfloat16 caches: on AMX hosts the tile kernel (cpu_prefill_attention_amx.py); elsewhere on AVX-512 the 16-lane passes
read the bf16 cache through widening loads (a bf16 is the top half of a float32, so the widening is exact; V once per
key tile), q is widened before packing, every sum is the float32 kernel's, and each output row is rounded to bf16
once: the result is the float32 kernel's on the widened values, rounded, bit for bit. Where the host has AVX512-BF16
(`PAIRS`), the score product instead runs on bf16 pairs (cpu_prefill_scores_bf16.py: exact products, float32 sums in
another order). Unlike SDPA's bf16 flash kernel it never rounds the probabilities to bf16 before the value product.
"""
from __future__ import annotations

from functools import cache

import numpy as np
import torch

from tokenplane.engine import cpu_prefill_attention_amx as amx
from tokenplane.engine import cpu_prefill_scores_bf16 as pairs
from tokenplane.engine.cpu_decode_paging import _exp_nonpos
from tokenplane.engine.cpu_elements import as_array
from tokenplane.engine.cpu_prefill_passes import (
    _exp_rows8,
    _exp_rows16,
    _exp_sum_rows8,
    _exp_sum_rows16,
    _scores1,
    _scores1w,
    _scores4,
    _scores4w,
    _values6,
    _values6w,
)
from tokenplane.engine.cpu_simd import (
    HOST_AVX512,
    HOST_AVX512_BF16,
    _fma16,
    _load16,
    _load16_kv,
    _splat16,
    _store16,
    _store16_bf16,
    _zero16,
)
from tokenplane.engine.numbacache import njit

TK = 64            # keys per tile
ROWS = 24          # query rows per score pass (three vectors) and a multiple of the 6 rows of a value pass; R is
                   # padded to a multiple of it
ROWS16 = 48        # the same on 16-float vectors (AVX-512 hosts)
# Whether `paged_prefill` runs the 16-lane passes (head sizes a multiple of 32 on an AVX-512 host; the same sums in
# the same order as the 8-lane ones, twice the lanes an instruction). A one-item list, so tests can run both.
WIDE = [HOST_AVX512]
# Whether bf16 caches without AMX take the score pass on bf16 pairs (cpu_prefill_scores_bf16: vdpbf16ps) instead of
# widening K to float32 for the FMA pass; a one-item list, so tests can run both.
PAIRS = [HOST_AVX512_BF16]
ROW_TARGET = 48    # query rows per tile (see query_tile)
NEG_INF = np.float32(-np.inf)


def query_tile(group: int) -> int:
    """Query positions per tile: R = TQ * group rows, about ROW_TARGET (a multiple of ROWS for groups 1-4, 6, 8, so
    no padded rows but in the last tile): enough rows to reuse each K/V tile, few enough that s, qt and o stay in L2."""
    return max(1, ROW_TARGET // group)


@cache
def _kernel(D: int, G: int, wide: bool = False, bf16: bool = False, bf16_pairs: bool = False):  # noqa: ANN202
    """The kernel for head size D (a multiple of 16; of 32 when wide) and GQA group G, compile-time constants (the
    tile loops unroll on them); wide: the 16-lane passes; bf16 (wide only): the caches and out hold bfloat16 bits
    (uint16), widened exactly as they are loaded, the sums in float32 as for a float32 cache, and each output row
    rounded to bfloat16 once; bf16_pairs (bf16 only): q is its bf16 bits as uint32 pairs [T, heads, D / 2] and the
    scores are cpu_prefill_scores_bf16's (vdpbf16ps), the value pass as for bf16. numba caches each variant on disk."""
    assert wide or not bf16
    assert bf16 or not bf16_pairs
    BF16 = bf16
    PAIRED = bf16_pairs
    HALF = D // 2
    TQ = query_tile(G)
    W_ROWS = ROWS16 if wide else ROWS
    CW = 32 if wide else 16         # output columns a value pass covers
    LW = 16 if wide else 8          # lanes a vector holds
    RP = -(-(TQ * G) // W_ROWS) * W_ROWS

    # error_model numpy: no zero-division checks in the loops (a row sum is >= 1: its max term is exp(0))
    @njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract", "nsz", "arcp"})
    def _prefill(q, kf, vf, kvh, slots, q_starts, q_lens, ctx_lens, block_tables, block_size, out, scale):  # noqa: ANN001
        """q [T, heads(+more), D] float32 (only the first kvh * G heads are read); kf/vf: a layer's K/V cache flat
        ([kvh, slots, D]); per sequence b: q rows q_starts[b] .. + q_lens[b], context ctx_lens[b] (its tokens
        included), blocks block_tables[b]; out [T, heads * D] flat."""
        d_dim = D
        n_cols = kvh * G * D
        qt = np.zeros(D * RP, dtype=np.float32)
        qpi = np.zeros(HALF * RP if PAIRED else 0, dtype=np.uint32)   # PAIRED: q's bf16 pairs, transposed [D / 2, RP]
        qp = qpi.view(np.float32)
        kw = kf.view(np.float32)                        # PAIRED: the K cache as bf16 pairs (one 32-bit word each)
        scv = np.full(16, scale, dtype=np.float32)
        s = np.empty(TK * RP, dtype=np.float32)
        o = np.empty(RP * D, dtype=np.float32)
        m = np.empty(RP, dtype=np.float32)
        mt = np.empty(RP, dtype=np.float32)
        lsum = np.empty(RP, dtype=np.float32)
        part = np.empty(RP, dtype=np.float32)
        alpha = np.empty(RP, dtype=np.float32)
        ofs = np.empty(TK, dtype=np.int64)
        # BF16: the key tile's V rows widened to float32 once, so the value passes (8 row groups a tile) read float32
        # instead of each widening the same elements (Zen 4, one tile: 96 -> 115 GFLOP/s; widening is exact, so the
        # sums are the same numbers in the same order)
        vw = np.empty(TK * D if BF16 else 0, dtype=np.float32)
        ofs_w = np.arange(TK if BF16 else 0) * D
        sc = np.float32(scale)
        for b in range(q_lens.shape[0]):
            n_q = q_lens[b]
            ctx = ctx_lens[b]
            first = ctx - n_q                  # absolute position of the chunk's first query
            row0 = q_starts[b]
            for h in range(kvh):
                head_base = h * slots
                for i0 in range(0, n_q, TQ):
                    nq = min(TQ, n_q - i0)
                    rv = nq * G
                    ru = -(-rv // W_ROWS) * W_ROWS     # rows computed: a short last tile (or chunk) skips the rest
                    if PAIRED:
                        for i in range(nq):
                            for g in range(G):
                                r = i * G + g
                                for d2 in range(HALF):
                                    qpi[d2 * RP + r] = q[row0 + i0 + i, h * G + g, d2]
                        for d2 in range(HALF):
                            for r in range(rv, RP):
                                qpi[d2 * RP + r] = 0
                    else:
                        for i in range(nq):
                            for g in range(G):
                                r = i * G + g
                                for d in range(D):
                                    qt[d * RP + r] = q[row0 + i0 + i, h * G + g, d] * sc
                        for d in range(D):
                            for r in range(rv, RP):
                                qt[d * RP + r] = 0.0
                    for r in range(RP):
                        m[r] = NEG_INF
                        lsum[r] = 0.0
                    for x in range(RP * D):
                        o[x] = 0.0
                    p0 = first + i0                # this tile's first and last query positions
                    n_keys = p0 + nq               # keys 0 .. last position
                    for j0 in range(0, n_keys, TK):
                        nk = min(TK, n_keys - j0)
                        # the tile's K/V rows: runs of consecutive slots, one per cache block
                        j = 0
                        while j < nk:
                            pos = j0 + j
                            blk = pos // block_size
                            within = pos - blk * block_size
                            base = (head_base + block_tables[b, blk] * block_size + within) * d_dim
                            run = min(block_size - within, nk - j)
                            for x in range(run):
                                ofs[j + x] = base + x * d_dim
                            j += run
                        # causal: key j0 + j is after the positions of rows r < (j0 + j - p0) * G; only tiles that
                        # cross the diagonal have such keys, and only they need a masked pass for the row max
                        diagonal = j0 + nk - 1 > p0
                        for r in range(ru):
                            mt[r] = m[r]
                        for rb in range(0, ru, W_ROWS):
                            j = 0
                            while j + 4 <= nk:
                                if PAIRED:
                                    pairs.scores4(kw, ofs[j] >> 1, ofs[j + 1] >> 1, ofs[j + 2] >> 1, ofs[j + 3] >> 1,
                                                  qp, rb, RP, HALF, s, j * RP, mt, not diagonal, _load16(scv, 0))
                                elif wide:
                                    _scores4w(kf, ofs[j], ofs[j + 1], ofs[j + 2], ofs[j + 3], qt, rb, RP, d_dim, s,
                                              j * RP, mt, not diagonal)
                                else:
                                    _scores4(kf, ofs[j], ofs[j + 1], ofs[j + 2], ofs[j + 3], qt, rb, RP, d_dim, s,
                                             j * RP, mt, not diagonal)
                                j += 4
                            while j < nk:
                                if PAIRED:
                                    pairs.scores1(kw, ofs[j] >> 1, qp, rb, RP, HALF, s, j * RP, mt, not diagonal,
                                                  _load16(scv, 0))
                                elif wide:
                                    _scores1w(kf, ofs[j], qt, rb, RP, d_dim, s, j * RP, mt, not diagonal)
                                else:
                                    _scores1(kf, ofs[j], qt, rb, RP, d_dim, s, j * RP, mt, not diagonal)
                                j += 1
                        if diagonal:
                            for j in range(nk):
                                cut = min(max((j0 + j - p0) * G, 0), rv)
                                for r in range(cut):
                                    s[j * RP + r] = NEG_INF
                            for j in range(nk):
                                for r in range(ru):
                                    mt[r] = max(mt[r], s[j * RP + r])
                        # key 0 is visible to every row and is in the first tile, so mt is finite from then on; the
                        # first tile's alpha (exp(-inf) -> e^-87) multiplies a zero sum and zero outputs
                        for r in range(ru):
                            alpha[r] = _exp_nonpos(m[r] - mt[r])
                            m[r] = mt[r]
                            part[r] = 0.0
                        if diagonal:
                            for rb in range(0, ru, LW):
                                if wide:
                                    _exp_rows16(s, RP, rb, nk, mt)
                                else:
                                    _exp_rows8(s, RP, rb, nk, mt)
                            for j in range(nk):
                                cut = min(max((j0 + j - p0) * G, 0), rv)
                                for r in range(cut):
                                    s[j * RP + r] = 0.0    # exactly zero, not the exp's e^-87 floor
                            for j in range(nk):
                                for r in range(ru):
                                    part[r] += s[j * RP + r]
                        else:
                            for rb in range(0, ru, LW):   # the exponents and their sums (cpu_prefill_passes)
                                if wide:
                                    _exp_sum_rows16(s, RP, rb, nk, mt, part)
                                else:
                                    _exp_sum_rows8(s, RP, rb, nk, mt, part)
                        for r in range(ru):
                            lsum[r] = lsum[r] * alpha[r] + part[r]
                        if BF16:
                            for j in range(nk):
                                for c in range(0, D, 16):
                                    _store16(vw, j * D + c, _load16_kv(vf, ofs[j] + c))
                        for r in range(0, ru, 6):
                            for c in range(0, D, CW):
                                if BF16:
                                    _values6w(vw, ofs_w, nk, s, RP, r, o, d_dim, c, alpha)
                                elif wide:
                                    _values6w(vf, ofs, nk, s, RP, r, o, d_dim, c, alpha)
                                else:
                                    _values6(vf, ofs, nk, s, RP, r, o, d_dim, c, alpha)
                    for i in range(nq):
                        for g in range(G):
                            r = i * G + g
                            inv = np.float32(1.0) / lsum[r]
                            base = (row0 + i0 + i) * n_cols + (h * G + g) * D
                            if BF16:
                                part[r] = inv         # this row's sum is spent: its slot feeds the splat
                                for d in range(0, D, 16):
                                    _store16_bf16(out, base + d, _fma16(_load16(o, r * D + d), _splat16(part, r),
                                                                        _zero16()))
                            else:
                                for d in range(D):
                                    out[base + d] = o[r * D + d] * inv
    return _prefill


MIN_ROWS = 12      # q_len x group below this: SDPA's kernel is as fast or faster (a score pass computes 24 rows)
AMX_MIN_ROWS = 384  # the same for bfloat16 on AMX tiles
BF16_MIN_ROWS = 25  # bfloat16 without AMX (16-lane passes only): Zen 4, 2048 cached tokens, 26 rows 0.95-0.97 of
                    # SDPA's time, 24 rows 1.08-1.11 (results/prefill_attention_bf16_zen4_chunks.md)
BF16_PAIRS_MIN_ROWS = 17  # the same with the score pass on bf16 pairs (PAIRS): Zen 4, 2048 cached tokens, 18 rows
                          # 0.75-0.86 of SDPA's time, 16 rows 0.95-1.01, 12 rows 1.04-1.07
                          # (results/prefill_attention_bf16_pairs_zen4.md)


def available(dtype: torch.dtype, device: torch.device, head_dim: int, group: int = 1, block_size: int = 16) -> bool:
    """float32 (head_dim a multiple of 16); bfloat16 (head_dim a multiple of 32) on AMX tiles
    (cpu_prefill_attention_amx) where the host and the shapes allow, else on the 16-lane passes (AVX-512 hosts)."""
    if device.type != "cpu":
        return False
    if dtype == torch.bfloat16:
        return amx.applies(head_dim, group, block_size) or (WIDE[0] and head_dim % 32 == 0)
    return dtype == torch.float32 and head_dim % 16 == 0


def worth(q_len: int, group: int, dtype: torch.dtype = torch.float32, head_dim: int = 32, block_size: int = 16
          ) -> bool:
    """Whether a row of q_len tokens is faster here than in SDPA's flash kernel. float32, measured at 2048 tokens of
    context (benchmarks/prefill_attention.py, one layer, kernel/SDPA CPU time): SmolLM2's 3 x 3 heads at q_len 2 / 4
    / 8: 0.98 / 0.80 / 0.58; tiny-large's 4 x 2 at 2 / 4 / 8: 1.26 / 1.06 / 0.73; whole prompts of 256 tokens and up
    0.57-0.8. bfloat16: the AMX kernel copies each KV head's V^T once per call, which a short chunk after a long
    context does not repay; rows of AMX_MIN_ROWS and up; the 16-lane passes, BF16_MIN_ROWS and up. head_dim and
    block_size pick between those two as `paged_prefill` does."""
    return q_len * group >= min_rows(dtype, group, head_dim, block_size)


def _bf16_kernel(head_dim: int, group: int, block_size: int) -> str:
    """Which kernel a bfloat16 prefill runs for these shapes on this host: "amx" (tiles), "pairs" (the score pass on
    bf16 pairs, where the host computes them right) or "fma" (the 16-lane passes on widened elements)."""
    if amx.applies(head_dim, group, block_size):
        return "amx"
    return "pairs" if PAIRS[0] and pairs.works() else "fma"


def min_rows(dtype: torch.dtype, group: int = 1, head_dim: int = 32, block_size: int = 16) -> int:
    """The fewest query rows (q_len x group) `worth` sends here: for bfloat16, that of the kernel `paged_prefill` runs
    for these shapes."""
    if dtype == torch.bfloat16:
        return {"amx": AMX_MIN_ROWS, "pairs": BF16_PAIRS_MIN_ROWS, "fma": BF16_MIN_ROWS}[
            _bf16_kernel(head_dim, group, block_size)]
    return MIN_ROWS


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_starts: np.ndarray,
                  q_lens: np.ndarray, context_lens: np.ndarray, block_tables: np.ndarray, out: torch.Tensor,
                  block_size: int, group: int, scale: float) -> None:
    """Writes out[q_starts[b] + i] = causal attention of q[q_starts[b] + i] (absolute position
    context_lens[b] - q_lens[b] + i) over keys 0 .. that position of sequence b, for every b and i. CPU float32
    (bfloat16: cpu_prefill_attention_amx where it applies, else the 16-lane passes on the bf16 cache);
    q [T, >= kvh * group, d], k/v_cache [kvh, slots, d] contiguous (d a multiple of 16), out [T, heads * d];
    block_tables [B, >= blocks] int64, entries past a sequence's context never read."""
    kvh, slots, d = (int(x) for x in k_cache.shape)
    assert out.is_contiguous()
    if q.dtype == torch.bfloat16:
        kc, vc = as_array(k_cache).reshape(-1), as_array(v_cache).reshape(-1)
        which = _bf16_kernel(d, int(group), block_size)
        if which == "amx":
            amx.kernel(d, int(group))(as_array(q).view(np.uint32), kc, vc, kvh, slots, q_starts, q_lens,
                                      context_lens, block_tables, block_size, as_array(out), scale)
        elif which == "pairs":
            _kernel(d, int(group), True, True, True)(as_array(q).view(np.uint32), kc, vc, kvh, slots, q_starts,
                                                     q_lens, context_lens, block_tables, block_size,
                                                     as_array(out).reshape(-1), scale)
        else:
            _kernel(d, int(group), True, True)(q[:, :kvh * group].float().numpy(), kc, vc, kvh, slots, q_starts,
                                               q_lens, context_lens, block_tables, block_size,
                                               as_array(out).reshape(-1), scale)
        return
    # 16 lanes pay once a tile holds more rows than one 8-lane pass (24): below, their 48-row pass computes twice
    # the padding (routing's catch-up chunks of 6-12 tokens at group 2: 1.2-1.3x slower than 8 lanes)
    wide = WIDE[0] and d % 32 == 0 and int(q_lens.max(initial=0)) * group > ROWS
    kernel = _kernel(d, int(group), wide)
    kernel(q.numpy(), k_cache.numpy().reshape(-1), v_cache.numpy().reshape(-1), kvh, slots, q_starts, q_lens,
           context_lens, block_tables, block_size, out.numpy().reshape(-1), scale)

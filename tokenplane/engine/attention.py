"""Attention over a paged KV cache.

Cache layout per layer: [num_kv_heads, num_slots, head_dim] with slot = block_id * block_size + offset, so one
sequence's keys gathered by block are already [kv_heads, context, head_dim] for SDPA (no transpose copy), and a
sequence whose blocks are consecutive (the common case: blocks come off the free list in order) is a plain slice.

Kernels, chosen per batch by the runner:
- cpu (the CPU fp32/fp64 default): every one-token row of the batch in one compiled call per layer that reads K/V in
  place through the block tables (cpu_decode_attention.py); rows with several tokens take the varlen path below,
  unless the runner hands them to
- cpu prefill (CPU fp32, 1 thread): every multi-token row of the batch in one compiled call per layer, causal,
  flash-style over query x key tiles, K/V read in place (cpu_prefill_attention.py). One layer, SmolLM2's 9/3 heads,
  2048 tokens: 76 vs 104 ms for SDPA's flash kernel (0.73x; 256 tokens 0.56x; benchmarks/results/prefill_attention.md);
  a whole 2048-token SmolLM2 prefill step 0.94x. Rows of few tokens (q_len x group < 12) stay with varlen. bfloat16
  on AMX hosts: the same call on tiles (cpu_prefill_attention_amx.py; 2048 tokens ~0.7x of SDPA's time) for rows of
  q_len x group >= 384; on other AVX-512 hosts the 16-lane passes on the bf16 cache (widening loads, float32 sums;
  Zen 4, 2048 tokens 0.71x of SDPA's bf16 time, 256 tokens 0.49x) for rows of q_len x group >= 25.
- varlen: one SDPA call per sequence over its uncomputed tokens (prefill, decode, a peer's k tokens: same code), with
  4-D inputs so CPU runs PyTorch's flash kernel. A decode folds the query heads of a KV head into its query rows (GQA
  never copies K/V per query head); several tokens use enable_gqa, causal without a mask when they are the whole
  context. Consecutive blocks are a slice; others are gathered per sequence.
- padded: decode-only, every sequence gathered into [B, kv_heads, max_blocks * block_size, head_dim] with a length
  mask. Fixed shapes, so it can be captured in a CUDA graph (the CUDA default).

Why not one padded call for the whole batch on CPU: measured here (1 thread, fp32, kv_heads 4, group 2, 16-token
blocks), gathering every sequence's K/V into a padded batch costs more than the calls it saves: decode of 16 x 300
tokens 2.2 ms vs 2.0 ms per layer, 64 x 300: 30 ms vs 9 ms, 16 x 2100: 57 ms vs 15 ms. One index_select of all
sequences' blocks per layer was worse still (44 ms a layer at 64 x 320 tokens, tiny-large).

Why the cpu kernel for decode: decode grows block tables one block at a time, interleaved across sequences, so varlen
gathers every sequence's whole K/V each layer. Reading in place instead, one call per layer (1 thread, fp32, blocks
scattered at random, per layer, kv_heads 3 / group 3): 16 x 300 tokens 0.54 ms vs 1.38 ms gathered (0.91 ms had the
blocks been consecutive), 64 x 300: 4.4 vs 7.2 ms, 4 x 2100: 1.06 vs 1.96 ms. Not everywhere: at 64 x 2100 the
kernel (44 ms) beats the gather (49 ms) but not a consecutive slice through SDPA's flash kernel (26 ms), whose
contiguous reads stream faster than 4 KiB blocks scattered over the cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenplane.engine.cpu_decode_attention import paged_decode
from tokenplane.engine.cpu_prefill_attention import paged_prefill


@dataclass
class SeqAttention:
    q_start: int
    q_len: int
    context_len: int                       # tokens attended to, including this run's own tokens
    kv_slice_start: int | None = None      # first slot when the blocks are consecutive
    kv_blocks: torch.Tensor | None = None  # block ids otherwise
    mask: torch.Tensor | None = None       # [q_len, context_len] bool, only when 1 < q_len < context_len


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                      # [T] slot for each new token's K/V
    seqs: list[SeqAttention] = field(default_factory=list)
    # padded decode only
    block_tables: torch.Tensor | None = None        # [B, max_blocks]
    context_lens: torch.Tensor | None = None        # [B]
    # cpu kernel only: the one-token rows, in the compiled kernel's arrays (int64 numpy, built once per step)
    decode_rows: np.ndarray | None = None           # [D] row of q / out
    decode_block_tables: np.ndarray | None = None   # [D, max_blocks]
    decode_context_lens: np.ndarray | None = None   # [D]
    # cpu prefill kernel only: the multi-token rows (q rows q_start .. + q_len, causal over context_len tokens)
    prefill_q_starts: np.ndarray | None = None      # [P]
    prefill_q_lens: np.ndarray | None = None        # [P]
    prefill_context_lens: np.ndarray | None = None  # [P]
    prefill_block_tables: np.ndarray | None = None  # [P, max_blocks]

    @property
    def padded(self) -> bool:
        return self.block_tables is not None


def causal_mask(q_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Query i (absolute position context_len - q_len + i) sees keys 0..that position."""
    rows = torch.arange(context_len - q_len, context_len, device=device)[:, None]
    return torch.arange(context_len, device=device)[None, :] <= rows


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5
        # Set by the ModelRunner; plain attributes, not buffers, so state_dict() stays the weights only.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.block_size = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] (rope applied) -> [T, heads * d]."""
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache is None or v_cache is None:
            raise RuntimeError("KV cache not set: build a ModelRunner around the model first")
        # Write first, then read: a sequence's own new tokens are attended through the cache like cached ones.
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The read half of `forward`, for callers that wrote this step's K/V into the cache themselves
        (cpu_qkv_rope): q [T, heads, d] -> [T, heads * d]."""
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache is None or v_cache is None:
            raise RuntimeError("KV cache not set: build a ModelRunner around the model first")
        if meta.padded:
            return self._padded_decode(q, meta)
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        kvh, g, d = self.num_kv_heads, self.group, self.head_dim
        if meta.decode_rows is not None:
            paged_decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, meta.decode_rows,
                         out, self.block_size, g, self.scale)
        if meta.prefill_q_starts is not None:
            paged_prefill(q, k_cache, v_cache, meta.prefill_q_starts, meta.prefill_q_lens, meta.prefill_context_lens,
                          meta.prefill_block_tables, out, self.block_size, g, self.scale)
        for s in meta.seqs:
            if s.kv_slice_start is not None:
                kc = k_cache[:, s.kv_slice_start:s.kv_slice_start + s.context_len]
                vc = v_cache[:, s.kv_slice_start:s.kv_slice_start + s.context_len]
            else:
                kc = k_cache.unflatten(1, (-1, self.block_size)).index_select(1, s.kv_blocks).flatten(1, 2)
                vc = v_cache.unflatten(1, (-1, self.block_size)).index_select(1, s.kv_blocks).flatten(1, 2)
                kc, vc = kc[:, :s.context_len], vc[:, :s.context_len]
            # 4-D inputs throughout: PyTorch's CPU flash kernel takes only 4-D ones; 3-D ones fall to the 'math'
            # kernel (1.4-1.8x slower here).
            qi = q[s.q_start:s.q_start + s.q_len]  # [L, heads, d]; head h reads kv head h // group
            if s.q_len == 1:
                # decode: [1, kvh, g, d], the g query heads of a KV head as its g query rows (no K/V copy per head)
                o = F.scaled_dot_product_attention(qi.view(1, kvh, g, d), kc[None], vc[None], scale=self.scale)
                out[s.q_start] = o.reshape(-1)
                continue
            # several tokens: enable_gqa, and no mask at all when they are the whole context (flash then skips the
            # blocks above the diagonal: 2048-token prefill 2.4x faster than a [g * L, L] mask, measured here)
            o = F.scaled_dot_product_attention(qi.transpose(0, 1)[None], kc[None], vc[None], attn_mask=s.mask,
                                               is_causal=s.mask is None, scale=self.scale, enable_gqa=True)
            out[s.q_start:s.q_start + s.q_len] = o[0].transpose(0, 1).reshape(s.q_len, -1)
        return out

    def _padded_decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        bt, lens = meta.block_tables, meta.context_lens
        B, nblk = bt.shape
        kvh, g, d = self.num_kv_heads, self.group, self.head_dim
        # [kvh, blocks, bs, d][:, bt] -> [kvh, B, nblk, bs, d] -> [B, kvh, nblk * bs, d]
        kc = self.k_cache.unflatten(1, (-1, self.block_size))[:, bt].flatten(2, 3).transpose(0, 1)
        vc = self.v_cache.unflatten(1, (-1, self.block_size))[:, bt].flatten(2, 3).transpose(0, 1)
        mask = torch.arange(nblk * self.block_size, device=q.device)[None, :] < lens[:, None]
        o = F.scaled_dot_product_attention(q.view(B, kvh, g, d), kc, vc, attn_mask=mask[:, None, None, :],
                                           scale=self.scale)
        return o.reshape(B, kvh * g * d)

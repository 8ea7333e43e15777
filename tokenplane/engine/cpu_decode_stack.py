"""The decoder stack of a decode step on CPU (float32 at 1-16 one-token rows, bfloat16 at 1-8; 1 thread) as compiled
kernels over numpy views, with no torch op between them.

Why: at one row a layer's arithmetic is a few microseconds beside its weight stream, and the rest of its time is
dispatch. The torch path (models/qwen3.py's fused-norm loop) runs the same compiled kernels (cpu_small_gemm,
cpu_fused_norm, cpu_qkv_rope, cpu_decode_attention) but wraps each in tensor-to-array conversions, output tensors,
views and slices, ~2-4 us apiece here: ~100-200 us a layer, several ms a step for a 30-layer model. Here the weights'
and caches' arrays are taken once (`DecodeStack`, rebuilt when the runner rebinds a cache or the weights are packed
again) and each kernel is called on arrays directly.

Numerics: the same kernels in the same order as the torch path (float32's SwiGLU activation too: cpu_silu_mul, which
the model path runs on one thread), so the same values; on more threads the model path takes PyTorch's silu, a few
ulp apart. bfloat16 runs exactly the torch path's kernels
(cpu_bf16_gemv's panels for the linears and the SwiGLU, cpu_qkv_rope's kernel for the dtype, the bf16 attention
kernel), so its values are the torch path's bit for bit; there the saving is the torch path's ~7 wrapped calls a
layer (SmolLM2-135M bf16, one-row decode step timed in the engine: 24.7 -> 18.5-19.3 ms at 256 tokens of context).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenplane.engine import cpu_bf16_gemv, cpu_decode_attention, cpu_qkv_rope, cpu_small_gemm
from tokenplane.engine.attention import AttentionMetadata
from tokenplane.engine.cpu_decode_attention import kernel_for as decode_kernel
from tokenplane.engine.cpu_elements import as_array
from tokenplane.engine.cpu_fused_norm import _add_rms_norm
from tokenplane.engine.cpu_qkv_rope import _qkv_rope
from tokenplane.engine.cpu_silu_mul import silu_mul_flat

_F32_EMPTY = np.empty(0, np.float32)
# Rows the compiled stack takes (its tests cover 1-16); larger decode batches run the torch path, whose GEMMs are the
# same cpu_small_gemm kernel up to cpu_small_gemm.MAX_ROWS.
MAX_ROWS = 16


@dataclass
class _Linear:
    panels: np.ndarray        # flat panel copy (cpu_small_gemm.pack; bfloat16: cpu_bf16_gemv's)
    n_panels: int
    k: int
    n: int                    # out_features
    bias: np.ndarray | None   # float32 (bfloat16: cpu_bf16_gemv.bias_array, empty for none)
    kb: int                   # cpu_small_gemm.k_block(k)
    amx: bool = False         # bfloat16: AMX panels (cpu_bf16_gemv.panel_shape)


def _linear_of(m: nn.Module, bf16: bool) -> _Linear:
    if bf16:
        bp = m.cpu_bf16_panels
        panels, k, amx = cpu_bf16_gemv.panel_shape(bp)
        return _Linear(bp.reshape(-1), panels, k, int(m.out_features), cpu_bf16_gemv.bias_array(m.bias), 0, amx)
    p = m.cpu_panels
    return _Linear(p.numpy().reshape(-1), int(p.shape[0]), int(p.shape[1]), int(m.out_features),
                   None if m.bias is None else m.bias.detach().numpy(), cpu_small_gemm.k_block(int(p.shape[1])))


def _matmul(x: np.ndarray, lin: _Linear) -> np.ndarray:
    rows = x.shape[0]
    if x.dtype == np.uint16:
        out = np.empty((rows, lin.n), np.uint16)
        cpu_bf16_gemv.io_kernels(lin.amx)[0](x.reshape(-1), rows, lin.k, lin.panels, lin.n_panels, lin.bias,
                                             out.reshape(-1), lin.n)
        return out
    width = lin.n_panels * cpu_small_gemm.PANEL
    if lin.bias is None:
        out = np.empty((rows, width), np.float32)
    else:   # cpu_small_gemm's (F.linear's) order: the bias first
        out = np.zeros((rows, width), np.float32)
        out[:, :lin.n] = lin.bias
    cpu_small_gemm.kernel()(x.reshape(-1), rows, lin.k, lin.panels, lin.n_panels, out.reshape(-1), width, lin.kb,
                            lin.bias is not None)
    if width != lin.n:
        out = np.ascontiguousarray(out[:, :lin.n])
    return out


@dataclass
class _Layer:
    qkv: _Linear
    o: _Linear
    gate_up: _Linear
    down: _Linear
    in_norm: np.ndarray
    in_eps: float
    post_norm: np.ndarray
    post_eps: float
    q_norm: np.ndarray
    k_norm: np.ndarray
    qk_eps: float
    k_cache: np.ndarray
    v_cache: np.ndarray


class DecodeStack:
    """Arrays of one DecoderModel's packed weights and bound caches, and the step over them."""

    def __init__(self, model: nn.Module) -> None:
        self.dtype = model.embed_tokens.weight.dtype
        self.bf16 = bf16 = self.dtype == torch.bfloat16
        self.max_rows = min(cpu_bf16_gemv.MAX_ROWS, MAX_ROWS) if bf16 else MAX_ROWS
        self.embed = as_array(model.embed_tokens.weight.detach())
        self.final_norm = as_array(model.norm.weight.detach())
        self.final_eps = float(model.norm.eps)
        attn0 = model.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        self.group = self.heads // self.kv_heads
        self.scale = attn0.attn.scale
        self.block_size = attn0.attn.block_size
        self.ffn = model.layers[0].mlp.ffn
        self.layers = []
        for layer in model.layers:
            sa = layer.self_attn
            qk = sa.qk_norm
            self.layers.append(_Layer(
                qkv=_linear_of(sa.qkv_proj, bf16), o=_linear_of(sa.o_proj, bf16),
                gate_up=_linear_of(layer.mlp.gate_up_proj, bf16), down=_linear_of(layer.mlp.down_proj, bf16),
                in_norm=as_array(layer.input_layernorm.weight.detach()), in_eps=float(layer.input_layernorm.eps),
                post_norm=as_array(layer.post_attention_layernorm.weight.detach()),
                post_eps=float(layer.post_attention_layernorm.eps),
                q_norm=as_array(sa.q_norm.weight.detach()) if qk else np.empty(0, self.embed.dtype),
                k_norm=as_array(sa.k_norm.weight.detach()) if qk else np.empty(0, self.embed.dtype),
                qk_eps=float(sa.q_norm.eps) if qk else 0.0,
                k_cache=as_array(sa.attn.k_cache), v_cache=as_array(sa.attn.v_cache)))
        self.qk_norm = bool(attn0.qk_norm)
        self.rotary = model.rotary
        self._rope_len = 0
        self._cos = self._sin = _F32_EMPTY
        # float32 keeps the scalar rope kernel it was built on; bfloat16 takes what the torch path takes
        self.qkv_rope = cpu_qkv_rope.kernel_for(self.dtype, self.head_dim) if bf16 else _qkv_rope
        self._buf = np.empty(self.head_dim, np.float32)   # _qkv_rope's per-head scratch

    def _rope_rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos / signed sin [T, head_dim] at these positions, rows of a table the model's RotaryEmbedding computed
        once for positions 0..n-1 (grown by doubling), instead of its ~10 torch ops a step."""
        top = int(positions.max())
        if top >= self._rope_len:
            n = max(256, 2 * self._rope_len, top + 1)
            cos, sin = self.rotary(torch.arange(n), self.dtype)
            self._cos, self._sin = as_array(cos.reshape(n, -1)), as_array(sin.reshape(n, -1))
            self._rope_len = n
        return self._cos[positions], self._sin[positions]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of a decode-only step (`applies`)."""
        T = input_ids.shape[0]
        d = self.head_dim
        x = self.embed[input_ids.numpy()]   # fancy indexing: a fresh [T, hidden] copy
        cos_a, sin_a = self._rope_rows(positions.numpy())
        slots = meta.slot_mapping.numpy()
        h = np.empty_like(x)
        first = self.layers[0]
        _add_rms_norm(x, x, first.in_norm, first.in_eps, h, False)
        ffn = self.ffn
        n = len(self.layers)
        bf16 = self.bf16
        dt = x.dtype
        attention = decode_kernel(self.dtype, d, self.group, self.block_size, cpu_decode_attention.BF16_FORM[0])
        for i, L in enumerate(self.layers):
            qkv = _matmul(h, L.qkv)
            q = np.empty((T, self.heads, d), dt)
            self.qkv_rope(qkv, self.heads, self.kv_heads, d, L.q_norm, L.k_norm, L.qk_eps, self.qk_norm, cos_a,
                          sin_a, L.k_cache, L.v_cache, slots, q, self._buf)
            o = np.empty((T, self.heads * d), dt)
            attention(q, L.k_cache, L.v_cache, meta.decode_block_tables, meta.decode_context_lens,
                      meta.decode_rows, o, self.block_size, self.scale, True, _F32_EMPTY)
            a = _matmul(o, L.o)
            _add_rms_norm(a, x, L.post_norm, L.post_eps, h, True)
            act = np.empty((T, ffn), dt)
            gu = L.gate_up
            if bf16:
                cpu_bf16_gemv.io_kernels(gu.amx)[1](h.reshape(-1), T, gu.k, gu.panels, gu.n_panels, gu.bias,
                                                    act.reshape(-1), ffn)
            else:
                silu_mul_flat(_matmul(h, gu).reshape(-1), T, 2 * ffn, ffn, act.reshape(-1))
            m = _matmul(act, L.down)
            if i + 1 < n:
                nxt = self.layers[i + 1]
                _add_rms_norm(m, a, nxt.in_norm, nxt.in_eps, h, True)
            else:
                _add_rms_norm(m, a, self.final_norm, self.final_eps, h, True)
            x = m
        if bf16:
            return torch.from_numpy(h.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(h)


def _packed(model: nn.Module) -> bool:
    """Every linear panel-packed (float32: cpu_small_gemm's copy; bfloat16: cpu_bf16_gemv's) and every cache bound,
    all of the embedding's dtype."""
    dtype = model.embed_tokens.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16) or model.norm.weight.dtype != dtype:
        return False
    panels = "cpu_panels" if dtype == torch.float32 else "cpu_bf16_panels"
    for layer in model.layers:
        sa, mlp = layer.self_attn, layer.mlp
        if (any(getattr(m, panels) is None for m in (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj))
                or sa.attn.k_cache is None or sa.attn.v_cache is None or sa.attn.k_cache.dtype != dtype):
            return False
    return True


def stack_for(model: nn.Module) -> DecodeStack | None:
    """The model's DecodeStack, built on first use after `invalidate` (None where its linears are not all
    panel-packed or a cache is unbound). Its `max_rows` is the most rows it takes."""
    st = model.__dict__.get("_decode_stack")
    if st is None:
        st = DecodeStack(model) if _packed(model) else False
        model.__dict__["_decode_stack"] = st
    return st or None


def invalidate(model: nn.Module) -> None:
    """Drop the arrays taken of the model's weights and caches: call after packing the weights again or binding
    other caches (Qwen3ForCausalLM.pack_cpu / unpack_cpu do; the ModelRunner binds its caches before packing)."""
    model.__dict__["_decode_stack"] = None


def applies(input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
    """A CPU decode-only step (every row one token, cpu decode kernel) of 1..MAX_ROWS rows on 1 thread; the model's
    side is `stack_for`."""
    T = input_ids.shape[0]
    return (0 < T <= MAX_ROWS and input_ids.device.type == "cpu" and torch.get_num_threads() == 1
            and meta.decode_rows is not None and len(meta.decode_rows) == T and not meta.seqs
            and meta.prefill_q_starts is None and not meta.padded)

"""Llama decoder (LlamaForCausalLM): the Qwen3 stack without q_norm/k_norm, with optional attention/MLP biases and
llama3 rope scaling (both come from ModelConfig). A flag on the same code path, not a fork."""
from __future__ import annotations

from tokenplane.engine.models.qwen3 import Qwen3ForCausalLM


class LlamaForCausalLM(Qwen3ForCausalLM):
    qk_norm = False

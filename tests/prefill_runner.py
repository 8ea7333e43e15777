"""A model's prompt through a ModelRunner as a 290-token prefill and a 10-token chunk over it, for the prefill-kernel
tests (AMX tiles and 16-lane passes): the logits of both steps, and every paged_prefill call recorded."""
from __future__ import annotations

from typing import Any

import torch

from tokenplane.engine import attention as attention_module

PROMPT = [(11 * i + 3) % 500 for i in range(300)]


def chunked_logits(dtype: torch.dtype, kernel: str, monkeypatch: Any = None,
                   calls: list | None = None) -> tuple[Any, Any, torch.Tensor]:
    """(config, runner, logits of both steps in float64) of test-small with head_dim 32, bf16 weights run in `dtype`;
    given `calls` (and monkeypatch), each paged_prefill call's (q_lens, context_lens) is appended to it."""
    from tokenplane.engine.config import PRESETS
    from tokenplane.engine.loader import load_model
    from tokenplane.engine.model_runner import ModelRunner
    from tokenplane.engine.sequence import Sequence

    if calls is not None:
        real = attention_module.paged_prefill

        def counting(q, k_cache, v_cache, q_starts, q_lens, context_lens, *args):  # noqa: ANN001, ANN002
            calls.append((q_lens.tolist(), context_lens.tolist()))
            real(q, k_cache, v_cache, q_starts, q_lens, context_lens, *args)

        monkeypatch.setattr(attention_module, "paged_prefill", counting)
    cfg, model = load_model(dict(PRESETS["test-small"], head_dim=32), dtype=torch.bfloat16, seed=5)
    runner = ModelRunner(model.to(dtype), cfg, num_blocks=64, block_size=16, prefill_kernel=kernel)
    s = Sequence("a", PROMPT)
    assert runner.prepare(s)
    first = runner.run([s], num_new_tokens=[290]).logits
    second = runner.run([s]).logits     # the last 10 tokens over 290 cached ones
    return cfg, runner, torch.cat([first, second]).double()

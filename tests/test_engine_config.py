"""ModelConfig parsing (transformers 4.x and 5.x config.json dialects), presets, loud errors."""
from __future__ import annotations

import pytest

from tokenplane.engine.config import PRESETS, ModelConfig

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 96}


def test_v4_and_v5_rope_dialects_agree():
    v4 = ModelConfig.from_hf({**BASE, "rope_theta": 500000.0,
                              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    v5 = ModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                                          "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 8192}})
    assert v4 == v5 and v4.rope_theta == 500000.0 and v4.rope_scaling["factor"] == 8.0
    assert v4.head_dim == 16 and v4.num_key_value_heads == 4  # derived defaults
    assert ModelConfig.from_hf(v4.to_hf()) == v4


def test_default_rope_and_model_type_fallback():
    cfg = ModelConfig.from_hf({**{k: v for k, v in BASE.items() if k != "architectures"}, "model_type": "qwen3",
                               "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert cfg.architecture == "qwen3" and cfg.rope_scaling is None and cfg.rope_theta == 1e6


@pytest.mark.parametrize("bad", [{"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
                                 {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                                 {"hidden_act": "gelu"}, {"use_sliding_window": True}])
def test_unsupported_configs_raise(bad):
    with pytest.raises(ValueError):
        ModelConfig.from_hf({**BASE, **bad})


def test_presets_have_the_advertised_shapes():
    cfgs = {k: ModelConfig.from_hf(v) for k, v in PRESETS.items()}
    small, large = cfgs["tiny-small"], cfgs["tiny-large"]
    assert (small.hidden_size, small.num_hidden_layers, small.num_attention_heads, small.num_key_value_heads,
            small.head_dim, small.intermediate_size, small.vocab_size) == (256, 4, 4, 2, 64, 768, 151936)
    assert (large.hidden_size, large.num_hidden_layers, large.num_attention_heads, large.num_key_value_heads,
            large.head_dim, large.intermediate_size, large.vocab_size) == (512, 8, 8, 4, 64, 1536, 151936)
    assert cfgs["test-small"].vocab_size == cfgs["test-large"].vocab_size == 512
    assert 0.55e9 < cfgs["qwen3-0.6b"].num_params < 0.65e9 and cfgs["qwen3-0.6b"].tie_word_embeddings
    assert 8.0e9 < cfgs["qwen3-8b"].num_params < 8.4e9
    assert cfgs["test-llama"].architecture == "llama" and cfgs["test-llama"].rope_scaling["rope_type"] == "llama3"

"""Model engine: paged-KV Qwen3/Llama runner with prefix caching, counter-based sampling and a small LLMEngine."""
from tokenplane.engine.block_manager import BlockManager
from tokenplane.engine.config import PRESETS, ModelConfig
from tokenplane.engine.loader import load_model, save_pretrained_like
from tokenplane.engine.model_runner import ModelRunner, RunnerOutput
from tokenplane.engine.sampler import SamplingParams, sample
from tokenplane.engine.sequence import Sequence, SequenceStatus

__all__ = ["PRESETS", "BlockManager", "LLMEngine", "ModelConfig", "ModelRunner", "RunnerOutput", "SamplingParams",
           "Sequence", "SequenceStatus", "load_model", "sample", "save_pretrained_like"]


def __getattr__(name: str):
    if name == "LLMEngine":
        from tokenplane.engine.engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)

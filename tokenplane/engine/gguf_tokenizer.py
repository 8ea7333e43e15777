"""tokenizer.json and tokenizer_config.json built from a GGUF's tokenizer metadata (HF `tokenizers` format).

Supported: `tokenizer.ggml.model == "gpt2"` (byte-level BPE) with the pre-tokenizers llama.cpp calls `smollm` (every
digit on its own, then the GPT-2 byte-level pattern) and `gpt-2`/`default` (the GPT-2 pattern alone). The files are
written by hand from the metadata, not by `tokenizers.Tokenizer.to_str()`, so their bytes (and pinned hashes) do not
depend on the installed `tokenizers` version. Control tokens (token_type 3) and user-defined ones (4) become added
tokens, special and not special respectively. Anything else returns None with the reason: the weights still convert,
and a caller that needs the tokenizer sees why it is absent (transformers' own GGUF loader does not know `smollm` and
silently drops the digit split, so 'x  1' tokenizes differently there).
"""
from __future__ import annotations

from typing import Any

_GPT2_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                     _GPT2_BYTE_LEVEL]},
    "gpt-2": _GPT2_BYTE_LEVEL,
    "default": _GPT2_BYTE_LEVEL,
}
CONTROL, USER_DEFINED = 3, 4


def tokenizer_files(field) -> tuple[dict[str, Any], dict[str, Any]] | str:
    """`field(key, default)` reads GGUF metadata -> (tokenizer.json, tokenizer_config.json) dicts, or why not."""
    model, pre = field("tokenizer.ggml.model"), field("tokenizer.ggml.pre", "default")
    if model is None:
        return "the GGUF has no tokenizer metadata"
    if model != "gpt2" or pre not in PRE_TOKENIZERS:
        return f"unsupported GGUF tokenizer (model {model!r}, pre-tokenizer {pre!r}); supported: gpt2 with " \
               f"{sorted(PRE_TOKENIZERS)}"
    tokens, merges = list(field("tokenizer.ggml.tokens")), list(field("tokenizer.ggml.merges", []))
    types = list(field("tokenizer.ggml.token_type", [1] * len(tokens)))
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": ty == CONTROL}
             for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, USER_DEFINED)]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre], "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": [m.split(" ", 1) for m in merges]},
    }

    def token(key: str) -> str | None:
        i = field(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(field("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(field("tokenizer.ggml.add_eos_token", False)), "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(field(f"{field('general.architecture')}.context_length", 0)) or None,
    }
    for key in ("bos", "eos", "unknown", "padding"):
        if (t := token(key)) is not None:
            config[{"unknown": "unk", "padding": "pad"}.get(key, key) + "_token"] = t
    if (template := field("tokenizer.chat_template")) is not None:
        config["chat_template"] = template
    return tokenizer, config

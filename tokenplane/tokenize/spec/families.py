"""Tokenizer families: the frozen configuration every fast path and every boundary proof is parameterized by.

A family names the splitter (regex alternatives, in the reference engine's own dialect), the normalizer, the BPE
flavour and the reference engine. `splitter_hash` pins the configuration a derivation in docs/ was made for: if any
field changes, the hash changes and the derivation no longer applies.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property

ENDOFTEXT = "<|endoftext|>"

CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|"""
    r"""\s+(?!\S)|\s"""
)
# The same language in Oniguruma's dialect (HF tokenizers): `{1,3}+` is not possessive there and `$` means end of
# line, so the digit group becomes an atomic group and `$` becomes `\z`. Used only as the piece-level reference.
CL100K_PATTERN_ONIG = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|(?>\p{N}{1,3})| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++\z|"""
    r"""\s*[\r\n]|\s+(?!\S)|\s"""
)
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
    r"""\s+(?!\S)|\s+"""
)
QWEN3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501
)
# DeepSeek applies three Split pre-tokenizers in sequence; each re-splits every piece of the previous stage.
DEEPSEEK_PATTERNS = (
    r"""\p{N}{1,3}""",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+"
    "[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)
# SmolLM2 (HF): Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)]. The first
# stage is HF's Digits pre-tokenizer, not a regex (it splits on Rust's `char::is_numeric`, probed in
# charclass.numeric_table); the second is the GPT-2 pattern ByteLevel applies to each piece of the first.
DIGITS_INDIVIDUAL = "Digits(individual_digits=True)"
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _llama3_specials() -> dict[str, int]:
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
             "<|eot_id|>", "<|python_tag|>", "<|image|>"]
    names = named + [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(named))]
    return {name: 128000 + i for i, name in enumerate(names)}


@dataclass(frozen=True)
class Family:
    name: str
    engine: str                       # "tiktoken" or "hf"
    patterns: tuple[str, ...]         # splitter chain in the reference engine's dialect
    onig_patterns: tuple[str, ...]    # the same chain for HF's Split (piece-level reference); empty: the chain is
                                      # not all Splits, the reference uses the tokenizer.json's own pre-tokenizer
    normalizer: str | None = None     # "nfc" or None
    ignore_merges: bool = False       # whole piece in vocab -> one ID (tiktoken always does this)
    specials: dict[str, int] = field(default_factory=dict)  # filled from tokenizer.json for HF families

    @cached_property     # checked on every fast-path encode: computing it costs ~13 us, a quarter of a 1K encode
    def splitter_hash(self) -> str:
        blob = json.dumps([self.name, self.patterns, self.normalizer, self.ignore_merges], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()


FAMILIES: dict[str, Family] = {
    "cl100k_base": Family("cl100k_base", "tiktoken", (CL100K_PATTERN,), (CL100K_PATTERN_ONIG,), ignore_merges=True,
                          specials={ENDOFTEXT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                                    "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}),
    "o200k_base": Family("o200k_base", "tiktoken", (O200K_PATTERN,), (O200K_PATTERN,), ignore_merges=True,
                         specials={ENDOFTEXT: 199999, "<|endofprompt|>": 200018}),
    "llama3": Family("llama3", "tiktoken", (LLAMA3_PATTERN,), (LLAMA3_PATTERN,), ignore_merges=True,
                     specials=_llama3_specials()),
    "qwen3": Family("qwen3", "hf", (QWEN3_PATTERN,), (QWEN3_PATTERN,), normalizer="nfc"),
    "deepseek_v4": Family("deepseek_v4", "hf", DEEPSEEK_PATTERNS, DEEPSEEK_PATTERNS),
    "smollm2": Family("smollm2", "hf", (DIGITS_INDIVIDUAL, GPT2_PATTERN), ()),
}

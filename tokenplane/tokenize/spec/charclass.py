"""Character-class tables probed out of the reference engines themselves.

Python's `unicodedata` and the `regex` module disagree with tiktoken (Rust regex / fancy_regex) and HF tokenizers
(Oniguruma) on thousands of code points, so no table here comes from them. Probing:

* tiktoken: an Encoding whose pattern is the bare class (e.g. `\\p{L}`) and whose vocabulary is the 256 single bytes.
  tiktoken emits only regex matches, so decoding `encode_ordinary(all code points)` yields exactly the class members.
* HF tokenizers: a `Split(class, "removed")` pre-tokenizer over all code points returns the non-members.

Tables are one uint16 bitmask per code point (0..0x10FFFF), cached on disk and identified by sha256; `PINNED` holds
the hashes the boundary derivations in docs/ were checked against.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
from functools import cache
from pathlib import Path
from typing import Callable

import numpy as np

from .artifacts import cached_array

# Bit per class, in the reference regex dialect.
CLASSES = ("L", "Lu", "Ll", "Lt", "Lm", "Lo", "M", "N", "P", "S", "s")
BIT = {name: 1 << i for i, name in enumerate(CLASSES)}
_PATTERN = {name: (r"\s" if name == "s" else rf"\p{{{name}}}") for name in CLASSES}
N_CODEPOINTS = 0x110000

# sha256 of the probed tables (uint16 little-endian bytes) for the engine versions this project was derived on.
# tiktoken's Rust regex and HF's Oniguruma agreed on every class and code point when probed.
PINNED: dict[str, str] = {
    "tiktoken-0.14.0": "7b30e600dcd6942538555137b4ce7b90ef70889e3cc72b5dc6f8d5e334a229de",
    "tokenizers-0.23.3": "7b30e600dcd6942538555137b4ce7b90ef70889e3cc72b5dc6f8d5e334a229de",
}


def _all_codepoints() -> str:
    # Surrogates cannot appear in valid text (and cannot be encoded), so they are excluded.
    return "".join(map(chr, range(0xD800))) + "".join(map(chr, range(0xE000, N_CODEPOINTS)))


def _members_tiktoken(pattern: str, universe: str) -> str:
    import tiktoken

    enc = tiktoken.Encoding(name="tokenplane-probe", pat_str=pattern,
                            mergeable_ranks={bytes([i]): i for i in range(256)}, special_tokens={})
    return bytes(enc.encode_ordinary(universe)).decode("utf-8")


def _nonmembers_hf(pattern: str, universe: str) -> str:
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(pattern), behavior="removed")
    return "".join(piece for piece, _ in split.pre_tokenize_str(universe))


def probe(engine: str) -> np.ndarray:
    """Probe every class over every code point with the given reference engine ("tiktoken" or "hf")."""
    universe = _all_codepoints()
    table = np.zeros(N_CODEPOINTS, dtype=np.uint16)
    for name in CLASSES:
        mask = np.zeros(N_CODEPOINTS, dtype=bool)
        if engine == "tiktoken":
            members = _members_tiktoken(_PATTERN[name], universe)
            mask[np.frombuffer(members.encode("utf-32-le"), dtype=np.uint32)] = True
        elif engine == "hf":
            mask[:] = True
            mask[0xD800:0xE000] = False
            rest = _nonmembers_hf(_PATTERN[name], universe)
            mask[np.frombuffer(rest.encode("utf-32-le"), dtype=np.uint32)] = False
        else:
            raise ValueError(f"unknown engine {engine!r}")
        table[mask] |= BIT[name]
    return table


def table_hash(table: np.ndarray) -> str:
    return hashlib.sha256(table.astype("<u2").tobytes()).hexdigest()


@cache
def _engine_version(engine: str) -> str:
    package = "tiktoken" if engine == "tiktoken" else "tokenizers"
    return f"{package}-{_installed_version(package)}"


def _installed_version(package: str) -> str:
    """The version of an installed package from its one `.dist-info` folder beside it, without importing it
    (`import tokenizers` loads a ~20 ms Rust extension that a fast-path encode never calls); imported when the
    folder is absent or ambiguous."""
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        site = Path(list(spec.submodule_search_locations)[0]).parent
        found = list(site.glob(f"{package}-*.dist-info"))
        if len(found) == 1:
            return found[0].name[len(package) + 1:-len(".dist-info")]
    return str(importlib.import_module(package).__version__)


@cache
def class_table(engine: str) -> np.ndarray:
    """The (read-only) class bitmask table of a reference engine, probed once per engine version and cached."""
    return cached_array(f"charclass-{_engine_version(engine)}-{len(CLASSES)}.npy", (N_CODEPOINTS,), np.uint16,
                        lambda: probe(engine))


@cache
def table_is_pinned(engine: str) -> bool:
    """True when the probed table equals the one the family derivations were checked against."""
    pin = PINNED.get(_engine_version(engine))
    return pin is not None and pin == table_hash(class_table(engine))


# -- HF's Digits pre-tokenizer ----------------------------------------------------------------------------------------
# `Digits` is not a regex: it splits on Rust's `char::is_numeric` (Nd, Nl, No of the Unicode version Rust's standard
# library was built with), which is not Oniguruma's \p{N}. With tokenizers 0.23.3 it holds every \p{N} code point and
# 13 more (U+11DE0-U+11DE9, U+16FF4-U+16FF6: unassigned, no class bit, for its Oniguruma). Probed, not assumed.
PINNED_NUMERIC: dict[str, str] = {
    "tokenizers-0.23.3": "febbf9708ac79170530336d86cb39e21b93086b2a1a9a1b6a55f98345167797c",
}


def probe_numeric() -> np.ndarray:
    """bool per code point: HF `Digits(individual_digits=True)` isolates it. Probed on "a" + c for every code point
    c (a digit then comes back as its own one-character piece at an odd offset; nothing else does)."""
    from tokenizers import pre_tokenizers

    universe = _all_codepoints()
    text = "".join("a" + ch for ch in universe)
    out = np.zeros(N_CODEPOINTS, dtype=np.bool_)
    for piece, (start, end) in pre_tokenizers.Digits(individual_digits=True).pre_tokenize_str(text):
        if end - start == 1 and start % 2 == 1:
            out[ord(piece)] = True
    return out


@cache
def numeric_table() -> np.ndarray:
    """The (read-only) Digits-numeric table of the installed HF tokenizers, probed once per version and cached."""
    return cached_array(f"numeric-{_engine_version('hf')}.npy", (N_CODEPOINTS,), np.bool_, probe_numeric)


def numeric_hash(table: np.ndarray) -> str:
    return hashlib.sha256(np.packbits(table.astype(np.bool_)).tobytes()).hexdigest()


@cache
def numeric_is_pinned() -> bool:
    """True when the probed Digits table equals the one the smollm2 derivation was checked against."""
    pin = PINNED_NUMERIC.get(_engine_version("hf"))
    return pin is not None and pin == numeric_hash(numeric_table())


# -- tables derived from the pinned ones, cached like them -------------------------------------------------------------
@cache
def _source_hash(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes() + Path(__file__).read_bytes()).hexdigest()[:12]


def derived_table(name: str, engine: str, shape: tuple[int, ...], dtype: np.dtype | type,
                  build: Callable[[], np.ndarray], source: str, *, numeric: bool = False) -> np.ndarray:
    """A table computed by `build` from the class table of `engine` (and the Digits table when `numeric`) with code
    in the module file `source`, cached on disk under the pins and that file's bytes: a fresh process maps it
    (~0.1 ms) instead of recomputing it over 1.1M code points (15-30 ms each, on the first encode). A table that is
    not pinned is computed every time (nothing identifies it cheaply)."""
    if not table_is_pinned(engine) or (numeric and not numeric_is_pinned()):
        return build()
    pin = PINNED[_engine_version(engine)][:12]
    if numeric:
        pin += "-" + PINNED_NUMERIC[_engine_version("hf")][:8]
    return cached_array(f"derived-{name}-{engine}-{pin}-{_source_hash(source)}.npy", shape, dtype, build)

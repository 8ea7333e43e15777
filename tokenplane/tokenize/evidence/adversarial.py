"""Adversarial text and session-operation generators for differential campaigns.

The fragments target the places where a boundary-local tokenizer goes wrong: digit grouping (`\\p{N}{1,3}`), whitespace
lookahead (`\\s+(?!\\S)`), newline absorption (`[\\r\\n]*`), case-insensitive contractions (`'S`, `ſ`), optional
leading punctuation before letters, CJK/punctuation seams (DeepSeek's ideograph split), combining marks and Hangul
jamo that NFC composes across an append boundary (Qwen3), fractions and other numerics, emoji sequences, special-token
look-alikes, and code points whose class differs between Unicode versions.

Operations are plain tuples so they print as a reproduction:
  ("append", text) | ("edit", start, end, replacement) | ("sync", full_text)
Edit positions are clamped to the current text at apply time, which keeps shrunk cases valid.
"""

from __future__ import annotations

import random
from typing import Callable, Iterator, Sequence

Op = tuple

_WORDS = ["the", "The", "THE", "pipe", "line", "pipeline", "don", "'t", "'s", "'S", "'re", "'ll", "'ve", "'m", "'d",
          "ſ", "ſt", "x", "a", "I", "naïve", "café", "Straße", "İstanbul", "ǅ", "ʰ", "ω", "Ωmega", "привет", "مرحبا",
          "שלום", "नमस्ते", "สวัสดี", "token", "izer", "Tokenizer", "self", "return", "def", "__init__", "HTTPError",
          "camelCase", "snake_case", "iPhone", "ABCdef"]
_DIGITS = ["0", "1", "12", "123", "1234", "12345", "1234567", "2026", "3.14159", "1,000,000", "0x1F", "1e-9", "٣",
           "١٢٣٤", "१२३", "½", "¾", "²", "³", "Ⅻ", "⑩", "𝟙𝟚", "〇", "一二三"]
_SPACE = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", " \n", "\n ", "  \n  ", "\u00a0", "\u3000", "\u2028",
          "\u2029", "\u200b", "\u0085", "\f", "\v", "    ", "\n\n\n    "]
_PUNCT = ["!", "?", ".", "...", ",", ";", ":", "->", "=>", "==", "!=", "//", "#", "```", "\"", "'", "(", ")", "[",
          "]", "{", "}", "<", ">", "/", "\\", "-", "--", "_", "*", "**", "@", "$", "%", "^", "&", "|", "~", "`", "+",
          "。", "，", "、", "「", "」", "！", "？", "…", "—", "–", "·", "•", "€", "£", "¥", "©", "®", "™", "°", "±",
          "×", "÷", "§", "¶", "‰"]
_CJK = ["你好", "世界", "中文", "分词器", "人力资源", "日本語", "ひらがな", "カタカナ", "ｶﾀｶﾅ", "한국어", "ㄱㄴ", "漢",
        "々", "〆", "ー", "𠀀", "𪚥"]
_MARKS = ["\u0301", "\u0308", "\u0327", "\u20dd", "\u0903", "\u093f", "\u0e31", "\u05b0", "\u064b", "\u302a",
          "\ufe0f", "\u200d", "\u1161", "\u11a8", "e\u0301", "a\u030a", "\u1100\u1161", "\u1100\u1161\u11a8",
          "\u212b", "\u2126", "\uf900", "\u0344"]
_EMOJI = ["🙂", "👍🏽", "👨\u200d👩\u200d👧", "🇺🇸", "🇯🇵", "❤️", "☃", "🏳️\u200d🌈", "1️⃣", "🧑🏿\u200d💻"]
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|eot_id|>", "<tool_call>",
            "<｜User｜>", "<|endoftext", "|>", "<|", "<|begin_of_text|>"]
_CODE = ["def f(x):\n    return x + 1\n", "    if a == b:\n        pass\n", "for (int i = 0; i < n; ++i) {\n",
         "}\n", "import numpy as np\n", "x = [1, 2, 3]\n", "{\"key\": \"value\", \"n\": 42}", "$ ls -la\n",
         "</div>\n<div class=\"x\">", "#!/usr/bin/env python3\n", "// TODO: fix\n", "\t\treturn;\n"]
# Code points on which Unicode versions disagree (newly assigned letters/digits/marks, unassigned, private use).
_EDGE = [0x088F, 0x0897, 0x1CC0, 0x2C2F, 0xA7C0, 0xA7D0, 0x10570, 0x11F00, 0x1E030, 0x31350, 0x2EBF0, 0xE000,
         0xF8FF, 0x0378, 0x0860, 0x1DF00, 0x16FE4, 0x1B132, 0x1E4D0, 0x0CF3, 0x11B00, 0x10D40, 0x1E5D0, 0xFFFD,
         0x0000, 0x001F, 0x007F, 0x00AD, 0xFEFF, 0x10FFFF]

_POOLS: list[tuple[float, Sequence[str]]] = [
    (14, _WORDS), (8, _DIGITS), (10, _SPACE), (7, _PUNCT), (5, _CJK), (4, _MARKS), (2, _EMOJI), (1, _SPECIAL),
    (3, _CODE), (1, [chr(c) for c in _EDGE])]
_WEIGHTS = [w for w, _ in _POOLS]


def fragment(rng: random.Random) -> str:
    pool = rng.choices(_POOLS, weights=_WEIGHTS)[0][1]
    if rng.random() < 0.02:
        return chr(rng.choice([rng.randrange(0x20, 0x3000), rng.randrange(0xE000, 0x110000)]))
    return rng.choice(pool)


def random_text(rng: random.Random, max_fragments: int = 40) -> str:
    """Concatenated fragments; runs of one pool are common (long digit / whitespace / CJK runs)."""
    out: list[str] = []
    for _ in range(rng.randint(0, max_fragments)):
        piece = fragment(rng)
        out.append(piece * (rng.randint(2, 40) if rng.random() < 0.08 else 1))
    return "".join(out)


def boundary_append(rng: random.Random, text: str) -> str:
    """An append chosen to continue whatever the text ends with (the cases that move the last piece boundary)."""
    tail = text[-1:] if text else ""
    if tail.isdigit() or rng.random() < 0.1:
        return rng.choice(_DIGITS) + random_text(rng, 4)
    if tail.isspace() or rng.random() < 0.1:
        return rng.choice(_SPACE) + random_text(rng, 4)
    if rng.random() < 0.2:
        return rng.choice(_MARKS) + random_text(rng, 3)   # combining mark: NFC may recompose the old tail
    if rng.random() < 0.2:
        return rng.choice(["'s", "'S", "'t", "ſ", "s", "line", "izer", "'"]) + random_text(rng, 3)
    return random_text(rng, 12)


def session_case(rng: random.Random, corpus: Sequence[str] = (), max_ops: int = 12) -> tuple[str, list[Op]]:
    """A starting text and a list of operations. With a corpus, the base is a slice of real text salted with
    adversarial fragments; edits target random positions, including inside the last few hundred characters."""
    if corpus and rng.random() < 0.6:
        doc = rng.choice(corpus)
        start = rng.randrange(max(1, len(doc)))
        base = doc[start:start + rng.randint(0, 6000)]
    else:
        base = random_text(rng, 80)
    ops: list[Op] = []
    length = len(base)
    for _ in range(rng.randint(1, max_ops)):
        r = rng.random()
        if r < 0.6:
            piece = boundary_append(rng, base if not ops else "")
            if corpus and rng.random() < 0.3:
                doc = rng.choice(corpus)
                s = rng.randrange(max(1, len(doc)))
                piece += doc[s:s + rng.randint(1, 3000)]
            ops.append(("append", piece))
            length += len(piece)
        elif r < 0.85:
            near_end = rng.random() < 0.5
            start = rng.randint(max(0, length - 300), length) if near_end else rng.randint(0, length)
            end = min(length, start + rng.choice([0, 0, 1, 2, 5, 20, 200]))
            repl = random_text(rng, 6) if rng.random() < 0.8 else ""
            ops.append(("edit", start, end, repl))
            length += len(repl) - (end - start)
        else:
            # sync to a text sharing a prefix: truncate somewhere and continue differently
            cut = rng.randint(0, length)
            ops.append(("sync_cut", cut, random_text(rng, 10)))
            length = cut + len(ops[-1][2])
    return base, ops


def materialize(base: str, ops: Sequence[Op]) -> list[tuple[Op, str]]:
    """Resolve every op against the running text: returns (concrete op, text after it). `sync_cut` becomes a
    concrete ("sync", text) and edit positions are clamped."""
    text = base
    out: list[tuple[Op, str]] = []
    for op in ops:
        if op[0] == "append":
            text = text + op[1]
            out.append((op, text))
        elif op[0] == "edit":
            start = min(op[1], len(text))
            end = min(max(op[2], start), len(text))
            text = text[:start] + op[3] + text[end:]
            out.append((("edit", start, end, op[3]), text))
        elif op[0] == "sync_cut":
            text = text[:min(op[1], len(text))] + op[2]
            out.append((("sync", text), text))
        elif op[0] == "sync":
            text = op[1]
            out.append((op, text))
        else:
            raise ValueError(f"unknown op {op[0]!r}")
    return out


def shrink(base: str, ops: list[Op], fails: Callable[[str, list[Op]], bool], budget: int = 400
           ) -> tuple[str, list[Op]]:
    """Greedy delta-debugging: drop ops, then drop chunks of the base text and of op payloads, while `fails`
    still holds. Returns a (usually much) smaller failing case."""
    calls = 0

    def still(b: str, o: list[Op]) -> bool:
        nonlocal calls
        calls += 1
        try:
            return fails(b, o)
        except Exception:   # a shrink step that makes the case invalid is simply not taken
            return False

    i = 0
    while i < len(ops) and calls < budget:
        trial = ops[:i] + ops[i + 1:]
        if trial and still(base, trial):
            ops = trial
        else:
            i += 1

    def shrink_str(s: str, rebuild: Callable[[str], bool]) -> str:
        chunk = max(1, len(s) // 2)
        while chunk >= 1 and calls < budget:
            j, changed = 0, False
            while j < len(s) and calls < budget:
                trial = s[:j] + s[j + chunk:]
                if rebuild(trial):
                    s, changed = trial, True
                else:
                    j += chunk
            if not changed:
                chunk //= 2
        return s

    base = shrink_str(base, lambda b: still(b, ops))
    for k, op in enumerate(list(ops)):
        if op[0] in ("append", "sync"):
            payload = shrink_str(op[1], lambda p, k=k: still(base, ops[:k] + [(op[0], p)] + ops[k + 1:]))
            ops = ops[:k] + [(op[0], payload)] + ops[k + 1:]
        elif op[0] == "edit":
            payload = shrink_str(op[3], lambda p, k=k: still(base, ops[:k] + [(*op[:3], p)] + ops[k + 1:]))
            ops = ops[:k] + [(*op[:3], payload)] + ops[k + 1:]
        elif op[0] == "sync_cut":
            payload = shrink_str(op[2], lambda p, k=k: still(base, ops[:k] + [(op[0], op[1], p)] + ops[k + 1:]))
            ops = ops[:k] + [(op[0], op[1], payload)] + ops[k + 1:]
    return base, ops


def text_stream(rng: random.Random, corpus: Sequence[str] = (), max_chars: int = 20000) -> Iterator[str]:
    """Texts for full-encode checks: adversarial, real slices, and real slices salted with fragments."""
    while True:
        r = rng.random()
        if corpus and r < 0.5:
            doc = rng.choice(corpus)
            s = rng.randrange(max(1, len(doc)))
            text = doc[s:s + rng.randint(1, max_chars)]
            if rng.random() < 0.5:
                cut = rng.randint(0, len(text))
                text = text[:cut] + random_text(rng, 10) + text[cut:]
            yield text
        else:
            yield random_text(rng, rng.choice([5, 40, 400]))


# -- fault injection (for testing checkers: a checker that cannot catch these cannot catch anything) --------------
FAULTS = ("substitute", "delete", "duplicate", "swap", "tail_resplit")


def inject_fault(kind: str, ids: Sequence[int], token_bytes: Sequence[bytes], rng: random.Random,
                 byte_index: dict[bytes, int] | None = None) -> list[int] | None:
    """A corrupted copy of `ids`, or None if this kind cannot apply (e.g. no resplittable pair, nothing to swap).
    `tail_resplit` re-splits two adjacent tokens near the end into two *different* valid tokens covering the same
    bytes: same length, same decoded text, different IDs (the silent shape of a history-dependent engine bug)."""
    out = [int(i) for i in ids]
    n = len(out)
    if n == 0:
        return None
    if kind == "substitute":
        i = rng.randrange(n)
        new = rng.randrange(len(token_bytes) - 1)
        out[i] = new if new != out[i] else new + 1
        return out
    if kind == "delete":
        del out[rng.randrange(n)]
        return out
    if kind == "duplicate":
        i = rng.randrange(n)
        out.insert(i, out[i])
        return out
    if kind == "swap":
        pairs = [i for i in range(n - 1) if out[i] != out[i + 1]]
        if not pairs:
            return None
        i = rng.choice(pairs)
        out[i], out[i + 1] = out[i + 1], out[i]
        return out
    if kind == "tail_resplit":
        if byte_index is None:
            byte_index = {b: i for i, b in enumerate(token_bytes) if b}
        for i in range(n - 2, max(-1, n - 200), -1):   # nearest the tail first
            joined = token_bytes[out[i]] + token_bytes[out[i + 1]]
            cut_now = len(token_bytes[out[i]])
            for cut in range(1, len(joined)):
                if cut == cut_now:
                    continue
                a, b = byte_index.get(joined[:cut]), byte_index.get(joined[cut:])
                if a is not None and b is not None:
                    out[i], out[i + 1] = a, b
                    return out
        return None
    raise ValueError(f"unknown fault {kind!r}")

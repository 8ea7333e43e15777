"""Token IDs -> text deltas: incremental UTF-8 (never a split character) and stop strings.

Stop matching is linear in the new text: each stop string has a KMP automaton whose state is the length of the
longest prefix of the stop that ends the text so far, advanced one character at a time over the new text only. A
stop is found when a state reaches its length, and the text held back (it could still become a stop) is exactly the
largest state, so a stream never waits on more than it must and no step rescans old text. Work per token is
O(new characters x number of stops), bounded by the request limits (protocol.py caps count and length of stops).
"""

from __future__ import annotations

import codecs
from typing import Any, Iterable, Protocol, Sequence


class _Detokenizer(Protocol):
    specials: dict[str, int]
    decode_skipped: frozenset[int]

    def decode_bytes(self, ids: Sequence[int]) -> bytes: ...


def token_bytes(tokenizer: _Detokenizer, token: int) -> bytes:
    """One token's bytes. A model's vocabulary is padded past the tokenizer's (Qwen3: 151,936 rows, 151,669 tokens)
    and a random-weight one samples those rows; they decode to nothing, as HF's decode and vLLM give them."""
    try:
        return tokenizer.decode_bytes([token])
    except (ValueError, KeyError, IndexError):
        return b""


def token_text(tokenizer: _Detokenizer, token: int) -> str:
    """A token as text, as vLLM writes a logprob's token: its bytes decoded alone ("\ufffd" for part of a
    character)."""
    return token_bytes(tokenizer, token).decode("utf-8", "replace")


LogprobEntry = tuple[int, float, Iterable[tuple[int, float]] | None]   # token, its logprob, top (token, logprob)


def completion_logprobs(tokenizer: _Detokenizer, entries: Iterable[LogprobEntry],
                        offset: int = 0) -> tuple[dict[str, Any], int]:
    """Completions-format logprobs of (token, logprob, top (token, logprob) pairs or None) entries, every token
    written as its text, text offsets counted from `offset`; and the offset past them."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp, top in entries:
        text = token_text(tokenizer, token)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(None if top is None else {token_text(tokenizer, t): v for t, v in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


def _failure(pattern: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper border of pattern[:i + 1]."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        c = pattern[i]
        while k and pattern[k] != c:
            k = fail[k - 1]
        if pattern[k] == c:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Finds the first occurrence of any stop string in a text that arrives in pieces."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)

    @property
    def held(self) -> int:
        """Characters at the end of the text so far that could still begin a stop string."""
        return max(self._state, default=0)

    def feed(self, text: str, report: bool = True) -> int | None:
        """Advance over `text`; return the index in `text` just past the end of the earliest stop, or None.
        The earliest END is what ends the stream first; among stops ending there the longest is reported, so the
        cut (end - len(stop)) is the leftmost start of a stop ending at that point. report=False: stops found are
        passed over (min_tokens not reached yet), while a stop begun here can still end in later text."""
        if not self.stops:
            return None
        state, stops, fails = self._state, self.stops, self._fail
        for i, c in enumerate(text):
            hit = False
            for j, s in enumerate(stops):
                k = state[j]
                if k == len(s):     # a stop passed over: continue from its longest proper border
                    k = fails[j][k - 1]
                while k and s[k] != c:
                    k = fails[j][k - 1]
                if s[k] == c:
                    k += 1
                if k == len(s):
                    hit = True
                state[j] = k
            if hit and report:
                return i + 1
        return None

    def match_length(self) -> int:
        """After `feed` found a stop: the length of the longest stop ending there."""
        return len(self.matched())

    def matched(self) -> str:
        """After `feed` found a stop: the longest stop string ending there (vLLM's `stop_reason`)."""
        return max((s for j, s in enumerate(self.stops) if self._state[j] == len(s)), key=len)


class TextStream:
    """Token ids -> text deltas. A stop string ends the text before it (it is not returned); text that may still
    start a stop string is held back until it cannot. Special tokens (end-of-turn, EOS, template markers) are not
    text: they are skipped, as vLLM's skip_special_tokens does by default: the added tokens the tokenizer file marks
    special, not those it adds as ordinary text (qwen3's `<think>`, `<tool_call>`)."""

    def __init__(self, tokenizer: _Detokenizer, stop: Sequence[str] = (), *, skip_special: bool = True,
                 include_stop: bool = False) -> None:
        """include_stop: a stop string ends the text after itself (vLLM's include_stop_str_in_output)."""
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.skip = tokenizer.decode_skipped if skip_special else frozenset()
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.matcher = StopMatcher(stop)
        self.pending = ""   # decoded text not yet returned (at most the matcher's held characters)
        self.stopped = False

    def push(self, tokens: Sequence[int], armed: bool = True) -> str:
        """Text of `tokens` that can be released. armed=False: stop strings are not applied yet (vLLM's min_tokens:
        none ends the answer before that many tokens; one that ends after them does, wherever it began)."""
        if self.stopped:
            return ""
        new = "".join(self.decoder.decode(token_bytes(self.tokenizer, t)) for t in tokens if t not in self.skip)
        return self._emit(new, final=False, armed=armed)

    def flush(self) -> str:
        if self.stopped:
            return ""
        return self._emit(self.decoder.decode(b"", final=True), final=True)

    def _emit(self, new: str, final: bool, armed: bool = True) -> str:
        text = self.pending + new
        end = self.matcher.feed(new, report=armed)
        if end is not None:
            cut = len(text) - len(new) + end - (0 if self.include_stop else self.matcher.match_length())
            self.stopped, self.pending = True, ""
            return text[:max(cut, 0)]
        hold = 0 if final else min(self.matcher.held, len(text))
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]


__all__ = ["StopMatcher", "TextStream", "completion_logprobs", "token_bytes", "token_text"]

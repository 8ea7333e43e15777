"""Chat messages -> prompt token IDs, with template text tokenized as special tokens and message content never.

ChatML (<|im_start|>{role}\\n{content}<|im_end|>\\n ... <|im_start|>assistant\\n), the template of the Qwen3-family
tokenizer the default models use. Content that quotes special-token text stays ordinary text: a user cannot inject
a turn boundary.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

CHATML_SPECIALS = ("<|im_start|>", "<|im_end|>")
CHAT_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


class ChatTemplate:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        missing = [s for s in CHATML_SPECIALS if s not in tokenizer.specials]
        if missing:
            raise ValueError(f"tokenizer {tokenizer.name} lacks ChatML tokens {missing}")
        self.stop_token_ids = tuple(tokenizer.specials[s] for s in CHAT_STOP_TOKENS if s in tokenizer.specials)
        # One scan per message for every special-token text (re finds the shared "<" prefix with a fast search).
        names = sorted(tokenizer.specials, key=len, reverse=True)
        self._specials = re.compile("|".join(re.escape(s) for s in names)) if names else None

    @staticmethod
    def segments(messages: Sequence[tuple[str, str]]) -> list[tuple[str, bool]]:
        """(text, is template text) in order; template text's special tokens are real."""
        out: list[tuple[str, bool]] = []
        for role, content in messages:
            role = "system" if role == "developer" else role
            out += [(f"<|im_start|>{role}\n", True), (content, False), ("<|im_end|>\n", True)]
        out.append(("<|im_start|>assistant\n", True))
        return out

    def quotes_specials(self, messages: Sequence[tuple[str, str]]) -> bool:
        """True when some message content contains special-token text (it must then be encoded apart)."""
        return self._specials is not None and any(self._specials.search(c) for _, c in messages)

    def encode(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        segments = self.segments(messages)
        tok = self.tokenizer
        if not self.quotes_specials(messages):
            # One encode of the rendered text, exactly what HF apply_chat_template + encode gives.
            return tok.encode("".join(t for t, _ in segments), allowed_special=CHATML_SPECIALS).tolist()
        ids: list[int] = []
        for text, template in segments:
            ids += tok.encode(text, allowed_special=CHATML_SPECIALS if template else ()).tolist()
        return ids


__all__ = ["CHATML_SPECIALS", "CHAT_STOP_TOKENS", "ChatTemplate"]

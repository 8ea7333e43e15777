"""Every error the tokenize package raises, and the one input check that raises them.

This module is the bottom of the package: it imports nothing of ours, so every layer (the CPU and GPU encoders, the
text store, the session) can raise the public error types without importing the layers above it.
"""

from __future__ import annotations


class ArtifactError(RuntimeError):
    """A tokenizer file is missing or does not match its pinned sha256."""


class InvalidTextError(ValueError):
    """Input is not valid Unicode text (not str, invalid UTF-8 bytes, lone surrogates)."""

    index: int | None = None    # a batch call: the position of the offending text


class TextTooLargeError(ValueError):
    """Input exceeds the tokenizer's configured maximum size."""

    index: int | None = None    # a batch call: the position of the offending text


class PathUnavailableError(RuntimeError):
    """An explicitly requested encode path cannot run here (e.g. `path="gpu"` without a GPU)."""


class UnsupportedFamily(ValueError):
    """The family's splitter (or the probed class table) is not one the CPU pre-tokenizer was derived for."""


class SessionError(ValueError):
    """Misuse of a session: an edit range out of bounds, a bad option."""


class StaleRevisionError(SessionError):
    """`expect_revision=` did not match the session's current revision (another writer changed it)."""


def validate_text(text: str | bytes | bytearray | memoryview, max_chars: int) -> str:
    """Return text as a str that is valid Unicode, or raise a clear error. O(n) in C."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidTextError(f"input is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    elif not isinstance(text, str):
        raise InvalidTextError(f"expected str or UTF-8 bytes, got {type(text).__name__}")
    if len(text) > max_chars:
        raise TextTooLargeError(f"input has {len(text):,} characters; the limit is {max_chars:,}")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidTextError(
                f"input contains a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}") from None
    return text

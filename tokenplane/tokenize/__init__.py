"""Exact tokenization: families, pinned artifacts, reference engines, sessions with certified repair."""

from .artifacts import ArtifactError
from .tokenizer import (InvalidTextError, PathUnavailableError, TextTooLargeError, Tokenizer, load, register,
                        validate_text)

__all__ = ["ArtifactError", "InvalidTextError", "PathUnavailableError", "TextTooLargeError", "Tokenizer", "load",
           "register", "validate_text"]

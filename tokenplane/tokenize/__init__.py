"""Exact tokenization: families, pinned artifacts, reference engines, sessions with certified repair.

Layers, each importing only the ones above it in this list (tests/test_import_graph.py checks it):
errors -> reference -> spec/ -> cpu/ -> gpu/ -> router -> textstore -> session -> tokenizer -> registry -> verify
-> evidence/.
"""

from .errors import (
    ArtifactError,
    InvalidTextError,
    PathUnavailableError,
    SessionError,
    StaleRevisionError,
    TextTooLargeError,
    validate_text,
)
from .registry import build, load, register
from .tokenizer import Tokenizer

__all__ = ["ArtifactError", "InvalidTextError", "PathUnavailableError", "SessionError", "StaleRevisionError",
           "TextTooLargeError", "Tokenizer", "build", "load", "register", "validate_text"]

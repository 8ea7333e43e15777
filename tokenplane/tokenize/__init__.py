"""Exact tokenization: families, pinned artifacts, reference engines, sessions with certified repair.

Layers, bottom first; a module imports only modules of its own layer or below (tests/test_import_graph.py checks it,
and that there is no import cycle anywhere in tokenplane):
errors | reference | spec/ | cpu/ | gpu/ | router | textstore, splice | session | tokenizer | registry | verify |
evidence/.
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

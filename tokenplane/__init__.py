"""tokenplane: exact stateful tokenization and token-level routing for agentic LLM serving."""

from .tokenize import ArtifactError, InvalidTextError, PathUnavailableError, TextTooLargeError, Tokenizer, load

__all__ = ["ArtifactError", "InvalidTextError", "PathUnavailableError", "TextTooLargeError", "Tokenizer", "load"]
__version__ = "0.1.0"

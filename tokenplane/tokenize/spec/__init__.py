"""Frozen configuration: tokenizer families, sha256-pinned artifacts, character-class tables probed from the
reference engines."""

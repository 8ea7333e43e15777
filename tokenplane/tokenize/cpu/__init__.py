"""The exact CPU encode path: pre-tokenizer loops, BPE, GIL-free string access, regions-only NFC, stable boundaries,
chunk-parallel encoding."""

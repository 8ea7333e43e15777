"""Shared constants of the device pipeline: the device-resident counter block (`meta`) and family codes.

Every count the pipeline produces (characters, pieces, dispatch-list lengths, tokens) and every flag (invalid UTF-8,
family fallback) lives in `meta` on the device; kernels read their trip counts from it, so the host reads it once,
after the last kernel.
"""

N_BYTES, N_CHARS, N_PIECES, N_TOKENS, N_SMALL, N_MEDIUM, N_LARGE, INVALID, FALLBACK, N_DOCS = range(10)
META_LEN = 16
BIG = 0x7FFFFFFF

# family codes: which piece-start predicate the kernels evaluate
F_CL100K, F_LLAMA3, F_O200K, F_QWEN3 = 0, 1, 2, 3   # qwen3: llama3's rules, one digit per piece
F_DEEPSEEK = 4                                      # its own kernels (pretokenize_deepseek.py)
F_SMOLLM2 = 5                                       # its own kernels (pretokenize_smollm2.py)

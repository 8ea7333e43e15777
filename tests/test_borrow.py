"""Borrowed array views (cpu/borrow.py): same memory, no reference counts, nothing the kernels return is borrowed."""

import sys

import numpy as np
import pytest

import tokenplane
from tokenplane.tokenize.cpu import lazyjit


def _kernels():
    lazyjit.materialize()
    import numba

    from tokenplane.tokenize.cpu.borrow import borrowed

    @numba.njit
    def bump(a, i):
        # branchy enough that numba keeps the refcounts of its argument
        j = i
        while j < a.shape[0] and a[j] >= 0:
            if a[j] > 1_000_000:
                break
            a[j] += 1
            j += a.shape[0]
        return j

    @numba.njit
    def plain(a, n):
        for i in range(n):
            bump(a, i % a.shape[0])
        return a.sum()

    @numba.njit
    def borrowing(a, n):
        b = borrowed(a)
        for i in range(n):
            bump(b, i % a.shape[0])
        return a.sum()

    @numba.njit
    def borrowed_slice_copy(a):
        return borrowed(a)[1:3].copy()      # a copy of a view is owned: safe to return

    @numba.njit
    def count(s, c):
        n = 0
        for i in range(len(s)):
            n += s[i] == c
        return n

    @numba.njit
    def borrowed_str_count(s, c, rounds):
        b = borrowed(s)
        n = 0
        for _ in range(rounds):
            n += count(b, c)
        return n

    return plain, borrowing, borrowed_slice_copy, borrowed_str_count


def test_borrowed_view_writes_through_and_leaves_refcounts_alone():
    plain, borrowing, borrowed_slice_copy, _ = _kernels()
    a = np.zeros(8, np.int64)
    before = sys.getrefcount(a)
    assert borrowing(a, 1000) == 1000 and plain(a, 1000) == 2000
    assert list(a) == [250] * 8
    after = sys.getrefcount(a)
    assert after == before
    out = borrowed_slice_copy(a)
    assert out.flags.owndata or out.base is not None
    a[:] = 7
    assert list(out) == [250, 250]        # the copy is its own memory


def test_borrowed_str_reads_the_same_text_and_leaves_its_refcount_alone():
    *_, borrowed_str_count = _kernels()
    borrowed_str_count("compiled", "c", 1)     # (the compiling call's arguments are kept by numba)
    for text in ("a" * 50 + "b", "mixed é and 日本 text é", "\U0001F44D é \U0001F44D"):
        text = (text + "x")[:-1]        # an object of its own (not an interned literal)
        before = sys.getrefcount(text)
        want = text.count("é") if "é" in text else text.count("a")
        assert borrowed_str_count(text, "é" if "é" in text else "a", 7) == 7 * want
        after = sys.getrefcount(text)
        assert after == before


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base", "qwen3", "deepseek_v4", "smollm2"])
def test_encode_results_own_their_memory(name):
    """The fused kernels borrow their scratch and tables: IDs returned earlier stay intact while later encodes reuse
    the same scratch, and the tables' refcounts do not move."""
    from tokenplane.tokenize.cpu.parallel import CpuEncoder

    tok = tokenplane.load(name)
    enc = CpuEncoder(tok, workers=1)
    texts = ["It's 2024: 12345 tokens, they'll see.\n\n  def f(x):\n\treturn x ** 2  # done",
             "日本語のテキストと English words, 中文字符 and 한국어 문장 " * 20,
             "café naïve — “quotes” and    spaces\r\n\r\n" * 50]
    kept = [enc.encode(t, parallel=False) for t in texts]
    for t in texts:     # (binds the kernels these sizes use: their bindings hold the tables)
        enc.encode(t * 3, parallel=False)
    table_refs = sys.getrefcount(enc.bpe.ptab)
    for _ in range(20):
        for t in reversed(texts):
            enc.encode(t * 3, parallel=False)
    after = sys.getrefcount(enc.bpe.ptab)     # (not inside the assert: pytest's rewrite holds a reference there)
    assert after == table_refs
    for t, ids in zip(texts, kept):
        assert np.array_equal(ids, tok.reference.encode_ordinary(t))

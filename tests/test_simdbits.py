"""The vector steps of simdbits.py equal their scalar definitions, on every code unit width and in both lowerings
of features64 (vpermi2b where the host has AVX-512 VBMI, scalar loads elsewhere)."""

import numpy as np
import pytest

from tokenplane.tokenize.cpu import simdbits

numba = pytest.importorskip("numba")


def _kernels():
    """Fresh (uncached) kernels: each compiles with simdbits.VBMI as it is at that moment."""
    @numba.njit
    def features(c, table, out):
        masks = np.zeros(c.shape[0] // 64, np.uint64)
        for g in range(c.shape[0] // 64):
            masks[g] = simdbits.features64(c, 64 * g, table, out)
        return masks

    @numba.njit
    def narrow(c, out, pos):
        return simdbits.narrow64(c, 0, out, pos)

    @numba.njit
    def surrogates(c, i):
        return simdbits.surrogates64(c, i)
    return features, narrow, surrogates


def _wide_mask(units: np.ndarray) -> int:
    return int(np.packbits(units >= 0x80, bitorder="little").view(np.uint64)[0])


@pytest.mark.parametrize("vbmi", [True, False])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
def test_features64_and_narrow64(vbmi, dtype, monkeypatch):
    if vbmi and not simdbits.VBMI:
        pytest.skip("this host has no AVX-512 VBMI")
    monkeypatch.setattr(simdbits, "VBMI", vbmi)
    features, narrow, surrogates = _kernels()
    rng = np.random.default_rng(int(vbmi) * 8 + np.dtype(dtype).itemsize)
    table = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    top = np.iinfo(dtype).max if dtype != np.uint32 else 0x10FFFF
    for wide_share in (0.0, 0.05, 1.0):
        c = rng.integers(0, 0x80, 64 * 40).astype(dtype)
        hit = rng.random(c.shape[0]) < wide_share
        c[hit] = rng.integers(0x80, min(top, 0xFFFF) + 1, int(hit.sum())).astype(dtype)
        out = np.zeros(c.shape[0], np.uint8)
        masks = features(c, table, out)
        for g in range(c.shape[0] // 64):
            part = c[64 * g:64 * g + 64]
            assert int(masks[g]) == _wide_mask(part)
            ascii_ = part < 0x80
            assert np.array_equal(out[64 * g:64 * g + 64][ascii_], table[part[ascii_]])
        buf = np.zeros(80, np.uint8)
        assert int(narrow(c, buf, 7)) == _wide_mask(c[:64])
        assert np.array_equal(buf[7:71], (c[:64] & 0xFF).astype(np.uint8))
        assert not buf[:7].any() and not buf[71:].any()
    if dtype != np.uint8:       # surrogates at a few lanes, and their neighbours 0xD7FF and 0xE000
        c = rng.integers(0, 0x80, 128).astype(dtype)
        c[[3, 40, 63]] = [0xD800, 0xDFFF, 0xDBFF]
        c[[4, 41, 64, 70]] = [0xD7FF, 0xE000, 0xD800, 0xDC00]
        assert int(surrogates(c, 0)) == (1 << 3) | (1 << 40) | (1 << 63)
        assert int(surrogates(c, 64)) == (1 << 0) | (1 << 6)
    assert int(surrogates(np.full(64, 0xFF, np.uint8), 0)) == 0

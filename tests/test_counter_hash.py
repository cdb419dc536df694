# Copyright 2026 The dion3_jax Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================
"""The counter hash of the stochastic rounding's bits (``pallas_kernels._counter_hash``).

Bit for bit against an independent NumPy form (uint32 wraparound) on fresh random keys and
words, broadcast shapes included; known answers (MurmurHash3's published finalizer values);
and the statistics of a 1024 × 1024 block of consecutive counters, as stochastic rounding
consumes them: each of the top 16 bits is fair, the top 16 bits of horizontal and vertical
neighbours and of two keys one bit apart are uncorrelated, the top 8 bits fill 256 buckets
evenly (chi-square), and two keys one bit apart share no more 32-bit values than chance.
"""

from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._counter_hash import counter_hash
from pallas_kernels._stochastic_rounding import random_bits
from seeds import module_seed

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()

#: The block of the statistics: 2²⁰ elements.
SIDE = 1024
N = SIDE * SIDE


def _fmix32_np(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's finalizer on a uint32 array (NumPy's uint32 products wrap modulo 2³²)."""
    x = np.array(x, dtype=np.uint32, ndmin=1)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x85EBCA6B)
    x ^= x >> np.uint32(13)
    x *= np.uint32(0xC2B2AE35)
    x ^= x >> np.uint32(16)
    return x


def _hash_np(key0: int, key1: int, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """The hash's definition, written out again in NumPy: ``hi`` keyed by xor, ``lo`` by
    addition, the tweak xored in before the final mix."""
    k0, k1 = np.uint32(key0), np.uint32(key1)
    t = _fmix32_np(k0 ^ _fmix32_np(k1))
    lo = np.array(lo, np.uint32, ndmin=1)
    return _fmix32_np(_fmix32_np(hi ^ k0) ^ _fmix32_np(lo + k1) ^ t)


def _u32(rng, shape) -> np.ndarray:
    return rng.integers(0, 2 ** 32, shape, dtype=np.uint64).astype(np.uint32)


def _jax_hash(key, hi, lo) -> np.ndarray:
    u = lambda v: jnp.asarray(v, jnp.uint32)  # noqa: E731
    return np.asarray(jax.jit(counter_hash)(u(key[0]), u(key[1]), u(hi), u(lo)))


def test_matches_numpy_on_random_keys_and_words():
    """Random keys and words, the words' extremes, and ``hi``/``lo`` of lower rank broadcast
    against each other: bit for bit the NumPy form, and ``random_bits`` is the hash."""
    rng = np.random.default_rng(SEED)
    for _ in range(4):
        key = _u32(rng, (2,))
        hi, lo = _u32(rng, (4096,)), _u32(rng, (4096,))
        hi[:4], lo[:4] = [0, 0xFFFFFFFF, 0, 0xFFFFFFFF], [0, 0, 0xFFFFFFFF, 0xFFFFFFFF]
        want = _hash_np(key[0], key[1], hi, lo)
        np.testing.assert_array_equal(_jax_hash(key, hi, lo), want)
        np.testing.assert_array_equal(np.asarray(random_bits(jnp.asarray(key), hi, lo)), want)
        col, row = _u32(rng, (3, 5, 1)), _u32(rng, (7,))
        got = _jax_hash(key, col, row)
        assert got.shape == (3, 5, 7)
        np.testing.assert_array_equal(got, _hash_np(key[0], key[1], col, row))
        np.testing.assert_array_equal(_jax_hash(key, row, col),
                                      _hash_np(key[0], key[1], row, col))


def test_known_answers():
    """The finalizer by hand and by MurmurHash3's published values, then the hash from them.

    ``fmix32(0) = 0``: each xor-shift and product maps 0 to 0. ``fmix32(1)``: ``1 ^ (1 >> 16)
    = 1``; ``1 · 0x85EBCA6B = 0x85EBCA6B``; ``0x85EBCA6B >> 13 = 0x42F5E``, xored:
    ``0x85EFE535``; times ``0xC2B2AE35`` modulo 2³²: ``0x514E79F9``; ``^ (x >> 16) = 0x514E``:
    ``0x514E28B7``. MurmurHash3_x86_32 of the empty input with seed ``s`` is ``fmix32(s)``
    (no blocks, no tail, length 0), and its published values for seeds 1 and 0xFFFFFFFF are
    0x514E28B7 and 0x81F16F39.
    """
    assert int(_fmix32_np(0)[0]) == 0
    assert int(_fmix32_np(1)[0]) == 0x514E28B7
    assert int(_fmix32_np(0xFFFFFFFF)[0]) == 0x81F16F39
    # Key (0, 0), words (0, 0): tweak fmix32(0 ^ fmix32(0)) = 0 and both lines 0, so 0.
    # Key (1, 0): tweak fmix32(1) and the hi line fmix32(0 ^ 1) cancel, the lo line is 0.
    # Key (0, 1): tweak fmix32(fmix32(1)), hi line 0, lo line fmix32(0 + 1) = fmix32(1).
    t = int(_fmix32_np(0x514E28B7)[0])
    assert int(_fmix32_np(t ^ 0x514E28B7)[0]) == 0x6263DB71
    answers = [((0, 0, 0, 0), 0), ((1, 0, 0, 0), 0), ((0, 1, 0, 0), 0x6263DB71),
               # Recorded from the NumPy form:
               ((0x13198A2E, 0x03707344, 0x243F6A88, 0x85A308D3), 0x602A5049),
               ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), 0x900E1678),
               # Equal key words, yet (hi, lo) = (3, 5) and (5, 3) differ: the words take
               # their key words by xor and by addition.
               ((7, 7, 3, 5), 0xDB01066B), ((7, 7, 5, 3), 0x3AD0DFAC)]
    for (k0, k1, hi, lo), value in answers:
        assert int(_hash_np(k0, k1, hi, lo)[0]) == value, (k0, k1, hi, lo)
        assert int(_jax_hash((k0, k1), hi, lo)) == value, (k0, k1, hi, lo)


def _block(key) -> np.ndarray:
    """The hash of the consecutive counters ``hi = row``, ``lo = column`` of a block."""
    return _jax_hash(key, np.arange(SIDE, dtype=np.uint32)[:, None],
                     np.arange(SIDE, dtype=np.uint32)[None, :])


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef((a >> 16).astype(np.float64).ravel(),
                             (b >> 16).astype(np.float64).ravel())[0, 1])


def _flip(key: np.ndarray, bit: int) -> np.ndarray:
    out = key.copy()
    out[bit // 32] ^= np.uint32(1 << (bit % 32))
    return out


@pytest.fixture(scope="module")
def blocks():
    """The block under a fresh key, under the key with one random bit flipped, and under the
    key with one of its words' low 10 bits flipped (a change of key that a hash keyed only
    on the words, without the tweak, would turn into a shift of the block's rows or columns)."""
    rng = np.random.default_rng(SEED + 1)
    key = _u32(rng, (2,))
    any_bit = int(rng.integers(64))
    low_bit = int(rng.integers(2)) * 32 + int(rng.integers(10))
    print(f"key {key}, bits flipped {any_bit}, {low_bit}")
    return _block(key), _block(_flip(key, any_bit)), _block(_flip(key, low_bit))


def test_top_bits_are_fair(blocks):
    """Each of the top 16 bits is set in half the block within 6 standard errors."""
    bits, _, _ = blocks
    for b in range(16, 32):
        share = ((bits >> np.uint32(b)) & np.uint32(1)).mean()
        assert abs(share - 0.5) < 6 * 0.5 / np.sqrt(N), (b, share)


def test_neighbours_and_nearby_keys_are_uncorrelated(blocks):
    """The top 16 bits' correlation between horizontal neighbours, vertical neighbours, and the
    same element under keys one bit apart: below 6/sqrt(pairs) in magnitude."""
    bits, flipped, low = blocks
    bound = 6 / np.sqrt(N - SIDE)
    pairs = {"horizontal": (bits[:, :-1], bits[:, 1:]), "vertical": (bits[:-1], bits[1:]),
             "key bit": (bits, flipped), "key low bit": (bits, low)}
    for name, (a, b) in pairs.items():
        assert abs(_corr(a, b)) < bound, (name, _corr(a, b))


def test_top_byte_passes_chi_square(blocks):
    """The counts of the top 8 bits over 256 buckets: chi-square (255 degrees of freedom)
    between its 1e-6 and 1 − 1e-6 quantiles (Wilson–Hilferty's normal approximation)."""
    bits, _, _ = blocks
    counts = np.bincount((bits >> np.uint32(24)).ravel(), minlength=256)
    expected = N / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    k = 255
    z = NormalDist().inv_cdf(1 - 1e-6)
    lo, hi = (k * (1 - 2 / (9 * k) + s * z * np.sqrt(2 / (9 * k))) ** 3 for s in (-1, 1))
    assert lo < chi2 < hi, (lo, chi2, hi)


def test_keys_one_bit_apart_share_values_only_by_chance(blocks):
    """Two keys one bit apart share as many 32-bit values as two independent blocks would:
    ``N²/2³² = 256`` expected (about Poisson), so below 256 + 6·16. Keyed only on the words
    (without the tweak), a low key bit would give the same block with its rows or columns
    shifted."""
    bits, flipped, low = (_distinct(b) for b in blocks)
    for other in (flipped, low):
        shared = np.intersect1d(bits, other, assume_unique=True).size
        assert shared < 256 + 6 * 16, shared


def _distinct(values):
    """The distinct values, sorted (``np.unique``'s result, without its hash table, which takes
    seconds on 2²⁰ values on some CPUs)."""
    s = np.sort(values, axis=None)
    return s[np.concatenate([[True], s[1:] != s[:-1]])]

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
"""A cheap counter-based hash: 32 random bits from a 64-bit key and two uint32 counter words.

Stochastic rounding needs, per element, 32 bits that look uniform and independent of its
neighbours' and that any device can recompute from the element's global index. The hash is
built from MurmurHash3's 32-bit finalizer ``fmix32`` (a bijection of uint32 with full
avalanche: three xor-shifts and two multiplies)::

    counter_hash(key, hi, lo) = fmix32(fmix32(hi ^ key0) ^ fmix32(lo + key1) ^ tweak(key))
    tweak(key) = fmix32(key0 ^ fmix32(key1))

(uint32 arithmetic modulo 2³²). Design:

- **Two line hashes, combined by xor, then a final mix.** ``fmix32(hi ^ key0)`` depends on
  the element's ``hi`` word only and ``fmix32(lo + key1)`` on its ``lo`` word only, so a block
  whose rows step along one word computes that word's line hash once per row, on the row
  vector, and broadcasts it (:func:`pallas_kernels._counter.block_bits`). Each line hash is a
  bijection, so two elements of one row never share their pre-mix value; the final ``fmix32``
  spreads the xor of the two lines over all 32 output bits, so that neighbouring rows (whose
  pre-mix values differ by a constant xor) give unrelated bits.
- **The key enters each word differently.** ``hi`` takes ``key0`` by xor and ``lo`` takes
  ``key1`` by addition, so the two line hashes are different functions for every key but
  ``(0, 0)``; with one operation for both, a key with equal words would give the elements
  ``(hi, lo)`` and ``(lo, hi)`` equal bits.
- **The tweak.** Without it the bits under a key whose ``key0`` differs by an xor ``d0``
  (``key1`` by an addend ``d1``) would be the bits at the counters ``(hi ^ d0, lo + d1)``:
  two writes whose keys differ in a few low bits would share whole blocks of bits, shifted.
  The tweak, a mix of both key words xored in before the final mix (into the per-row line, so
  it costs nothing per element), changes whenever one key word does, and moves every
  element's pre-mix value by the same xor, which no shift of the counters reproduces.
- **Cost.** Per element, one line hash and the final mix (``tweak`` and the per-row line are
  per row): two ``fmix32`` and two xors, about 18 uint32 operations with four multiplies,
  against about 115 for Threefry-2x32's 20 rounds (the hash ``jax.random`` uses).
- **Collisions.** The output has 32 bits, so two elements get equal bits at the birthday rate
  of 32-bit values (a 1024 × 1024 block holds about 128 equal pairs), with no structure along
  rows or columns, and two keys one bit apart share values only at that rate too.

It is a statistical hash for rounding noise, not a cryptographic or even a
``jax.random``-grade generator: its tests check uniform, uncorrelated bits
(``tests/test_counter_hash.py``), which is what stochastic rounding needs.

Reference: Appleby, `MurmurHash3 <https://github.com/aappleby/smhasher>`_, 2011 (``fmix32``:
its shifts and multipliers).
"""

from __future__ import annotations

import jax
from jax import lax
import numpy as np

#: ``fmix32``'s multipliers (MurmurHash3).
_M1, _M2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)


def _xorshift(x: jax.Array, r: int) -> jax.Array:
    return x ^ lax.shift_right_logical(x, np.uint32(r))


def _fmix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 in which every input bit flips
    every output bit with probability close to one half."""
    x = _xorshift(x, 16) * _M1
    x = _xorshift(x, 13) * _M2
    return _xorshift(x, 16)


def hi_line(key0, hi: jax.Array) -> jax.Array:
    """The line hash of the ``hi`` words: ``fmix32(hi ^ key0)``."""
    return _fmix32(hi ^ key0)


def lo_line(key1, lo: jax.Array) -> jax.Array:
    """The line hash of the ``lo`` words: ``fmix32(lo + key1)``."""
    return _fmix32(lo + key1)


def tweak(key0, key1) -> jax.Array:
    """The key's tweak, ``fmix32(key0 ^ fmix32(key1))``, xored in before the final mix."""
    return _fmix32(key0 ^ _fmix32(key1))


def finish(x: jax.Array) -> jax.Array:
    """The final mix of the xor of the line hashes and the tweak."""
    return _fmix32(x)


def counter_hash(key0, key1, hi: jax.Array, lo: jax.Array) -> jax.Array:
    """32 random bits per element from the key ``(key0, key1)`` and its words ``(hi, lo)``.

    Args:
      key0: uint32 scalar, the key's first word.
      key1: uint32 scalar, the key's second word.
      hi: uint32 counter words.
      lo: uint32 counter words broadcastable against ``hi``: each word's line hash is
        computed at its own shape, so a lower-rank ``hi`` or ``lo`` is hashed once per value.

    Returns:
      uint32 bits of the broadcast shape of ``hi`` and ``lo``.

    Examples:
      >>> import jax.numpy as jnp
      >>> u = lambda v: jnp.asarray(v, jnp.uint32)
      >>> bits = counter_hash(u(7), u(9), jnp.arange(2, dtype=jnp.uint32)[:, None],
      ...                     jnp.arange(3, dtype=jnp.uint32))
      >>> bits.shape, bits.dtype
      ((2, 3), dtype('uint32'))
      >>> bool(bits[1, 2] == counter_hash(u(7), u(9), u(1), u(2)))
      True
    """
    return finish(hi_line(key0, hi) ^ lo_line(key1, lo) ^ tweak(key0, key1))

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
"""The lower-triangular tile walk (pallas_kernels._schedule): pure index maths.

The walk orders and the Triton kernel's batched walk, used as oracles here, are this file's
(``lower_tile_table``, ``pair_tile_table``, ``batched_lower_tile_coords``): the library keeps only
what its kernels call.
"""

import ast
import inspect
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _schedule

ROOT = pathlib.Path(__file__).resolve().parents[1]


def lower_tile_table(tiles_per_side: int) -> np.ndarray:
    """All lower tiles in walk order: an int32 array of shape ``(T(T+1)/2, 2)``."""
    t = np.arange(_schedule.num_lower_tiles(tiles_per_side), dtype=np.int64)
    i, j = _schedule.lower_tile_coords(t, tiles_per_side)
    return np.stack([i, j], axis=-1).astype(np.int32)


def batched_lower_tile_coords(t, tiles_per_side: int):
    """``(b, i, j)`` of the linear index ``t`` over a batch walked one matrix after another, as
    the Triton kernel splits its program id (a Python int or a traced int32 scalar)."""
    per_matrix = _schedule.num_lower_tiles(tiles_per_side)
    b, t = t // per_matrix, t % per_matrix
    return (b, *_schedule.lower_tile_coords(t, tiles_per_side))


def pair_tile_table(tiles_per_side: int) -> np.ndarray:
    """All paired items in walk order: int32 ``(num_pair_items(T), 3)`` of ``(c, r1, r2)``."""
    m = np.arange(_schedule.num_pair_items(tiles_per_side), dtype=np.int64)
    if m.size == 0:
        return np.zeros((0, 3), np.int32)
    return np.stack(_schedule.pair_tile_coords(m, tiles_per_side), axis=-1).astype(np.int32)


def _names_used(source: str) -> set[str]:
    """Every name and attribute name that ``source`` reads."""
    nodes = ast.walk(ast.parse(source))
    return {getattr(n, "id", None) or getattr(n, "attr", None) for n in nodes
            if isinstance(n, (ast.Name, ast.Attribute))}


def test_the_schedule_holds_only_what_the_kernels_call():
    """Every public function of _schedule is called by a kernel module, directly or through
    another of its functions; oracles that only tests use live in the tests."""
    public = {name for name, fn in inspect.getmembers(_schedule, inspect.isfunction)
              if fn.__module__ == _schedule.__name__ and not name.startswith("_")}
    library = [p for d in ("pallas_kernels", "dion3_jax") for p in (ROOT / d).glob("*.py")
               if p.name != "_schedule.py"]
    used = set().union(*(_names_used(p.read_text()) for p in library)) & public
    while True:
        more = set().union(*(_names_used(inspect.getsource(getattr(_schedule, n)))
                             for n in used)) & public
        if more <= used:
            break
        used |= more
    assert used == public, f"used only outside the kernels: {sorted(public - used)}"


@pytest.mark.parametrize("tiles", [0, 1, 2, 3, 4, 5, 8, 31, 32, 33, 64, 229])
def test_walk_covers_each_lower_tile_once(tiles):
    table = lower_tile_table(tiles)
    assert table.shape == (tiles * (tiles + 1) // 2, 2)
    i, j = table[:, 0], table[:, 1]
    assert np.all((0 <= j) & (j <= i) & (i < max(tiles, 1)))
    expected = {(a, b) for a in range(tiles) for b in range(a + 1)}
    assert set(map(tuple, table.tolist())) == expected


@pytest.mark.parametrize("tiles", [1, 4, 7, 32])
def test_python_numpy_and_jax_agree(tiles):
    count = _schedule.num_lower_tiles(tiles)
    table = lower_tile_table(tiles)
    for t in range(count):
        assert _schedule.lower_tile_coords(t, tiles) == tuple(table[t])
    traced = jax.jit(lambda t: jnp.stack(_schedule.lower_tile_coords(t, tiles)))
    got = jax.vmap(traced)(jnp.arange(count, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), table)


def test_rectangle_rows_pair_long_and_short_rows():
    tiles = 6
    table = lower_tile_table(tiles)
    rows = table[:, 0].reshape(tiles // 2, tiles + 1)
    for q in range(tiles // 2):
        assert set(rows[q]) == {tiles - 1 - q, q}


def test_batched_walk():
    tiles, batch = 5, 3
    per = _schedule.num_lower_tiles(tiles)
    seen = set()
    for t in range(batch * per):
        b, i, j = batched_lower_tile_coords(t, tiles)
        assert 0 <= b < batch and 0 <= j <= i < tiles
        seen.add((b, i, j))
    assert len(seen) == batch * per
    b, i, j = jax.jit(lambda t: batched_lower_tile_coords(t, tiles))(jnp.int32(per + 2))
    assert (int(b), int(i), int(j)) == batched_lower_tile_coords(per + 2, tiles)


def test_negative_tile_counts_are_refused():
    with pytest.raises(ValueError, match="tiles_per_side=-1"):
        _schedule.num_lower_tiles(-1)
    with pytest.raises(ValueError, match="tiles_per_side=-1"):
        _schedule.num_pair_items(-1)


# --- The paired walk (the Mosaic kernel's work items) -----------------------------------------


def _pair_cover(tiles):
    """The unordered tiles covered by the paired walk, as a list (duplicates kept)."""
    covered = []
    for c, r1, r2 in pair_tile_table(tiles).tolist():
        assert 0 <= c < tiles and 0 <= r1 < tiles and 0 <= r2 < tiles
        covered.append(frozenset((r1, c)))
        if r2 != r1:
            covered.append(frozenset((r2, c)))
    return covered


@pytest.mark.parametrize("tiles", [*range(0, 41), 63, 64, 65, 66, 67, 229])
def test_pair_walk_covers_each_lower_tile_once(tiles):
    table = pair_tile_table(tiles)
    assert table.shape == (_schedule.num_pair_items(tiles), 3)
    covered = _pair_cover(tiles)
    expected = {frozenset((a, b)) for a in range(tiles) for b in range(a + 1)}
    assert len(covered) == len(expected) and set(covered) == expected
    singles = int(np.sum(table[:, 1] == table[:, 2])) if len(table) else 0
    assert singles <= 2
    if tiles % 4 == 0:
        assert singles == 0


def test_pair_walk_4096_fills_two_waves_on_132_sms():
    assert _schedule.num_pair_items(32) == 264 == 2 * 132
    assert _schedule.num_lower_tiles(32) == 528 == 4 * 132


@pytest.mark.parametrize("tiles", [1, 2, 3, 4, 5, 6, 7, 8, 11, 32])
def test_pair_walk_python_numpy_and_jax_agree(tiles):
    count = _schedule.num_pair_items(tiles)
    table = pair_tile_table(tiles)
    for m in range(count):
        assert tuple(int(v) for v in _schedule.pair_tile_coords(m, tiles)) == tuple(table[m])
    traced = jax.jit(lambda m: jnp.stack(_schedule.pair_tile_coords(m, tiles)))
    got = jax.vmap(traced)(jnp.arange(count, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), table)


def test_batched_pair_walk():
    tiles, batch = 7, 3
    per = _schedule.num_pair_items(tiles)
    table = pair_tile_table(tiles)
    for m in range(batch * per):
        b, c, r1, r2 = _schedule.batched_pair_tile_coords(m, tiles)
        assert b == m // per and (c, r1, r2) == tuple(table[m % per])
    got = jax.jit(lambda m: jnp.stack(_schedule.batched_pair_tile_coords(m, tiles)))(
        jnp.int32(per + 2))
    assert tuple(np.asarray(got)) == (1, *table[2])

"""The lower-triangular tile walk (pallas_kernels._schedule): pure index maths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _schedule


@pytest.mark.parametrize("tiles", [0, 1, 2, 3, 4, 5, 8, 31, 32, 33, 64, 229])
def test_walk_covers_each_lower_tile_once(tiles):
    table = _schedule.lower_tile_table(tiles)
    assert table.shape == (tiles * (tiles + 1) // 2, 2)
    i, j = table[:, 0], table[:, 1]
    assert np.all((0 <= j) & (j <= i) & (i < max(tiles, 1)))
    expected = {(a, b) for a in range(tiles) for b in range(a + 1)}
    assert set(map(tuple, table.tolist())) == expected


@pytest.mark.parametrize("tiles", [1, 4, 7, 32])
def test_python_numpy_and_jax_agree(tiles):
    count = _schedule.num_lower_tiles(tiles)
    table = _schedule.lower_tile_table(tiles)
    for t in range(count):
        assert _schedule.lower_tile_coords(t, tiles) == tuple(table[t])
    traced = jax.jit(lambda t: jnp.stack(_schedule.lower_tile_coords(t, tiles)))
    got = jax.vmap(traced)(jnp.arange(count, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), table)


def test_rectangle_rows_pair_long_and_short_rows():
    tiles = 6
    table = _schedule.lower_tile_table(tiles)
    rows = table[:, 0].reshape(tiles // 2, tiles + 1)
    for q in range(tiles // 2):
        assert set(rows[q]) == {tiles - 1 - q, q}


def test_batched_walk():
    tiles, batch = 5, 3
    per = _schedule.num_lower_tiles(tiles)
    seen = set()
    for t in range(batch * per):
        b, i, j = _schedule.batched_lower_tile_coords(t, tiles)
        assert 0 <= b < batch and 0 <= j <= i < tiles
        seen.add((b, i, j))
    assert len(seen) == batch * per
    b, i, j = jax.jit(lambda t: _schedule.batched_lower_tile_coords(t, tiles))(jnp.int32(per + 2))
    assert (int(b), int(i), int(j)) == _schedule.batched_lower_tile_coords(per + 2, tiles)


def test_num_tiles_and_errors():
    assert _schedule.num_tiles(0, 128) == 0
    assert _schedule.num_tiles(1, 128) == 1
    assert _schedule.num_tiles(256, 128) == 2
    assert _schedule.num_tiles(257, 128) == 3
    with pytest.raises(ValueError):
        _schedule.num_tiles(4, 0)
    with pytest.raises(ValueError):
        _schedule.num_lower_tiles(-1)


# --- The paired walk (the Mosaic kernel's work items) -----------------------------------------


def _pair_cover(tiles):
    """The unordered tiles covered by the paired walk, as a list (duplicates kept)."""
    covered = []
    for c, r1, r2 in _schedule.pair_tile_table(tiles).tolist():
        assert 0 <= c < tiles and 0 <= r1 < tiles and 0 <= r2 < tiles
        covered.append(frozenset((r1, c)))
        if r2 != r1:
            covered.append(frozenset((r2, c)))
    return covered


@pytest.mark.parametrize("tiles", [*range(0, 41), 63, 64, 65, 66, 67, 229])
def test_pair_walk_covers_each_lower_tile_once(tiles):
    table = _schedule.pair_tile_table(tiles)
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
    table = _schedule.pair_tile_table(tiles)
    for m in range(count):
        assert tuple(int(v) for v in _schedule.pair_tile_coords(m, tiles)) == tuple(table[m])
    traced = jax.jit(lambda m: jnp.stack(_schedule.pair_tile_coords(m, tiles)))
    got = jax.vmap(traced)(jnp.arange(count, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), table)


def test_batched_pair_walk():
    tiles, batch = 7, 3
    per = _schedule.num_pair_items(tiles)
    table = _schedule.pair_tile_table(tiles)
    for m in range(batch * per):
        b, c, r1, r2 = _schedule.batched_pair_tile_coords(m, tiles)
        assert b == m // per and (c, r1, r2) == tuple(table[m % per])
    got = jax.jit(lambda m: jnp.stack(_schedule.batched_pair_tile_coords(m, tiles)))(
        jnp.int32(per + 2))
    assert tuple(np.asarray(got)) == (1, *table[2])

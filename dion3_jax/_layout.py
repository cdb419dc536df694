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
"""Leaf ↔ canonical matrix views: dimension numbers, batch axes, ``num_heads``, ``split_sizes``.

A weight leaf has an output axis (its "rows" in the paper: output neurons), a reduction axis
(inputs) and any number of batch axes (stacked layers, experts), each batch element an independent
matrix. The canonical view of a leaf is a list of 3-D *blocks* ``(batch, C, n)`` or
``(batch, n, C)``: the orientation follows the leaf's own memory order (a Flax ``(in, out)``
kernel keeps its output axis last), so that the common cases need no transpose. ``num_heads``
moves heads into the batch; ``split_sizes`` cuts the output axis into independent blocks (fused
QKV under grouped-query attention).

Each block records the numbers the update rule needs: ``n`` rows (output size of one matrix),
``C`` columns (input size) and which axis of the block holds the rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from optax.contrib import MuonDimensionNumbers

from dion3_jax import _numbers

# Same fields (reduction_axis, output_axis) as optax's Muon spec; optax's class is accepted too.
DimensionNumbers = MuonDimensionNumbers
FLAX_DIMENSION_NUMBERS = DimensionNumbers(reduction_axis=0, output_axis=1)


def _norm_axes(axes, ndim: int, what: str, shape, name: str) -> tuple[int, ...]:
    axes = (axes,) if _numbers.is_int(axes) else tuple(axes)
    if not axes:
        raise ValueError(f"{what} must name at least one axis, got {axes=} for {name} ({shape=})")
    out = []
    for a in axes:
        if not _numbers.is_int(a) or not -ndim <= a < ndim:
            raise ValueError(f"{what} {a!r} is out of range for {name} ({shape=})")
        out.append(int(a) % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{what} repeats an axis: {axes=} for {name} ({shape=})")
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """Static description of one canonical block of a leaf.

    Attributes:
      batch: number of independent matrices in the block.
      n: rows (outputs) of one matrix.
      c: columns (inputs) of one matrix.
      row_axis: axis of the 3-D block that holds the rows (1 or 2).
    """

    batch: int
    n: int
    c: int
    row_axis: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.batch, self.n, self.c) if self.row_axis == 1 else (self.batch, self.c, self.n)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How a leaf maps to canonical blocks and back (pure index bookkeeping, all static)."""

    shape: tuple[int, ...]
    perm: tuple[int, ...]          # leaf axes → (batch..., first matrix axes..., second ...)
    batch_shape: tuple[int, ...]
    first_shape: tuple[int, ...]   # sizes of the matrix axes that come first in memory order
    second_shape: tuple[int, ...]
    out_last: bool                 # True when the output axes come after the reduction axes
    num_heads: int
    split_sizes: tuple[int, ...]   # row counts per block (one entry when not split)
    reduction_axes: tuple[int, ...]
    output_axes: tuple[int, ...]

    @property
    def blocks(self) -> tuple[BlockLayout, ...]:
        b = math.prod(self.batch_shape) * self.num_heads
        c = math.prod(self.first_shape if self.out_last else self.second_shape)
        row_axis = 2 if self.out_last else 1
        return tuple(BlockLayout(b, n, c, row_axis) for n in self.split_sizes)

    @property
    def variance_shape(self) -> tuple[int, ...]:
        """Leaf shape with the reduction axes reduced to size 1 (per-row second moments)."""
        return tuple(1 if i in self.reduction_axes else s for i, s in enumerate(self.shape))

    def to_blocks(self, x: jax.Array) -> list[jax.Array]:
        """Leaf-shaped (or variance-shaped) array → list of 3-D blocks."""
        sizes = [x.shape[i] for i in self.perm]
        nb = len(self.batch_shape)
        nf = len(self.first_shape)
        first = math.prod(sizes[nb:nb + nf])
        second = math.prod(sizes[nb + nf:])
        y = jnp.transpose(x, self.perm) if self.perm != tuple(range(x.ndim)) else x
        y = y.reshape((math.prod(self.batch_shape), first, second))
        row_axis = 2 if self.out_last else 1
        if self.num_heads > 1:
            n = y.shape[row_axis]
            hd = n // self.num_heads
            if self.out_last:  # (B, C, H·hd) → (B, H, C, hd)
                y = y.reshape((y.shape[0], y.shape[1], self.num_heads, hd)).transpose(0, 2, 1, 3)
                y = y.reshape((-1, y.shape[2], hd))
            else:  # (B, H·hd, C) → (B·H, hd, C)
                y = y.reshape((-1, hd, y.shape[2]))
        if len(self.split_sizes) == 1:
            return [y]
        offsets = [0]
        for s in self.split_sizes[:-1]:
            offsets.append(offsets[-1] + s)
        return [jax.lax.slice_in_dim(y, o, o + s, axis=row_axis)
                for o, s in zip(offsets, self.split_sizes)]

    def from_blocks(self, blocks: Sequence[jax.Array], like_shape: tuple[int, ...]) -> jax.Array:
        """Inverse of :meth:`to_blocks`; ``like_shape`` is the leaf (or variance) shape."""
        row_axis = 2 if self.out_last else 1
        y = blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=row_axis)
        if self.num_heads > 1:
            h = self.num_heads
            if self.out_last:  # (B·H, C, hd) → (B, C, H·hd)
                y = y.reshape((-1, h, y.shape[1], y.shape[2])).transpose(0, 2, 1, 3)
                y = y.reshape((y.shape[0], y.shape[1], -1))
            else:  # (B·H, hd, C) → (B, H·hd, C)
                y = y.reshape((-1, h * y.shape[1], y.shape[2]))
        permuted_shape = tuple(like_shape[i] for i in self.perm)
        y = y.reshape(permuted_shape)
        if self.perm != tuple(range(len(like_shape))):
            inv = tuple(sorted(range(len(self.perm)), key=lambda i: self.perm[i]))
            y = jnp.transpose(y, inv)
        return y


def check_num_heads(num_heads, name: str = "") -> int | None:
    """Validates a ``num_heads`` value (None or a positive int)."""
    if num_heads is not None and (not _numbers.is_int(num_heads) or num_heads < 1):
        raise ValueError(f"num_heads must be a positive int or None, got {num_heads=!r}"
                         + (f" for {name}" if name else ""))
    return None if num_heads is None else int(num_heads)


def check_split_sizes(split_sizes, name: str = "") -> tuple[int, ...] | None:
    """Validates a ``split_sizes`` value (None or a sequence of ≥ 2 positive ints)."""
    if split_sizes is None:
        return None
    if (isinstance(split_sizes, (str, bytes)) or not isinstance(split_sizes, Sequence)
            or len(split_sizes) < 2
            or any(not _numbers.is_int(s) or s < 1 for s in split_sizes)):
        raise ValueError(f"split_sizes must be a sequence of ≥ 2 positive ints, got "
                         f"{split_sizes=!r}" + (f" for {name}" if name else ""))
    return tuple(int(s) for s in split_sizes)


def make_layout(shape: tuple[int, ...], dimension_numbers: DimensionNumbers | None = None,
                num_heads: int | None = None, split_sizes: Sequence[int] | None = None,
                name: str = "leaf") -> LeafLayout:
    """Builds the static layout of a leaf.

    Args:
      shape: the leaf's shape (rank ≥ 2).
      dimension_numbers: reduction and output axes (ints or tuples of ints); the remaining axes
        are batch axes. Default: the last two axes are ``(in, out)`` (Flax kernels, stacked
        Flax kernels).
      num_heads: view the output axis as ``num_heads × head_dim`` and treat each head as its own
        matrix (selection, orthogonalization, normalization and learning-rate scale per head).
      split_sizes: cut the output axis into blocks of these sizes, each its own matrix.
      name: used in error messages.

    Returns:
      A :class:`LeafLayout`.

    Raises:
      ValueError: on a rank < 2 leaf, bad axes, or heads / split sizes that do not fit.
    """
    shape = tuple(int(s) for s in shape)
    ndim = len(shape)
    if ndim < 2:
        raise ValueError(
            f"Dion3 orthogonalizes matrices; {name} has {shape=} (rank < 2). Route it to the "
            "scalar optimizer (see dion3_jax.dion3's param_labels).")
    if dimension_numbers is None:
        dimension_numbers = DimensionNumbers(reduction_axis=ndim - 2, output_axis=ndim - 1)
    if not (hasattr(dimension_numbers, "reduction_axis")
            and hasattr(dimension_numbers, "output_axis")):
        raise ValueError(f"dimension numbers for {name} must be a DimensionNumbers, got "
                         f"{dimension_numbers=!r}")
    red = _norm_axes(dimension_numbers.reduction_axis, ndim, "reduction_axis", shape, name)
    out = _norm_axes(dimension_numbers.output_axis, ndim, "output_axis", shape, name)
    if set(red) & set(out):
        raise ValueError(f"reduction and output axes of {name} overlap: {dimension_numbers=} "
                         f"for {shape=}")
    batch = tuple(i for i in range(ndim) if i not in red and i not in out)
    out_last = max(out) > max(red)
    first, second = (red, out) if out_last else (out, red)
    perm = batch + first + second
    n_out = math.prod(shape[i] for i in out)
    if 0 in shape:
        raise ValueError(f"{name} has an empty axis: {shape=}")

    num_heads = check_num_heads(num_heads, name) or 1
    if n_out % num_heads:
        raise ValueError(f"num_heads={num_heads} does not divide the output size {n_out} of "
                         f"{name} ({shape=})")
    rows = n_out // num_heads
    if split_sizes is not None and num_heads > 1:
        raise ValueError(f"num_heads and split_sizes cannot be combined ({name})")
    checked = check_split_sizes(split_sizes, name)
    splits = (rows,) if checked is None else checked
    if sum(splits) != rows:
        raise ValueError(f"split_sizes={splits} must sum to the output size {rows} of {name} "
                         f"({shape=})")
    return LeafLayout(
        shape=shape, perm=perm, batch_shape=tuple(shape[i] for i in batch),
        first_shape=tuple(shape[i] for i in first), second_shape=tuple(shape[i] for i in second),
        out_last=out_last, num_heads=num_heads, split_sizes=splits, reduction_axes=red,
        output_axes=out)


# ---------------------------------------------------------------------------------------------
# Per-leaf options given as one value, a tree (or prefix tree) keyed like the params, or a
# callable params -> tree. Looked up by key path, so masked leaves (optax.partition) are fine.


def _is_spec_leaf(x: Any) -> bool:
    if x is None or isinstance(x, str) or _numbers.is_real(x) or isinstance(x, (bool, np.bool_)):
        return True
    if hasattr(x, "reduction_axis") and hasattr(x, "output_axis"):
        return True
    return isinstance(x, (tuple, list)) and all(_numbers.is_int(v) for v in x)


def is_single_value(spec: Any) -> bool:
    return _is_spec_leaf(spec)


def per_leaf(spec: Any, tree: Any, missing: Any = None) -> Callable[[tuple], Any]:
    """Returns ``lookup(path) -> value`` for a per-leaf option.

    ``spec`` is a single value (applies to every leaf), a callable ``tree -> spec tree``, or a
    tree whose structure is a prefix of ``tree``'s (the value at the longest matching path
    applies). A leaf that the spec does not cover gets ``missing`` (default ``None``).
    """
    if callable(spec) and not is_single_value(spec):
        spec = spec(tree)
    if is_single_value(spec):
        return lambda path: spec
    flat, _ = jax.tree_util.tree_flatten_with_path(spec, is_leaf=_is_spec_leaf)
    table = {tuple(path): value for path, value in flat}

    def lookup(path):
        path = tuple(path)
        for i in range(len(path), -1, -1):
            if path[:i] in table:
                return table[path[:i]]
        return missing

    return lookup


def path_str(path) -> str:
    return jax.tree_util.keystr(tuple(path)) or "<root>"

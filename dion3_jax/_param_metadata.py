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
"""The parameters' per-leaf metadata on the per-row state (Flax NNX Variables).

Dion3's state mirrors the parameter tree. Flax NNX wraps each parameter in an ``nnx.Variable``,
a pytree node whose metadata describes its array: ``out_sharding`` names a mesh or logical axis
per dimension (``nnx.with_partitioning``). A state tree built with the parameters' structure
carries that metadata on every leaf. The momentum has the parameter's shape, so the metadata
fits it; the second moments and row factors have the reduction axes reduced to size 1, and a
name there would shard an axis of size 1. ``nnx.Optimizer`` rebuilds every state Variable from
its metadata and shards its value eagerly, which then fails (``("fsdp", None)`` on an
``(in, out)`` kernel: the ``(1, out)`` state cannot be split 4 ways along axis 0). The per-row
state's Variables therefore carry their parameter's metadata with the reduction axes'
``out_sharding`` entries set to None, and a float16 momentum's storage bounds (one scalar per
parameter) carry an empty ``out_sharding``: ``nnx.get_partition_spec`` of the optimizer state
is right, and any optax chain containing Dion3 builds in ``nnx.Optimizer``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import sys

import jax
from jax.sharding import NamedSharding, PartitionSpec as P


def _variable_type() -> type | None:
    """Flax NNX's ``Variable`` class, if Flax is loaded (a tree holding Variables loaded it)."""
    return getattr(sys.modules.get("flax.nnx.variablelib"), "Variable", None)


def _without_axes(sharding, axes: Sequence[int]):
    """``sharding`` (names per dimension, a ``PartitionSpec`` or a ``NamedSharding``) with the
    entries of ``axes`` set to None."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, _without_axes(sharding.spec, axes))
    entries = tuple(None if i in axes else e for i, e in enumerate(sharding))
    return P(*entries) if isinstance(sharding, P) else entries


def _drop_reduced(variable, axes: Sequence[int]):
    sharding = variable.get_metadata().get("out_sharding")
    if not sharding or not axes:
        return variable
    return variable.replace(out_sharding=_without_axes(sharding, axes))


def _scalar(sharding):
    """``sharding`` for a scalar: no entries (a ``NamedSharding`` keeps its mesh)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P())
    return P() if isinstance(sharding, P) else ()


def _state_tree(params, arrays: Sequence[jax.Array], relabel: Callable):
    """The tree of ``params`` with leaves ``arrays`` (one per parameter, in flattening order),
    each Flax Variable node holding one array passed through ``relabel(variable, index)``."""
    variable = _variable_type()
    if variable is None:
        return jax.tree.unflatten(jax.tree.structure(params), arrays)
    nodes, outer = jax.tree.flatten(params, is_leaf=lambda x: isinstance(x, variable))
    leaves = iter(enumerate(arrays))
    out = []
    for node in nodes:
        if not isinstance(node, variable):
            out.append(next(leaves)[1])
            continue
        items = [next(leaves) for _ in jax.tree.leaves(node)]
        new = jax.tree.unflatten(jax.tree.structure(node), [a for _, a in items])
        out.append(relabel(new, items[0][0]) if len(items) == 1 else new)
    return jax.tree.unflatten(outer, out)


def row_state_tree(params, arrays: Sequence[jax.Array],
                   reduction_axes: Sequence[Sequence[int]]):
    """The tree of ``params`` with leaves ``arrays`` (the per-row state, one per parameter, in
    flattening order), each Flax Variable node given its parameter's metadata less the
    sharding of that parameter's ``reduction_axes``.

    Args:
      params: the parameter tree the state mirrors (dicts, ``nnx.State``, any pytree).
      arrays: the state's leaves, ``params``' leaves with their reduction axes of size 1.
      reduction_axes: per leaf, the axes reduced to size 1.

    Returns:
      The state tree, with the structure of ``params``.
    """
    if len(arrays) != len(reduction_axes):
        raise ValueError(f"{len(arrays)} arrays for {len(reduction_axes)} reduction axes")
    return _state_tree(params, arrays, lambda v, i: _drop_reduced(v, reduction_axes[i]))


def scalar_state_tree(params, arrays: Sequence[jax.Array]):
    """The tree of ``params`` with scalar leaves ``arrays`` (one per parameter, in flattening
    order; e.g. a float16 momentum's storage bound), each Flax Variable node given its
    parameter's metadata with an empty sharding: a parameter's per-dimension names would not
    fit a scalar, and ``nnx.Optimizer`` shards each state Variable by them."""
    def relabel(variable, _):
        sharding = variable.get_metadata().get("out_sharding")
        return variable.replace(out_sharding=_scalar(sharding)) if sharding else variable
    return _state_tree(params, arrays, relabel)

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
"""Named types of the public signatures.

A per-leaf option (``dimension_numbers``, ``num_heads``, ``split_sizes``, masks, labels,
``MeshOptions.param_specs``) is given as one value for every leaf, as a tree (or a prefix
tree) of values shaped like the params, or as a callable mapping the params to such a tree,
as optax's masks and ``optax.partition``'s labels are.
"""

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Literal

import jax
import optax

#: A parameter tree (``optax.Params``: arrays in dicts, lists, ``nnx.State``, any pytree).
type Params = optax.Params
#: An optimizer state (``optax.OptState``).
type OptState = optax.OptState
#: A tree of ``T`` values: a value, or containers of trees.
type Tree[T] = T | Iterable[Tree[T]] | Mapping[Hashable, Tree[T]]
#: A per-leaf option: one value, a (prefix) tree of values, or a callable params → tree.
type PerLeaf[T] = Tree[T] | Callable[[Params], Tree[T]]
#: A mask, as optax's ``mask=``: ``True`` where the transformation applies.
type Mask = PerLeaf[bool]
#: Where a leaf goes: Dion3 or the scalar optimizer (``optax.partition``'s labels).
type Label = Literal["dion3", "scalar"]
#: A device mesh, concrete or abstract.
type AnyMesh = jax.sharding.Mesh | jax.sharding.AbstractMesh

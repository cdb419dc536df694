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
"""Skipping steps whose gradients are not finite, for optimizers whose updates do not share
their gradients' dtype.

Dion3's matrices get float32 updates from 16-bit gradients, so that the new parameter is rounded
once (:func:`dion3_jax.dion3`). ``optax.apply_if_finite`` answers a skipped step with zeros in
the gradients' dtype, and the two branches of its ``lax.cond`` then differ in type: around a
Dion3 optimizer of bfloat16 or float16 parameters it fails to trace. :func:`apply_if_finite`
keeps optax's rule and state and answers with zeros in the dtypes of the inner updates.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import optax

from dion3_jax import _numbers


def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)],
                               dtype=jnp.bool_))


def apply_if_finite(inner: optax.GradientTransformation, max_consecutive_errors: int
                    ) -> optax.GradientTransformationExtraArgs:
    """``optax.apply_if_finite`` for updates whose dtypes differ from the gradients'.

    A step whose gradients hold a NaN or an infinity is skipped: the update is zero and the inner
    state is left as it was, unless more than ``max_consecutive_errors`` such steps came in a row,
    and then the step is applied. The state is ``optax.ApplyIfFiniteState`` and the rule is
    optax's; only the skipped step's zeros differ, which take the dtype of the inner update of
    each leaf (float32 for Dion3's 16-bit matrices) rather than the gradient's, so that the
    transformation traces with bfloat16 and float16 parameters too. For float32 parameters it
    gives what ``optax.apply_if_finite`` gives.

    Args:
      inner: the transformation to guard, e.g. :func:`dion3_jax.dion3`.
      max_consecutive_errors: how many non-finite steps in a row are skipped (a non-negative
        integer); the next one is applied.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Raises:
      ValueError: ``max_consecutive_errors`` is not a non-negative integer.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import dion3_jax
      >>> params = {"kernel": jnp.ones((32, 64), jnp.bfloat16)}
      >>> tx = dion3_jax.apply_if_finite(dion3_jax.dion3(0.02), max_consecutive_errors=3)
      >>> nan = {"kernel": jnp.full((32, 64), jnp.nan, jnp.bfloat16)}
      >>> updates, state = jax.jit(tx.update)(nan, tx.init(params), params)
      >>> u = updates["kernel"]
      >>> int(state.notfinite_count), u.dtype, float(jnp.abs(u).max())
      (1, dtype('float32'), 0.0)
    """
    if not _numbers.is_int(max_consecutive_errors) or max_consecutive_errors < 0:
        raise ValueError("max_consecutive_errors must be a non-negative integer, got "
                         f"max_consecutive_errors={max_consecutive_errors!r}")
    limit = int(max_consecutive_errors)
    inner = optax.with_extra_args_support(inner)

    def init(params):
        return optax.ApplyIfFiniteState(
            notfinite_count=jnp.zeros([], jnp.int32), last_finite=jnp.array(True, jnp.bool_),
            total_notfinite=jnp.zeros([], jnp.int32), inner_state=inner.init(params))

    def update(updates, state, params=None, **extra_args):
        finite = _all_finite(updates)
        count = jnp.where(finite, jnp.zeros([], jnp.int32),
                          optax.safe_increment(state.notfinite_count))

        dtypes = []   # the inner updates' dtypes, recorded when lax.cond traces `apply`

        def apply(_):
            out = inner.update(updates, state.inner_state, params, **extra_args)
            dtypes.append(jax.tree.map(lambda u: u.dtype, out[0]))
            return out

        def skip(_):
            if not dtypes:   # lax.cond traces `apply` first; if it did not, trace it here
                jax.eval_shape(apply, None)
            return (jax.tree.map(lambda g, d: jnp.zeros_like(g, dtype=d), updates, dtypes[0]),
                    state.inner_state)

        new_updates, inner_state = lax.cond(finite | (count > limit), apply, skip, None)
        return new_updates, optax.ApplyIfFiniteState(
            notfinite_count=count, last_finite=finite,
            total_notfinite=jnp.where(finite, state.total_notfinite,
                                      optax.safe_increment(state.total_notfinite)),
            inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init, update)

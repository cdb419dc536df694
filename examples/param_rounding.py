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
"""How the quality study stores 16-bit parameters and adds the optimizer's update to them.

The library keeps a 16-bit matrix's update in float32 and lets ``optax.apply_updates`` round
the sum once (``docs/HYPERPARAMETERS.md``, "Low-precision parameters"). The study compares
that with the older behavior, an update rounded to the parameter's dtype before the sum (two
roundings), and with float32 master weights. The older behavior exists here only, as a study
variant: the library has no switch for it.

Variants (``--param-dtype``, ``--rounding``):

- ``float32`` / ``once``: float32 parameters (the master weights), bfloat16 activations.
- ``bfloat16`` / ``once``: bfloat16 parameters; new ``W`` = bf16(W + u), u the float32 update.
- ``bfloat16`` / ``twice``: bfloat16 parameters; new ``W`` = bf16(W + bf16(u)).

With 16-bit parameters every optimizer runs on float32 copies of the gradients and the
parameters (:func:`float32_view`), so its state and its update are float32 in both 16-bit
variants and the two differ only in the rounding of the update. For Dion3's and NorMuon's
matrices the library itself returns float32 updates for 16-bit leaves, and the study names
Dion3's momentum dtype (``mu_dtype``, float32 unless a run says otherwise), so the view keeps
it; left to its default, 16-bit leaves would get a float16 momentum and the view's float32
copies a float32 one. For ``optax.adamw`` and the AdamW branch the view gives float32 moments,
where optax alone would keep them in the parameter's dtype.
"""

from __future__ import annotations

PARAM_DTYPES = ("float32", "bfloat16")
ROUNDINGS = ("once", "twice")
#: (param_dtype, rounding) of the rounding plan, in the order the report shows them.
VARIANTS = (("float32", "once"), ("bfloat16", "once"), ("bfloat16", "twice"))


def variant_name(param_dtype: str, rounding: str) -> str:
    """The report's name of a variant."""
    if param_dtype == "float32":
        return "float32 master weights"
    return f"{param_dtype} params, rounded {rounding}"


def config_suffix(run: dict) -> str:
    """What a run's configuration name adds for its parameter storage ("" for float32)."""
    if run.get("param_dtype", "float32") == "float32":
        return ""
    return f", {run['param_dtype']} params rounded {run['rounding']}"


def cast_params(params, param_dtype: str):
    """``params`` (a pytree of float32 arrays) stored in ``param_dtype``."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(param_dtype)
    return jax.tree.map(lambda x: x.astype(dtype), params)


def float32_view(tx):
    """``tx`` run on float32 copies of the gradients and the parameters.

    Its state is initialized from float32 parameters, so its moments are float32 and so are the
    updates it returns; a no-op for float32 parameters.
    """
    import jax
    import jax.numpy as jnp
    import optax

    up = lambda tree: jax.tree.map(lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32)),
                                   tree)

    def update_fn(updates, state, params=None, **extra):
        return tx.update(up(updates), state, None if params is None else up(params), **extra)

    return optax.GradientTransformationExtraArgs(lambda params: tx.init(up(params)), update_fn)


def apply_updates(params, updates, rounding: str):
    """``params + updates`` in each parameter's dtype, rounded ``once`` or ``twice``.

    ``once``: ``optax.apply_updates``, which adds the (float32) update in float32 and rounds the
    sum to the parameter's dtype. ``twice``: the update is first rounded to the parameter's
    dtype, as an optimizer that returns updates in the parameter's dtype does.

    Raises:
      ValueError: ``rounding`` is neither ``"once"`` nor ``"twice"``.
    """
    import jax
    import optax

    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if rounding == "twice":
        updates = jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params)
    return optax.apply_updates(params, updates)

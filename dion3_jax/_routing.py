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
"""Which leaves Dion3 orthogonalizes, which go to the scalar optimizer, and which it refuses.

The rules, for each leaf, first match wins (``dimension_numbers`` as given to :func:`dion3`):

1. rank < 2 (scalars, Python floats, vectors): scalar optimizer.
2. a path component names a per-feature parameter (:data:`DEFAULT_VECTOR_PATTERN`: ``bias``,
   ``scale``, ``gamma``, norm layers, Mamba's ``A_log`` and ``D``, ...): scalar optimizer,
   whatever the rank, so that stacked biases ``(layers, out)`` are never orthogonalized.
3. a path component names an embedding (token or position) or the output head
   (:data:`DEFAULT_SCALAR_PATTERN`): scalar optimizer.

A pattern names a component when it matches the whole component (``re.fullmatch``, ignoring
case): ``norm`` and ``q_norm`` are norm layers, ``abnormal_proj`` is not.
4. ``dimension_numbers`` given as a tree or a callable: a ``DimensionNumbers`` means Dion3,
   ``None`` the scalar optimizer.
5. rank 2: Dion3 (a Flax ``(in, out)`` kernel).
6. rank ≥ 3: Dion3 when one ``DimensionNumbers`` is given for all leaves; otherwise refused. A
   ``(layers, in, out)`` stack and a ``(embed, heads, head_dim)`` attention kernel look alike,
   and neither Flax's NNX state nor Linen's params record which axes ``nnx.vmap``,
   ``nnx.scan`` or ``nn.scan`` added, so the user has to say.

``dimension_numbers`` says how to view a leaf, never overriding rules 1–3; ``param_labels``
(a tree or callable of labels given to :func:`dion3`) replaces all of these rules. Also refused:
a tree with Linen auto-named layers (``Dense_0``, ``DenseGeneral_1``, ...) that are headed for
Dion3 while no leaf is named like a head (:data:`DEFAULT_HEAD_PATTERN`) or sent to the scalar
optimizer by a ``None`` in a ``dimension_numbers`` tree: the output head cannot be told from the
hidden layers. Refusals raise one ``ValueError`` at ``init`` that names the leaves and shows the
fixes; :func:`routing_table` prints what the rules decide.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import jax
import numpy as np

from dion3_jax import _layout
from dion3_jax._layout import DimensionNumbers
from dion3_jax._types import Label, Params, PerLeaf, Tree

DION3_LABEL = "dion3"
SCALAR_LABEL = "scalar"
# Every pattern is matched against whole key-path components (``re.fullmatch``, ignoring case):
# ``norm`` names a norm layer, ``abnormal_proj`` is not one. ``(\w+_)?`` and ``(_\w+)?`` allow
# underscore-joined words before and after (``q_norm``, ``norm_out``, ``token_embedding``).
#: Path components that mark an embedding (token or position) or an output head.
DEFAULT_SCALAR_PATTERN = (
    r"(\w+_)?(embed|embeds|embedding|embeddings|embedder|emb)(_\w+)?"
    r"|wte|wpe|(\w+_)?pos(ition(al)?)?_enc(oding)?s?|rel_pos(_\w+)?"
    r"|lm_head|head|unembed\w*|classifier")
#: The output-head part of :data:`DEFAULT_SCALAR_PATTERN` (used to check that a head is named).
DEFAULT_HEAD_PATTERN = r"lm_head|head|unembed\w*|classifier"
#: Path components that mark a per-feature parameter (biases, gains, norm layers, tokens, and
#: state-space parameters that are not linear maps: Mamba's ``A_log``, ``D``, ``dt_bias``), any
#: rank.
DEFAULT_VECTOR_PATTERN = (
    r"(\w+_)?bias(es)?(_\w+)?|b|(\w+_)?scales?|offset|gamma|beta|g"
    r"|(\w+_)?(layer|rms|batch|group|instance)?_?norm(\d+|_\w+)?|ln(\d+|f|_\w+)?|bn(_?\d+)?"
    r"|temperature|alpha|lambdas?|mean|var|(\w+_)?tokens?|cls"
    r"|a_log|d")
#: Linen's automatic module names, which do not say which dense layer is the output head.
AUTO_NAME_PATTERN = r"^(Dense|DenseGeneral|Einsum)_\d+$"
_MAX_LISTED = 8


class Route(NamedTuple):
    """Where one leaf goes.

    Attributes:
      path: the leaf's key path.
      shape: its shape (``()`` for Python scalars).
      label: ``"dion3"``, ``"scalar"``, or ``None`` when refused.
      rule: why, in a few words.
    """

    path: tuple
    shape: tuple[int, ...]
    label: str | None
    rule: str


def _key_name(key: Any) -> str:
    """A key path entry's name: a dict key, an attribute name or a sequence index."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _module_path(path: tuple) -> tuple:
    """``path`` without the trailing ``.value`` of NNX Variables and Linen boxes."""
    path = tuple(path)
    while len(path) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey) and (
            path[-1].name == "value"):
        path = path[:-1]
    return path


def leaf_name(path: tuple) -> str:
    """A key path as it reads in messages and tables: ``['blocks']['mlp']['kernel']``."""
    return _layout.path_str(_module_path(path))


def _shape(leaf: Any) -> tuple[int, ...]:
    """A leaf's shape: arrays, ``ShapeDtypeStruct``s, tracers and Python scalars (``()``)."""
    shape = getattr(leaf, "shape", None)
    return tuple(int(s) for s in (np.shape(leaf) if shape is None else shape))


def _explicit(dimension_numbers: Any) -> bool:
    """True when ``dimension_numbers`` is a tree or a callable (rule 4 of the module)."""
    return dimension_numbers is not None and (
        callable(dimension_numbers) or not _layout.is_single_value(dimension_numbers))


def _match(pattern: re.Pattern | None, names: list[str]) -> str | None:
    """The first of ``names`` (path components) that ``pattern`` matches as a whole
    (``None``: none, or no pattern)."""
    if pattern is None:
        return None
    return next((n for n in names if pattern.fullmatch(n)), None)


def _route(path, leaf, dims, lookup, patterns) -> Route:
    """One leaf's route under the module's rules (see the module docstring)."""
    shape = _shape(leaf)
    names = [_key_name(k) for k in _module_path(path)]
    vector, scalar, head = patterns
    if len(shape) < 2:
        return Route(path, shape, SCALAR_LABEL, f"rank {len(shape)}")
    if (name := _match(vector, names)) is not None:
        return Route(path, shape, SCALAR_LABEL, f"vector name {name!r}")
    if (name := _match(scalar, names) or _match(head, names)) is not None:
        return Route(path, shape, SCALAR_LABEL, f"embedding/head name {name!r}")
    if lookup is not None:
        dn = lookup(path)
        return Route(path, shape, SCALAR_LABEL if dn is None else DION3_LABEL,
                     "dimension_numbers" + ("=None" if dn is None else ""))
    if len(shape) == 2:
        return Route(path, shape, DION3_LABEL, "matrix")
    if dims is not None:
        return Route(path, shape, DION3_LABEL, "dimension_numbers")
    return Route(path, shape, None, f"rank {len(shape)}: axes unknown")


def classify(params: Any, dimension_numbers: Any = None,
             scalar_pattern: str = DEFAULT_SCALAR_PATTERN, *,
             vector_pattern: str | None = DEFAULT_VECTOR_PATTERN,
             head_pattern: str | None = DEFAULT_HEAD_PATTERN) -> list[Route]:
    """Routes every leaf of ``params`` (refused leaves get ``label=None``); nothing raises.

    Args:
      params: the parameter tree (dicts, ``nnx.State``, any pytree).
      dimension_numbers: as in :func:`dion3_jax.dion3`.
      scalar_pattern, vector_pattern, head_pattern: as in :func:`default_param_labels`.

    Returns:
      One :class:`Route` per leaf, in ``jax.tree_util.tree_flatten_with_path`` order.
    """
    compile_ = lambda p: None if p is None else re.compile(p, re.IGNORECASE)
    patterns = (compile_(vector_pattern), compile_(scalar_pattern), compile_(head_pattern))
    lookup = (_layout.per_leaf(dimension_numbers, params) if _explicit(dimension_numbers)
              else None)
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    routes = [_route(path, leaf, dimension_numbers, lookup, patterns) for path, leaf in flat]
    if patterns[2] is not None:   # head_pattern given
        routes = _refuse_unnamed_head(routes, patterns[2])
    return routes


def _refuse_unnamed_head(routes: list[Route], head: re.Pattern) -> list[Route]:
    """Marks the auto-named Dion3 leaves refused when no leaf is named like a head.

    A leaf that a ``dimension_numbers`` tree sends to the scalar optimizer (``None``) counts as
    a named head: the user has said where it goes.
    """
    auto = re.compile(AUTO_NAME_PATTERN)
    if any(_match(head, [_key_name(k) for k in r.path]) or r.rule == "dimension_numbers=None"
           for r in routes):
        return routes
    out = []
    for r in routes:
        name = _match(auto, [_key_name(k) for k in r.path])
        if r.label == DION3_LABEL and name is not None:
            r = r._replace(label=None, rule=f"auto-named {name!r}, no head named")
        out.append(r)
    return out


def _listed(routes: list[Route]) -> str:
    """The refused leaves, one ``path  shape=...`` line each (at most ``_MAX_LISTED``)."""
    lines = [f"    {leaf_name(r.path)}  shape={r.shape}" for r in routes[:_MAX_LISTED]]
    if len(routes) > _MAX_LISTED:
        lines.append(f"    ... and {len(routes) - _MAX_LISTED} more")
    return "\n".join(lines)


def _rank_message(refused: list[Route]) -> str:
    """The error text for rank ≥ 3 leaves whose axes nobody gave."""
    return (
        "dion3_jax cannot tell how to view these rank ≥ 3 leaves as matrices: a stack of "
        "(in, out) kernels (nnx.vmap / nnx.scan / nn.scan blocks, MoE experts) and a "
        "multi-axis kernel such as DenseGeneral's (embed, heads, head_dim) look alike.\n"
        f"{_listed(refused)}\n"
        "  Say which, in dion3_jax.dion3(...):\n"
        "  - stacked (..., in, out) kernels, each leading index its own matrix:\n"
        "      dimension_numbers=dion3_jax.DimensionNumbers(reduction_axis=-2, output_axis=-1)\n"
        "  - one (embed, heads, head_dim) kernel, a single embed -> heads*head_dim matrix:\n"
        "      dimension_numbers=dion3_jax.DimensionNumbers(reduction_axis=0, output_axis=(1, 2))"
        "\n  - both kinds in one model: a tree or callable of DimensionNumbers (None sends a "
        "leaf\n    to the scalar optimizer); recipes in docs/ROUTING.md.\n"
        "  Check the result with print(dion3_jax.routing_table(params, dimension_numbers=...)).")


def _head_candidate(refused: list[Route]) -> str:
    """The auto-named layer most likely to be the head: shallowest, then highest-numbered."""
    found = []
    for r in refused:
        names = [_key_name(k) for k in r.path]
        depth, name = next((i, n) for i, n in enumerate(names) if re.match(AUTO_NAME_PATTERN, n))
        found.append((depth, -int(name.rsplit("_", 1)[1]), name))
    return min(found)[2]


def _head_message(refused: list[Route]) -> str:
    """The error text for Linen auto-named layers when no head is named."""
    autos = sorted({n for r in refused for n in map(_key_name, r.path)
                    if re.match(AUTO_NAME_PATTERN, n)}, key=lambda n: int(n.rsplit("_", 1)[1]))
    last = _head_candidate(refused)
    return (
        "dion3_jax cannot tell the output head from the hidden layers: the tree has Linen "
        f"auto-named layers ({', '.join(autos)}) and no leaf named like a head (lm_head, head, "
        "unembed..., classifier); orthogonalizing the head hurts.\n"
        f"{_listed(refused)}\n"
        "  Fixes:\n"
        '  - name the head: nn.Dense(vocab_size, name="head") (or "lm_head", "classifier")\n'
        f"  - or say which layer it is (here, if {last} is the head; add your "
        "dimension_numbers\n    as the second argument if you give one):\n"
        "      param_labels=lambda p: dion3_jax.default_param_labels("
        f'p, head_pattern="^{last}$")\n'
        "  - no separate head (tied embedding): param_labels=lambda p: "
        "dion3_jax.default_param_labels(p, head_pattern=None)")


def check_routes(routes: list[Route]) -> None:
    """Raises when :func:`classify` refused a leaf.

    Args:
      routes: the output of :func:`classify`.

    Raises:
      ValueError: naming every refused leaf (path and shape) and the one-line fixes.
    """
    refused = [r for r in routes if r.label is None]
    ranks = [r for r in refused if r.rule.endswith("axes unknown")]
    heads = [r for r in refused if r not in ranks]
    parts = ([_rank_message(ranks)] if ranks else []) + ([_head_message(heads)] if heads else [])
    if parts:
        raise ValueError("\n\n".join(parts))


def default_param_labels(params: Params,
                         dimension_numbers: PerLeaf[DimensionNumbers | None] | None = None,
                         scalar_pattern: str = DEFAULT_SCALAR_PATTERN, *,
                         vector_pattern: str | None = DEFAULT_VECTOR_PATTERN,
                         head_pattern: str | None = DEFAULT_HEAD_PATTERN) -> Tree[Label]:
    """Labels each leaf ``"dion3"`` or ``"scalar"``, or refuses (see :mod:`dion3_jax._routing`).

    In short: rank < 2 leaves, leaves named like biases / norm scales (any rank) and embeddings
    or heads (by name) go to the scalar optimizer; then a ``dimension_numbers`` tree or callable
    decides (``None``: scalar); otherwise 2-D leaves go to Dion3, and rank ≥ 3 leaves only when
    one ``DimensionNumbers`` is given for all (else refused).

    Args:
      params: the parameter tree (dicts, ``nnx.State``, any pytree).
      dimension_numbers: as in :func:`dion3_jax.dion3`.
      scalar_pattern: regular expression matched (case-insensitively) against each whole path
        component (``re.fullmatch``); a match marks an embedding or head (scalar optimizer).
      vector_pattern: likewise for per-feature vectors (scalar optimizer at any rank);
        ``None`` turns the rule off.
      head_pattern: likewise for the output head (scalar optimizer); also used to refuse trees
        with Linen auto-named layers and no named head. ``None`` turns that check off (tied
        embeddings: no head layer).

    Returns:
      A tree of labels with the structure of ``params``.

    Raises:
      ValueError: for rank ≥ 3 leaves whose axes are not given, and for Linen auto-named layers
        without a named head; the message names the leaves and gives the fixes.

    Examples:
      >>> import jax.numpy as jnp, dion3_jax
      >>> dion3_jax.default_param_labels({"w": jnp.ones((4, 8)), "bias": jnp.ones((3, 8))})
      {'bias': 'scalar', 'w': 'dion3'}
    """
    routes = classify(params, dimension_numbers, scalar_pattern, vector_pattern=vector_pattern,
                      head_pattern=head_pattern)
    check_routes(routes)
    treedef = jax.tree_util.tree_structure(params)
    return jax.tree_util.tree_unflatten(treedef, [r.label for r in routes])


def _given_routes(params: Any, param_labels: Any) -> list[Route]:
    """Routes from user labels (a tree, a prefix tree or a callable), as ``optax.partition``."""
    labels = param_labels(params) if callable(param_labels) else param_labels
    full = jax.tree.map(lambda lab, sub: jax.tree.map(lambda _: lab, sub), labels, params)
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    routes = []
    for (path, leaf), lab in zip(flat, jax.tree.leaves(full), strict=True):
        if lab not in (DION3_LABEL, SCALAR_LABEL):
            raise ValueError(f"param_labels gives {leaf_name(path)} the label {lab!r}; expected "
                             f"{DION3_LABEL!r} or {SCALAR_LABEL!r}")
        routes.append(Route(path, _shape(leaf), lab, "param_labels"))
    return routes


def _matrices(route: Route, dn, nh, ss) -> str:
    """``count × rows×cols`` for each block of a Dion3 leaf (rows = outputs)."""
    if route.label != DION3_LABEL:
        return "-"
    lay = _layout.make_layout(route.shape, dn(route.path), nh(route.path), ss(route.path),
                              name=leaf_name(route.path))
    return " + ".join(f"{b.batch} × {b.n}×{b.c}" for b in lay.blocks)


def _format(header: tuple, rows: list[tuple]) -> str:
    """Left-aligned columns two spaces apart, with a rule under the header."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *map(line, rows)])


def routing_table(params: Params, *,
                  dimension_numbers: PerLeaf[DimensionNumbers | None] | None = None,
                  num_heads: PerLeaf[int | None] | None = None,
                  split_sizes: PerLeaf[tuple[int, ...] | None] | None = None,
                  param_labels: PerLeaf[Label] | None = None) -> str:
    """The routing :func:`dion3_jax.dion3` applies to ``params``, as a table.

    Pass the same ``dimension_numbers``, ``num_heads``, ``split_sizes`` and ``param_labels`` as
    to :func:`dion3_jax.dion3`: the table comes from the same functions (:func:`classify` and
    the check of :func:`default_param_labels`, then ``make_layout`` per leaf), so it raises
    exactly when ``init`` would.

    Args:
      params: the parameter tree (dicts, ``nnx.State`` e.g. ``nnx.state(model, nnx.Param)``,
        any pytree).
      dimension_numbers, num_heads, split_sizes, param_labels: as in :func:`dion3_jax.dion3`.

    Returns:
      One line per leaf: path, shape, optimizer (``dion3`` / ``scalar``), the matrices Dion3
      sees (``count × rows×cols``, rows = outputs, one term per ``split_sizes`` block) and the
      rule that decided; then a line of totals.

    Raises:
      ValueError: as :func:`default_param_labels` (refused leaves) or ``init`` (bad layouts).

    Examples:
      >>> import jax.numpy as jnp, dion3_jax
      >>> params = {"blocks": {"kernel": jnp.ones((3, 4, 8)), "bias": jnp.ones((3, 8))}}
      >>> dn = dion3_jax.DimensionNumbers(reduction_axis=-2, output_axis=-1)
      >>> print(dion3_jax.routing_table(params, dimension_numbers=dn))
      path                  shape      optimizer  matrices (count × rows×cols)  rule
      --------------------  ---------  ---------  ----------------------------  ------------------
      ['blocks']['bias']    (3, 8)     scalar     -                             vector name 'bias'
      ['blocks']['kernel']  (3, 4, 8)  dion3      3 × 8×4                       dimension_numbers
      dion3: 1 leaf, 96 parameters; scalar: 1 leaf, 24 parameters
    """
    if param_labels is None:
        routes = classify(params, dimension_numbers)
        check_routes(routes)
    else:
        routes = _given_routes(params, param_labels)
    dn, nh, ss = (_layout.per_leaf(v, params) for v in (dimension_numbers, num_heads,
                                                         split_sizes))
    rows = [(leaf_name(r.path), str(r.shape), r.label, _matrices(r, dn, nh, ss), r.rule)
            for r in routes]
    header = ("path", "shape", "optimizer", "matrices (count × rows×cols)", "rule")
    totals = {lab: [math.prod(r.shape) for r in routes if r.label == lab]
              for lab in (DION3_LABEL, SCALAR_LABEL)}
    footer = "; ".join(f"{lab}: {len(v)} lea{'f' if len(v) == 1 else 'ves'}, {sum(v)} parameters"
                       for lab, v in totals.items())
    return _format(header, rows) + "\n" + footer

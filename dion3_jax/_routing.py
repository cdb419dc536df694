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

What the user declares decides; the name rules guess only for the leaves left undeclared. For
each leaf (``param_labels`` and ``dimension_numbers`` as given to :func:`dion3`):

1. ``param_labels`` (a tree or callable of labels): its label decides every leaf (this module's
   rules do not run; ``_alias`` hands the labels to ``optax.partition`` as they are).
2. ``dimension_numbers`` given as a tree (or prefix tree) or a callable, and it covers the
   leaf: the leaf is *declared*. ``None`` sends it to the scalar optimizer and a
   ``DimensionNumbers`` to Dion3, whatever its name says. A ``DimensionNumbers`` for a leaf of
   rank < 2 or a complex leaf is refused: neither is a real matrix.
3. Otherwise (leaves the tree does not cover; one ``DimensionNumbers`` for all leaves only says
   how to view them), the name rules, first match wins:

   a. rank < 2 (scalars, Python floats, vectors): scalar optimizer.
   b. a path component names a per-feature parameter (:data:`DEFAULT_VECTOR_PATTERN`: ``bias``,
      ``scale``, ``gamma``, norm layers, Mamba's ``A_log``, ...): scalar optimizer, whatever
      the rank, so that stacked biases ``(layers, out)`` are never orthogonalized.
   c. a path component names an embedding (token or position) or the output head
      (:data:`DEFAULT_SCALAR_PATTERN`): scalar optimizer.
   d. a path component is one of the one-letter names ``b``, ``d``, ``g`` (either case):
      refused. They name biases and gains in some libraries (Haiku's ``b``, Mamba's ``D``) and
      matrices in others (LoRA's ``B``); a one-letter name is no evidence either way.
   e. a complex leaf: refused (Dion3 orthogonalizes real matrices).
   f. rank 2: Dion3 (a Flax ``(in, out)`` kernel).
   g. rank ≥ 3: Dion3 when one ``DimensionNumbers`` is given for all leaves; otherwise
      refused. A ``(layers, in, out)`` stack and a ``(embed, heads, head_dim)`` attention kernel
      look alike, and neither Flax's NNX state nor Linen's params record which axes
      ``nnx.vmap``, ``nnx.scan`` or ``nn.scan`` added, so the user has to say.

A pattern names a component when it matches the whole component (``re.fullmatch``, ignoring
case): ``norm`` and ``q_norm`` are norm layers, ``abnormal_proj`` is not. Also refused: a tree
with Linen auto-named layers (``Dense_0``, ``DenseGeneral_1``, ...) that rules 3f/3g send to
Dion3 while no leaf is named like a head (:data:`DEFAULT_HEAD_PATTERN`) or sent to the scalar
optimizer by a ``None`` in a ``dimension_numbers`` tree: the output head cannot be told from the
hidden layers. Refusals raise one ``ValueError`` at ``init`` that names every refused leaf and
shows the fixes; :func:`routing_table` prints what the rules decide.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
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
#: state-space parameters that are not linear maps: Mamba's ``A_log``, ``dt_bias``), any rank.
DEFAULT_VECTOR_PATTERN = (
    r"(\w+_)?bias(es)?(_\w+)?|(\w+_)?scales?|offset|gamma|beta"
    r"|(\w+_)?(layer|rms|batch|group|instance)?_?norm(\d+|_\w+)?|ln(\d+|f|_\w+)?|bn(_?\d+)?"
    r"|temperature|alpha|lambdas?|mean|var|(\w+_)?tokens?|cls"
    r"|a_log")
#: One-letter names that libraries give both to per-feature parameters (Haiku's bias ``b``, a
#: weight norm's gain ``g``, Mamba's skip ``D``) and to matrices (LoRA's ``B``): an undeclared
#: leaf of rank ≥ 2 under one of them is refused rather than guessed.
_ONE_LETTER_PATTERN = r"[bdg]"
#: Linen's automatic module names, which do not say which dense layer is the output head.
AUTO_NAME_PATTERN = r"^(Dense|DenseGeneral|Einsum)_\d+$"
_MAX_LISTED = 8
_ONE_LETTER = re.compile(_ONE_LETTER_PATTERN, re.IGNORECASE)


class Route(NamedTuple):
    """Where one leaf goes.

    Attributes:
      path: the leaf's key path.
      shape: its shape (``()`` for Python scalars).
      label: ``"dion3"``, ``"scalar"``, or ``None`` when refused.
      rule: why, in a few words.
      refusal: for a refused leaf, which message of :func:`check_routes` names it (``"axes"``,
        ``"one_letter"``, ``"declared_vector"``, ``"complex"``, ``"head"``); else ``None``.
      declared: whether a ``dimension_numbers`` tree or callable decided the leaf.
    """

    path: tuple
    shape: tuple[int, ...]
    label: str | None
    rule: str
    refusal: str | None = None
    declared: bool = False


#: What a ``dimension_numbers`` tree gives a leaf it does not cover (``None`` is a declaration).
_UNDECLARED = object()


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


def _dtype(leaf: Any) -> Any:
    """A leaf's dtype: arrays, ``ShapeDtypeStruct``s, tracers and Python scalars."""
    dtype = getattr(leaf, "dtype", None)
    return np.result_type(leaf) if dtype is None else dtype


def _is_complex(leaf: Any) -> bool:
    return bool(jnp.issubdtype(_dtype(leaf), jnp.complexfloating))


def _match(pattern: re.Pattern | None, names: list[str]) -> str | None:
    """The first of ``names`` (path components) that ``pattern`` matches as a whole
    (``None``: none, or no pattern)."""
    if pattern is None:
        return None
    return next((n for n in names if pattern.fullmatch(n)), None)


def _scalar_by_name(shape: tuple, names: list[str], patterns) -> str | None:
    """Rules 3a-3c of the module: why the name rules send a leaf to the scalar optimizer."""
    vector, scalar, head = patterns
    if len(shape) < 2:
        return f"rank {len(shape)}"
    if (name := _match(vector, names)) is not None:
        return f"vector name {name!r}"
    if (name := _match(scalar, names) or _match(head, names)) is not None:
        return f"embedding/head name {name!r}"
    return None


def _declared_route(path, leaf, names, dn, patterns) -> Route:
    """Rule 2 of the module: a leaf that a ``dimension_numbers`` tree or callable covers."""
    shape = _shape(leaf)
    if dn is None:
        return Route(path, shape, SCALAR_LABEL, "dimension_numbers=None", declared=True)
    if len(shape) < 2:
        return Route(path, shape, None, f"rank {len(shape)} given dimension_numbers",
                     "declared_vector", True)
    if _is_complex(leaf):
        return Route(path, shape, None, f"{_dtype(leaf)} given dimension_numbers", "complex",
                     True)
    named = _scalar_by_name(shape, names, patterns)
    rule = "dimension_numbers" + ("" if named is None else f" over {named}")
    return Route(path, shape, DION3_LABEL, rule, declared=True)


def _undeclared_route(path, leaf, names, single, patterns) -> Route:
    """Rule 3 of the module: the name rules, for a leaf nobody declared."""
    shape = _shape(leaf)
    if (rule := _scalar_by_name(shape, names, patterns)) is not None:
        return Route(path, shape, SCALAR_LABEL, rule)
    if (name := _match(_ONE_LETTER, names)) is not None:
        return Route(path, shape, None, f"one-letter name {name!r}", "one_letter")
    if _is_complex(leaf):
        return Route(path, shape, None, f"{_dtype(leaf)} matrix", "complex")
    if len(shape) == 2:
        return Route(path, shape, DION3_LABEL, "matrix")
    if single is not None:
        return Route(path, shape, DION3_LABEL, "dimension_numbers")
    return Route(path, shape, None, f"rank {len(shape)}: axes unknown", "axes")


def _route(path, leaf, single, lookup, patterns) -> Route:
    """One leaf's route under the module's rules (see the module docstring)."""
    names = [_key_name(k) for k in _module_path(path)]
    dn = _UNDECLARED if lookup is None else lookup(path)
    if dn is _UNDECLARED:
        return _undeclared_route(path, leaf, names, single, patterns)
    return _declared_route(path, leaf, names, dn, patterns)


def classify(params: Any, dimension_numbers: Any = None,
             scalar_pattern: str = DEFAULT_SCALAR_PATTERN, *,
             vector_pattern: str | None = DEFAULT_VECTOR_PATTERN,
             head_pattern: str | None = DEFAULT_HEAD_PATTERN) -> list[Route]:
    """Routes every leaf of ``params`` (refused leaves get ``label=None``); nothing raises.

    Args:
      params: the parameter tree (dicts, ``nnx.State``, any pytree).
      dimension_numbers: as in :func:`dion3_jax.dion3`: one value (a view for every leaf, the
        name rules decide), a tree or a callable (declares each leaf it covers).
      scalar_pattern, vector_pattern, head_pattern: as in :func:`default_param_labels`.

    Returns:
      One :class:`Route` per leaf, in ``jax.tree_util.tree_flatten_with_path`` order.
    """
    compile_ = lambda p: None if p is None else re.compile(p, re.IGNORECASE)
    patterns = (compile_(vector_pattern), compile_(scalar_pattern), compile_(head_pattern))
    spec = dimension_numbers
    if callable(spec) and not _layout.is_single_value(spec):
        spec = spec(params)
    single = _layout.is_single_value(spec)
    lookup = None if single else _layout.per_leaf(spec, params, missing=_UNDECLARED)
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    routes = [_route(path, leaf, spec if single else None, lookup, patterns)
              for path, leaf in flat]
    if patterns[2] is not None:   # head_pattern given
        routes = _refuse_unnamed_head(routes, patterns[2])
    return routes


def _refuse_unnamed_head(routes: list[Route], head: re.Pattern) -> list[Route]:
    """Marks the auto-named Dion3 leaves refused when no leaf is named like a head.

    A leaf that a ``dimension_numbers`` tree sends to the scalar optimizer (``None``) counts as
    a named head: the user has said where it goes. Declared leaves are never refused.
    """
    auto = re.compile(AUTO_NAME_PATTERN)
    if any(_match(head, [_key_name(k) for k in r.path]) or r.rule == "dimension_numbers=None"
           for r in routes):
        return routes
    out = []
    for r in routes:
        name = _match(auto, [_key_name(k) for k in r.path])
        if r.label == DION3_LABEL and not r.declared and name is not None:
            r = r._replace(label=None, rule=f"auto-named {name!r}, no head named",
                           refusal="head")
        out.append(r)
    return out


def _listed(routes: list[Route], rule: bool = False) -> str:
    """The refused leaves, one ``path  shape=...`` line each (at most ``_MAX_LISTED``), with
    each one's rule where ``rule``."""
    lines = [f"    {leaf_name(r.path)}  shape={r.shape}" + (f"  ({r.rule})" if rule else "")
             for r in routes[:_MAX_LISTED]]
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
        "\n  - both kinds in one model: a tree or callable of DimensionNumbers, which decides "
        "every\n    leaf it covers (None sends a leaf to the scalar optimizer); recipes in "
        "docs/ROUTING.md.\n"
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


def _tree_literal(path: tuple, value: str) -> str:
    """``{"lora": {"B": value}}`` for a path of string dict keys, else a description."""
    keys = _module_path(path)
    if not all(isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str) for k in keys):
        return f"a tree like the params with {value} at {leaf_name(path)}"
    text = value
    for k in reversed(keys):
        text = "{" + repr(k.key) + ": " + text + "}"
    return text


def _one_letter_message(refused: list[Route]) -> str:
    """The error text for undeclared leaves of rank ≥ 2 under a one-letter name b, d or g."""
    axes = (0, 1) if len(refused[0].shape) == 2 else (-2, -1)
    dn = f"dion3_jax.DimensionNumbers(reduction_axis={axes[0]}, output_axis={axes[1]})"
    letters = sorted({(_match(_ONE_LETTER, [_key_name(k) for k in r.path]) or "").lower()
                      for r in refused})
    return (
        "dion3_jax cannot tell what these leaves are from their one-letter names: b, d and g "
        "name biases\n  and gains in some libraries (Haiku's b, Mamba's D) and matrices in "
        "others (LoRA's B).\n"
        f"{_listed(refused, rule=True)}\n"
        "  Say which, in dion3_jax.dion3(...):\n"
        "  - matrices: a dimension_numbers tree that gives each a DimensionNumbers (the tree "
        "may\n    cover only these leaves; the others keep the name rules), e.g.\n"
        f"      dimension_numbers={_tree_literal(refused[0].path, dn)}\n"
        "  - per-feature parameters: None for them in that tree (the scalar optimizer), or "
        "for every\n    leaf under that name:\n"
        "      param_labels=lambda p: dion3_jax.default_param_labels(\n"
        "          p, vector_pattern=dion3_jax.routing.DEFAULT_VECTOR_PATTERN + "
        f"\"|{'|'.join(letters)}\")\n"
        "  Check the result with print(dion3_jax.routing_table(params, dimension_numbers=...)).")


def _declared_vector_message(refused: list[Route]) -> str:
    """The error text for leaves of rank < 2 that a tree or callable gives a DimensionNumbers."""
    return (
        "dimension_numbers gives a DimensionNumbers to these leaves of rank < 2, which are not "
        "matrices:\n"
        f"{_listed(refused)}\n"
        "  A dimension_numbers tree or callable decides every leaf it covers. Give these None "
        "(the\n  scalar optimizer), leave them out of the tree (the name rules decide them), "
        "or pass one\n  DimensionNumbers for all leaves: a view, where the name rules still "
        "decide which leaves\n  are matrices.")


def _complex_message(refused: list[Route]) -> str:
    """The error text for complex leaves headed for Dion3."""
    return (
        "Dion3 orthogonalizes real matrices; these complex leaves would go to it:\n"
        f"{_listed(refused, rule=True)}\n"
        "  Send them to the scalar optimizer (AdamW and Lion take complex leaves): None for "
        "them in a\n  dimension_numbers tree, e.g. "
        f"dimension_numbers={_tree_literal(refused[0].path, 'None')},\n"
        "  or param_labels. To orthogonalize one, train its real and imaginary parts as two "
        "real leaves.")


def check_routes(routes: list[Route]) -> None:
    """Raises when :func:`classify` refused a leaf.

    Args:
      routes: the output of :func:`classify`.

    Raises:
      ValueError: naming every refused leaf (path and shape) and the one-line fixes, one
        paragraph per kind of refusal.
    """
    parts = [message([r for r in routes if r.refusal == kind])
             for kind, message in _MESSAGES if any(r.refusal == kind for r in routes)]
    if parts:
        raise ValueError("\n\n".join(parts))


_MESSAGES = (("axes", _rank_message), ("one_letter", _one_letter_message),
             ("declared_vector", _declared_vector_message), ("complex", _complex_message),
             ("head", _head_message))


def default_param_labels(params: Params,
                         dimension_numbers: PerLeaf[DimensionNumbers | None] | None = None,
                         scalar_pattern: str = DEFAULT_SCALAR_PATTERN, *,
                         vector_pattern: str | None = DEFAULT_VECTOR_PATTERN,
                         head_pattern: str | None = DEFAULT_HEAD_PATTERN) -> Tree[Label]:
    """Labels each leaf ``"dion3"`` or ``"scalar"``, or refuses (see :mod:`dion3_jax._routing`).

    In short: a leaf that a ``dimension_numbers`` tree or callable covers goes where it says
    (a ``DimensionNumbers``: Dion3; ``None``: scalar), whatever its name. For the other leaves:
    rank < 2 leaves, leaves named like biases / norm scales (any rank) and embeddings or heads
    (by name) go to the scalar optimizer; one-letter names ``b``, ``d``, ``g`` and complex
    matrices are refused; 2-D leaves go to Dion3, and rank ≥ 3 leaves only when one
    ``DimensionNumbers`` is given for all (else refused).

    Args:
      params: the parameter tree (dicts, ``nnx.State``, any pytree).
      dimension_numbers: as in :func:`dion3_jax.dion3`. A tree or callable declares every leaf
        it covers (a ``DimensionNumbers``: Dion3; ``None``: the scalar optimizer), and the
        patterns below apply only to the leaves it leaves out; one ``DimensionNumbers`` for all
        leaves declares none.
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
      ValueError: for rank ≥ 3 leaves whose axes are not given, undeclared leaves of rank ≥ 2
        under a one-letter name ``b``, ``d`` or ``g``, a ``DimensionNumbers`` given to a leaf of
        rank < 2, complex matrices, and Linen auto-named layers without a named head; one
        message names every such leaf and gives the fixes.

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
        if lab == DION3_LABEL and _is_complex(leaf):
            routes.append(Route(path, _shape(leaf), None, f"{_dtype(leaf)} labeled 'dion3'",
                                "complex"))
        else:
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
        check_routes(routes)
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

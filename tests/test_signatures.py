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
"""The public optimizers' written-out signatures: real annotations, one set of shared options.

``dion3``, ``muon``, ``normuon``, ``scale_by_dion3`` and ``make_orthogonalizer`` each write
their parameters out in their own ``def``. These tests are what keeps the copies one: the shared
options have the same names, order, kinds, defaults and annotations everywhere they appear, and
every parameter reaches the builder (``_alias._build``), the config (``make_config``) or the
record (``Orthogonalizer``) under its own name. The forwarding tests replace the next layer by a
recorder and pass a distinct sentinel object for each parameter, so a parameter that is dropped,
renamed, swapped with another or replaced by a constant fails.
"""

import dataclasses
import inspect
import typing

import pytest

import dion3_jax
from dion3_jax import _alias, _orthogonalizer, _transform

P = inspect.Parameter
ALIASES = {"dion3": dion3_jax.dion3, "muon": dion3_jax.muon, "normuon": dion3_jax.normuon}
PUBLIC = {**ALIASES, "scale_by_dion3": dion3_jax.scale_by_dion3,
          "make_orthogonalizer": dion3_jax.make_orthogonalizer}
#: What ``muon`` and ``normuon`` fix instead of taking (dion3's parameters they lack).
FIXED = {"muon": {"fraction": 1.0, "beta2": 0.95, "flavor": "muon"},
         "normuon": {"fraction": 1.0, "flavor": "normuon"}}
#: The one intended difference of defaults: the aliases' momentum is the reference's 0.95.
OWN_DEFAULTS = {("muon", "mu"): 0.95, ("normuon", "mu"): 0.95}


def _params(fn) -> dict[str, P]:
    return dict(inspect.signature(fn).parameters)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_annotations_are_objects_that_resolve(name):
    """Every parameter and the return value are annotated with objects (not strings), and
    ``typing.get_type_hints`` resolves them to the same objects."""
    fn = PUBLIC[name]
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    assert sig.return_annotation is not P.empty and not isinstance(sig.return_annotation, str)
    for p in sig.parameters.values():
        assert p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY), (name, p.name, p.kind)
        assert p.annotation is not P.empty, (name, p.name)
        assert not isinstance(p.annotation, str), (name, p.name, p.annotation)
        assert hints[p.name] == p.annotation, (name, p.name)
    assert set(hints) == set(sig.parameters) | {"return"}


def test_the_aliases_are_dion3_less_what_they_fix():
    """``muon`` / ``normuon`` take ``dion3``'s parameters, in its order, except those they fix;
    each shared one has ``dion3``'s kind, annotation and default (but the stated ``mu``)."""
    full = _params(dion3_jax.dion3)
    assert list(full) == list(_params(_alias._build)), "dion3 and _build list other options"
    assert sum(p.kind is P.KEYWORD_ONLY for p in full.values()) == 17
    for name in ("muon", "normuon"):
        own = _params(ALIASES[name])
        assert list(own) == [n for n in full if n not in FIXED[name]], name
        for n, p in own.items():
            want = full[n].replace(default=OWN_DEFAULTS.get((name, n), full[n].default))
            assert p == want, (name, n, p, want)


def test_scale_by_dion3_options_match_dion3():
    """``scale_by_dion3``'s parameters are ``dion3``'s matrix options, in the same order, with
    the same kinds, annotations and defaults, and ``make_config`` takes them in that order."""
    full = _params(dion3_jax.dion3)
    own = _params(dion3_jax.scale_by_dion3)
    assert [n for n in full if n in own] == list(own)
    assert len(own) == 12
    for n, p in own.items():
        assert p == full[n], (n, p, full[n])
    assert list(_params(_transform.make_config)) == list(own)


def test_make_orthogonalizer_matches_polar_and_the_record():
    """``make_orthogonalizer``'s keyword-only parameters are ``polar``'s, and the fields of
    ``Orthogonalizer``: same names, order, annotations and defaults."""
    polar_hints = typing.get_type_hints(dion3_jax.polar)   # polar's own may be strings
    polar = [p.replace(annotation=polar_hints[p.name])
             for p in _params(dion3_jax.polar).values() if p.kind is P.KEYWORD_ONLY]
    own = list(_params(dion3_jax.make_orthogonalizer).values())
    assert own == polar
    hints = typing.get_type_hints(dion3_jax.Orthogonalizer)
    fields = dataclasses.fields(dion3_jax.Orthogonalizer)
    assert [(f.name, hints[f.name], f.default) for f in fields] == [
        (p.name, p.annotation, p.default) for p in own]


class _Recorder:
    """Stands in for a callee: remembers the arguments of its last call, bound by name."""

    def __init__(self, callee, result=None):
        self.sig, self.result, self.got = inspect.signature(callee), result, None

    def __call__(self, *args, **kwargs):
        self.got = self.sig.bind(*args, **kwargs).arguments
        return self.result


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_each_alias_parameter_reaches_the_builder(name, monkeypatch):
    """Called with a distinct sentinel for every parameter, the alias hands ``_build`` each one
    under its own name and ``FIXED``'s values for the rest; with defaults only, the builder sees
    the alias's defaults."""
    fn = ALIASES[name]
    record = _Recorder(_alias._build)
    monkeypatch.setattr(_alias, "_build", record)
    sentinels = {n: object() for n in _params(fn)}
    fn(**sentinels)
    assert record.got == {**sentinels, **FIXED.get(name, {})}
    fn(sentinels["learning_rate"])
    defaults = {n: p.default for n, p in _params(fn).items() if n != "learning_rate"}
    assert record.got == {"learning_rate": sentinels["learning_rate"], **defaults,
                          **FIXED.get(name, {})}


def test_scale_by_dion3_parameters_reach_the_config(monkeypatch):
    record = _Recorder(_transform.make_config)
    monkeypatch.setattr(_transform, "make_config", record)
    sentinels = {n: object() for n in _params(dion3_jax.scale_by_dion3)}
    dion3_jax.scale_by_dion3(**sentinels)
    assert record.got == sentinels


def test_make_orthogonalizer_parameters_reach_the_record(monkeypatch):
    record = _Recorder(dion3_jax.Orthogonalizer)
    monkeypatch.setattr(_orthogonalizer, "Orthogonalizer", record)
    sentinels = {n: object() for n in _params(dion3_jax.make_orthogonalizer)}
    dion3_jax.make_orthogonalizer(**sentinels)
    assert record.got == sentinels


@pytest.mark.parametrize("scalar_optimizer", ["adamw", "lion"])
def test_the_builder_forwards_every_option(scalar_optimizer, monkeypatch):
    """``_build`` passes the matrix options to ``scale_by_dion3`` and the scalar optimizer's to
    ``optax.adamw`` / ``optax.lion`` unchanged (sentinels where the builder does not check the
    value, distinct valid numbers where it does)."""
    import optax

    matrix = _Recorder(dion3_jax.scale_by_dion3, optax.identity())
    monkeypatch.setattr(_alias, "scale_by_dion3", matrix)
    scalar_fn = getattr(optax, scalar_optimizer)
    scalar = _Recorder(scalar_fn, optax.identity())
    monkeypatch.setattr(optax, scalar_optimizer, scalar)
    options = {n: object() for n in _params(dion3_jax.scale_by_dion3)}
    numbers = dict(learning_rate=0.0123, adam_learning_rate=0.00456, adam_b1=0.81,
                   adam_b2=0.92, adam_eps=3e-7, adam_weight_decay=0.067)
    mask = object()
    dion3_jax.dion3(**numbers, **options, scalar_optimizer=scalar_optimizer,
                    adam_weight_decay_mask=mask)
    assert matrix.got == options
    want = dict(learning_rate=numbers["adam_learning_rate"], b1=numbers["adam_b1"],
                b2=numbers["adam_b2"], weight_decay=numbers["adam_weight_decay"], mask=mask)
    if scalar_optimizer == "adamw":
        want["eps"] = numbers["adam_eps"]
    assert scalar.got == want

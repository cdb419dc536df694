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
"""Which implementation a call of this package's ops runs: one vocabulary, one dispatcher.

Every op (``syrk``, ``sym_matmul``, ``accumulate_rows``, ``stack_payloads``) takes
``implementation=``, one of:

- ``"xla"``: the op's plain jnp reference; runs on every platform (CPU, GPU, TPU).
- ``"mosaic"``: a Pallas kernel through the Mosaic GPU lowering (Hopper, sm_90).
- ``"jax_triton"``: a Triton kernel called through the ``jax_triton`` package (NVIDIA GPUs).
- ``"pallas_triton"``: a Pallas kernel through Pallas' Triton lowering (NVIDIA GPUs), which jax
  0.11 deprecates. The two elementwise passes have such kernels; ``"auto"`` never takes them,
  so they run only when named.
- ``"auto"``: the op's preferred implementation that runs on the target device, else ``"xla"``.
  On a TPU or CPU this is always ``"xla"``.

A named implementation that the op lacks, or that cannot run on the target, raises
``ValueError``: nothing falls back silently.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping, Sequence
from typing import Literal

import jax

Implementation = Literal["auto", "xla", "mosaic", "jax_triton", "pallas_triton"]
IMPLEMENTATIONS = ("auto", "xla", "mosaic", "jax_triton", "pallas_triton")

_NEEDS = {
    "mosaic": "a Hopper GPU (sm_90)",
    "jax_triton": "an NVIDIA GPU and the jax-triton package",
    "pallas_triton": "an NVIDIA GPU and a jax with Pallas' Triton lowering",
}


def target_device():
    """The device compiled for: the abstract mesh's device under ``jax.set_mesh``, else the
    default device."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    return abstract if abstract is not None else jax.devices()[0]


def _is_nvidia(device) -> bool:
    return device.platform == "gpu" and "NVIDIA" in device.device_kind.upper()


#: Device kinds of Hopper GPUs, for devices that state no compute capability (an abstract
#: mesh's device, e.g. under ``jax.set_mesh``).
_HOPPER_KINDS = ("H100", "H200", "H800", "H20")


def is_hopper(device) -> bool:
    """Whether ``device`` is an NVIDIA GPU of compute capability 9.x (read from its device kind
    where it states no compute capability)."""
    if device.platform != "gpu":
        return False
    cc = getattr(device, "compute_capability", None)
    if cc is not None:
        return str(cc).split(".")[0] == "9"
    words = device.device_kind.upper().replace("-", " ").split()
    return "NVIDIA" in words and any(w.startswith(_HOPPER_KINDS) for w in words)


@functools.cache
def _has_module(*names: str) -> bool:
    try:
        return all(importlib.util.find_spec(n) is not None for n in names)
    except ModuleNotFoundError:  # a missing parent package
        return False


def available_implementations(device=None) -> tuple[str, ...]:
    """Implementations that can run (without interpret mode) on ``device`` (default: the
    target device).

    Returns:
      A tuple that starts with ``"xla"``, followed by ``"mosaic"`` on Hopper GPUs,
      ``"jax_triton"`` on NVIDIA GPUs where ``jax_triton`` is importable and ``"pallas_triton"``
      on NVIDIA GPUs where jax has Pallas' Triton lowering.
    """
    device = target_device() if device is None else device
    names = ["xla"]
    if is_hopper(device):
        names.append("mosaic")
    if _is_nvidia(device) and _has_module("jax_triton", "triton"):
        names.append("jax_triton")
    if _is_nvidia(device) and _has_module("jax.experimental.pallas.triton"):
        names.append("pallas_triton")
    return tuple(names)


def resolve(op: str, implementation: str, *, supported: Sequence[str],
            auto: Sequence[str] = (), fits: bool = True, needs: str = "",
            interpret: bool = False, interpretable: Sequence[str] = ()) -> str:
    """The implementation one call of ``op`` runs.

    Args:
      op: the op's name (for errors).
      implementation: what the caller asked for (:data:`IMPLEMENTATIONS`).
      supported: the kernels ``op`` has besides ``"xla"``.
      auto: the kernels ``"auto"`` may pick, in order of preference.
      fits: whether the kernels take this call's shapes and dtypes (``"auto"`` then picks one).
      needs: what the kernels need of the call, for the error when ``fits`` is false.
      interpret: run the kernel through an interpreter (CPU tests).
      interpretable: the kernels that have an interpret mode.

    Returns:
      ``"xla"`` or one of ``supported``.

    Raises:
      ValueError: for a name outside the vocabulary or ``supported``, or a kernel that cannot
        run this call here.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{op}: implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation=!r}")
    if implementation == "xla":
        return "xla"
    available = available_implementations()
    if implementation == "auto":
        return next((n for n in auto if fits and n in available), "xla")
    if implementation not in supported:
        raise ValueError(f"{op} has no {implementation!r} kernel; it has "
                         f"{('xla', *supported)}")
    if not fits:
        raise ValueError(f"{op}: implementation={implementation!r} needs {needs}; use 'xla'")
    if interpret:
        if implementation not in interpretable:
            raise ValueError(f"{op}: implementation={implementation!r} has no interpret mode; "
                             f"{tuple(interpretable) or 'none'} have one")
        return implementation
    if implementation not in available:
        device = target_device()
        raise ValueError(f"{op}: implementation={implementation!r} needs {_NEEDS[implementation]}"
                         f"; the target is {device.platform!r} ({device.device_kind!r}), where "
                         f"{available} run")
    return implementation


def resolve_pass(op: str, implementation: str, fits: Mapping[str, bool],
                 needs: Mapping[str, str], interpret: bool, auto: Sequence[str]) -> str:
    """What one of the two elementwise passes (``accumulate_rows``, ``stack_payloads``) runs:
    ``"xla"`` or one of ``fits``' kernels.

    Args:
      op: the pass's name (for errors).
      implementation: what the caller asked for.
      fits: per kernel the pass has, whether it takes this call's shapes.
      needs: per kernel, what it needs of the call (for the error when it does not fit).
      interpret: run the kernel through an interpreter (CPU tests; every kernel has one).
      auto: the kernels ``"auto"`` may pick, in order of preference (each only where it runs
        and fits).
    """
    if implementation in fits:
        return resolve(op, implementation, supported=tuple(fits), fits=fits[implementation],
                       needs=needs[implementation], interpret=interpret,
                       interpretable=tuple(fits))
    return resolve(op, implementation, supported=tuple(fits), interpret=interpret,
                   auto=[n for n in auto if fits[n]], interpretable=tuple(fits))


def pallas_triton():
    """``jax.experimental.pallas.triton``, imported when a ``"pallas_triton"`` kernel is built
    (importing the deprecated lowering only then)."""
    from jax.experimental.pallas import triton as pltriton

    return pltriton


def triton_params(num_warps: int, interpret: bool):
    """A ``"pallas_triton"`` kernel's compiler parameters (none in interpret mode)."""
    if interpret:
        return None
    return pallas_triton().CompilerParams(num_warps=num_warps, num_stages=1)

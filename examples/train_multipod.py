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
"""Train a Flax NNX model with Dion3 on a ("dcn", "fsdp", "tp", "expert") mesh: FSDP, tensor
and expert sharding inside a pod, compressed data-parallel sync across pods.

The mesh has a slow axis ``dcn`` (pods, linked by the data-center network) and three fast axes
of the devices of one pod: ``fsdp``, ``tp`` and ``expert``. The model has self-attention over a
short sequence made from the input, an MLP and a mixture of experts whose expert kernels are
stacked ``(experts, in, out)``. Each kernel carries logical axis names
(``nnx.with_partitioning``), mapped to mesh axes by :data:`LOGICAL_RULES` (MaxText-like:
``embed`` → fsdp; ``mlp``, ``heads``, ``vocab`` → tp; ``exp`` → expert) under
``nnx.logical_axis_rules``. So q/k/v ``("embed", "heads")`` and the MLP's up kernel are
``P("fsdp", "tp")``, o and down ``P("tp", "fsdp")``, the expert stacks ``P("expert", "fsdp",
"tp")`` and ``P("expert", "tp", "fsdp")``, the router ``P("fsdp", None)``. Parameters and the
optimizer state keep these shardings and are replicated over ``dcn``. The forward pass
all-gathers each weight (``jax.sharding.reshard(w, P())``) and is data-parallel: the batch is
split over every device. The tp and expert axes thus shard the weights and Dion3's work on them,
not the forward pass's matmuls.

The training step runs inside ``jax.shard_map(..., axis_names={"dcn"})``, so each pod computes
the gradient of its own part of the batch and the gradients of the Dion3 matrices are NOT
all-reduced over ``dcn``: Dion3 (``mesh_options=dion3_jax.MeshOptions(shard_axis=("fsdp", "tp",
"expert"), replica_axis="dcn")``) averages only the selected rows ``M[I, :]`` of the momentum
across pods, a ``1/f`` saving of DCN bytes. The row set ``I`` is drawn from a key shared by the
pods (``replica_selection="random"``), so the update equals the fully synchronized one;
``"norms"`` all-reduces the row norms instead. The non-matrix leaves (the head: AdamW) are
averaged over ``dcn`` as usual. Before a checkpoint, :func:`dion3_jax.synchronize_momentum` makes
the pods' momenta equal.

The task is a synthetic teacher-student regression (a random two-layer tanh network plus noise),
so the script needs no data. On CPU it simulates 8 devices as a 2 × 2 × 2 × 1 mesh by default;
``--mesh DCNxFSDP`` (two numbers) means tp = expert = 1::

    python examples/train_multipod.py                          # 2x2x2x1 on 8 CPU devices
    python examples/train_multipod.py --mesh 1x2x2x2           # experts over 2 devices
    python examples/train_multipod.py --mesh 4x2 --fraction 0.125 --steps 300
    python examples/train_multipod.py --replica-selection norms

Several processes (hosts): ``--distributed`` calls ``jax.distributed.initialize`` first (with
``--coordinator``, ``--num-processes`` and ``--process-id``, or the cluster's own variables when
they are left out). The mesh is built from every process's devices, ordered by process, so with
one process per pod a mesh of ``<processes>`` pods (the first number of ``--mesh``) puts "dcn"
across the processes.
The run is the single-process run on as many devices (``tests/test_train_multipod.py``). On CPUs
the collectives go through gloo, with ``--cpu-devices-per-process`` devices each. Only process 0
prints and writes::

    # two processes on one machine, 4 CPU devices each: the 2x2x2x1 run of 8 devices
    python examples/train_multipod.py --distributed --coordinator localhost:12345 \
        --num-processes 2 --process-id 0 &
    python examples/train_multipod.py --distributed --coordinator localhost:12345 \
        --num-processes 2 --process-id 1

``--save DIR`` writes an orbax checkpoint at the end (every process writes its shards, after
``synchronize_momentum``); ``--restore DIR`` continues from one, on any mesh.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import optax
from flax import nnx

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
if importlib.util.find_spec("dion3_jax") is None:  # a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(_HERE))

import dion3_jax  # noqa: E402
import _common  # noqa: E402

#: The mesh axes, slow to fast: pods, then FSDP, tensor and expert parallelism inside a pod.
AXES = ("dcn", "fsdp", "tp", "expert")
#: Logical axis name of a kernel → mesh axis (MaxText-like); names not listed stay unsharded.
LOGICAL_RULES = {
    "embed": "fsdp",     # model width
    "mlp": "tp",         # MLP and expert hidden width
    "heads": "tp",       # attention heads (q/k/v outputs, o inputs)
    "vocab": "tp",       # the head's outputs
    "exp": "expert",     # the expert axis of expert-stacked kernels
}
#: Every Dion3 matrix is the last two axes, (in, out); an expert stack's first axis is a batch.
DIMENSION_NUMBERS = dion3_jax.DimensionNumbers(reduction_axis=-2, output_axis=-1)


@dataclasses.dataclass
class Config:
    mesh: tuple[int, int, int, int] = (2, 2, 2, 1)   # (dcn, fsdp, tp, expert)
    cpu_devices: int = 8
    d_in: int = 32
    seq: int = 4                        # tokens made from each input vector
    hidden: int = 64                    # model width ("embed")
    heads: int = 4
    mlp: int = 64                       # MLP and expert hidden width ("mlp")
    experts: int = 4
    layers: int = 1                     # blocks of attention, MLP and mixture of experts
    d_out: int = 16
    batch: int = 64                     # global batch (split over every device)
    steps: int = 200
    lr: float = 0.02
    adam_lr: float = 3e-3
    fraction: float = 0.25
    selection_scope: str = "local"
    replica_selection: str = "random"
    log_every: int = 25
    seed: int = 0
    progress: bool = True
    distributed: bool = False
    coordinator: str | None = None      # host:port of process 0 (with --distributed)
    num_processes: int | None = None
    process_id: int | None = None
    cpu_devices_per_process: int = 4
    out: str | None = None              # results.json + params.npz (process 0)
    save: str | None = None             # orbax checkpoint at the end
    restore: str | None = None          # continue from an orbax checkpoint


def _mesh(text: str) -> tuple[int, int, int, int]:
    """``DCNxFSDPxTPxEXPERT``, or the two-number form ``DCNxFSDP`` (tp = expert = 1)."""
    try:
        sizes = tuple(int(t) for t in text.lower().split("x"))
    except ValueError:
        sizes = ()
    if len(sizes) not in (2, 4):
        raise argparse.ArgumentTypeError(
            f"must look like 2x4 (DCN x FSDP) or 2x2x2x1 (DCN x FSDP x TP x EXPERT), "
            f"got {text!r}")
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"every size must be >= 1, got {text!r}")
    return sizes + (1,) * (4 - len(sizes))


def mesh_text(mesh: tuple[int, ...]) -> str:
    """``--mesh`` as written: the two-number form when tp and expert are 1."""
    return "x".join(map(str, mesh[:2] if mesh[2:] == (1, 1) else mesh))


def parse_args(argv=None) -> Config:
    """Parses and validates the flags (argparse errors, before any device is touched)."""
    c = Config()
    p = _common.make_parser(__doc__)
    p.add_argument("--mesh", type=_mesh, default="x".join(map(str, c.mesh)),
                   help="mesh shape DCNxFSDPxTPxEXPERT (pods, then a pod's FSDP, tensor and "
                        "expert axes); DCNxFSDP means tp = expert = 1")
    p.add_argument("--cpu-devices", type=_common.positive_int, default=c.cpu_devices,
                   help="simulated CPU devices when running on CPU")
    sizes = {"d_in": "input width of the teacher-student task (divisible by the fsdp size)",
             "seq": "tokens made from each input vector",
             "hidden": "model width (divisible by --heads and by the fsdp and tp sizes)",
             "heads": "attention heads", "mlp": "MLP and expert hidden width (divisible by tp)",
             "experts": "experts of the mixture (divisible by the expert size)",
             "layers": "blocks (attention, MLP, mixture of experts)",
             "d_out": "output width (divisible by the tp size)",
             "batch": "global batch (divisible by the number of devices)",
             "steps": "training steps", "log_every": "steps between logged losses"}
    for name, text in sizes.items():
        p.add_argument("--" + name.replace("_", "-"), type=_common.positive_int,
                       default=getattr(c, name), help=text)
    p.add_argument("--seed", type=_common.nonnegative_int, default=c.seed,
                   help="seed of the model, the teacher and the replica selection")
    p.add_argument("--lr", type=_common.positive_float, default=c.lr,
                   help="Dion3 learning rate (matrices)")
    p.add_argument("--adam-lr", type=_common.positive_float, default=c.adam_lr,
                   help="learning rate of the AdamW branch (biases, head)")
    p.add_argument("--fraction", type=_common.fraction, default=c.fraction,
                   help="Dion3 row fraction f, in (0, 1]")
    p.add_argument("--selection-scope", choices=("local", "global"), default=c.selection_scope,
                   help="row selection on row-sharded matrices: per shard or exact global top-k")
    p.add_argument("--replica-selection", choices=("random", "norms"),
                   default=c.replica_selection,
                   help="how the pods agree on the rows: a shared random key, or summed norms")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=c.progress,
                   help="progress bar on a terminal, plain lines otherwise")
    _add_run_flags(p, c)
    a = p.parse_args(argv)
    problem = _check_sizes(a) or _check_distributed(a)
    if problem:
        p.error(problem)
    if a.restore and not os.path.isdir(a.restore):
        p.error(f"--restore {a.restore}: no such folder")
    return Config(**vars(a))


def _add_run_flags(p: argparse.ArgumentParser, c: Config) -> None:
    p.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first (several processes or hosts)")
    p.add_argument("--coordinator", default=c.coordinator,
                   help="HOST:PORT of process 0, with --distributed; default: from the cluster's "
                        "environment (jax.distributed.initialize's auto-detection)")
    p.add_argument("--num-processes", type=_common.positive_int, default=c.num_processes,
                   help="number of processes, with --distributed; default: auto-detected")
    p.add_argument("--process-id", type=_common.nonnegative_int, default=c.process_id,
                   help="this process's index in [0, --num-processes), with --distributed")
    p.add_argument("--cpu-devices-per-process", type=_common.positive_int,
                   default=c.cpu_devices_per_process,
                   help="CPU devices of each process with --distributed on CPUs (gloo "
                        "collectives)")
    p.add_argument("--out", default=c.out,
                   help="folder for results.json and params.npz (process 0 writes); default: none")
    p.add_argument("--save", default=c.save,
                   help="folder for an orbax checkpoint of the params and optimizer state after "
                        "the last step (momentum synchronized first); default: none")
    p.add_argument("--restore", default=c.restore,
                   help="orbax checkpoint (from --save) to continue from, on this run's mesh; "
                        "--steps more steps follow; default: start from scratch")


def _check_sizes(a) -> str | None:
    """What is wrong with the batch and widths for the mesh (a sentence), or ``None``: the batch
    is split over every device, each kernel axis over the mesh axis its logical name maps to."""
    dcn, fsdp, tp, expert = a.mesh
    text, n = mesh_text(a.mesh), dcn * fsdp * tp * expert
    if a.batch % n:
        return f"--batch {a.batch} must be divisible by the {n} devices of --mesh {text}"
    checks = (("--d-in", a.d_in, "fsdp", fsdp), ("--hidden", a.hidden, "fsdp", fsdp),
              ("--hidden", a.hidden, "tp", tp), ("--mlp", a.mlp, "tp", tp),
              ("--d-out", a.d_out, "tp", tp), ("--experts", a.experts, "expert", expert))
    for flag, value, axis, size in checks:
        if value % size:
            return (f"{flag} {value} must be divisible by the {axis} size {size} of --mesh "
                    f"{text} (the weights are sharded over it)")
    if a.hidden % a.heads:
        return f"--hidden {a.hidden} must be divisible by --heads {a.heads}"
    return None


def device_problem(cfg: Config) -> str | None:
    """What keeps the mesh off this run's devices (a sentence), or ``None``; call it once the
    backend has started (:func:`start_backend`)."""
    n, found, text = int(np.prod(cfg.mesh)), jax.device_count(), mesh_text(cfg.mesh)
    if jax.process_count() > 1 and n != found:
        return (f"--mesh {text} must use all {found} devices of the "
                f"{jax.process_count()} processes")
    if n > found:
        hint = f"; on CPU, pass --cpu-devices {n}" if jax.default_backend() == "cpu" else ""
        return f"--mesh {text} needs {n} devices, found {found}{hint}"
    return None


def _check_distributed(a) -> str | None:
    """What is wrong with the multi-process flags (a sentence), or ``None``."""
    given = [f"--{k.replace('_', '-')}" for k in ("coordinator", "num_processes", "process_id")
             if getattr(a, k) is not None]
    if not a.distributed:
        return f"{', '.join(given)} only with --distributed" if given else None
    if a.num_processes is not None and a.process_id is not None \
            and a.process_id >= a.num_processes:
        return f"--process-id {a.process_id} must be < --num-processes {a.num_processes}"
    if a.coordinator is not None and ":" not in a.coordinator:
        return f"--coordinator must look like HOST:PORT, got {a.coordinator!r}"
    return None


# ---------------------------------------------------------------------------------------------
# Model: attention, an MLP and a mixture of experts whose kernels carry logical axis names
# (nnx.with_partitioning), placed on the mesh by LOGICAL_RULES. The forward pass all-gathers each
# weight (FSDP style, Explicit sharding) and is data-parallel over every device.


def kernel(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str | None, ...]) -> nnx.Param:
    """A weight of ``shape`` drawn N(0, 1/fan_in), annotated with its logical axis ``names``."""
    init = nnx.with_partitioning(nnx.initializers.normal(1.0 / np.sqrt(shape[-2])), names)
    return nnx.Param(init(rngs.params(), shape))


def gathered(w: nnx.Param) -> jax.Array:
    """The whole weight: all-gathered over the mesh axes it is sharded on (FSDP, TP, experts)."""
    w = w[...]
    if not jax.sharding.get_abstract_mesh().empty:
        w = jax.sharding.reshard(w, P())
    return w


def rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)


class Attention(nnx.Module):
    """Bidirectional multi-head self-attention over the short sequence."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        d = cfg.hidden
        self.heads = cfg.heads
        self.q, self.k, self.v = (kernel(rngs, (d, d), ("embed", "heads")) for _ in range(3))
        self.o = kernel(rngs, (d, d), ("heads", "embed"))

    def __call__(self, x):
        b, s, d = x.shape
        q, k, v = (jnp.reshape(x @ gathered(w), (b, s, self.heads, d // self.heads))
                   for w in (self.q, self.k, self.v))
        att = jax.nn.softmax(jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(d // self.heads))
        return jnp.reshape(jnp.einsum("bhst,bthd->bshd", att, v), (b, s, d)) @ gathered(self.o)


class MLP(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.up = kernel(rngs, (cfg.hidden, cfg.mlp), ("embed", "mlp"))
        self.down = kernel(rngs, (cfg.mlp, cfg.hidden), ("mlp", "embed"))

    def __call__(self, x):
        return jax.nn.gelu(x @ gathered(self.up)) @ gathered(self.down)


class MoE(nnx.Module):
    """A dense soft mixture of experts: every expert sees every token, weighted by the router."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        e, d, ff = cfg.experts, cfg.hidden, cfg.mlp
        self.router = kernel(rngs, (d, e), ("embed", None))
        self.experts_up = kernel(rngs, (e, d, ff), ("exp", "embed", "mlp"))
        self.experts_down = kernel(rngs, (e, ff, d), ("exp", "mlp", "embed"))

    def __call__(self, x):
        gates = jax.nn.softmax(x @ gathered(self.router))                    # (b, s, e)
        h = jax.nn.gelu(jnp.einsum("bsd,edf->bsef", x, gathered(self.experts_up)))
        y = jnp.einsum("bsef,efd->bsed", h, gathered(self.experts_down))
        return jnp.einsum("bsed,bse->bsd", y, gates)


class Block(nnx.Module):
    """Pre-norm residual branches: attention, then the MLP, then the mixture of experts."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)
        self.moe = MoE(cfg, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(rms_norm(x))
        x = x + self.mlp(rms_norm(x))
        return x + self.moe(rms_norm(x))


class Student(nnx.Module):
    """Input vector → ``seq`` tokens (one projection) → blocks → mean over tokens → head."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.seq = cfg.seq
        # Its input axis plays the embedding's role (fsdp), its output the MLP's (tp).
        self.inp = kernel(rngs, (cfg.d_in, cfg.seq * cfg.hidden), ("embed", "mlp"))
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.head = kernel(rngs, (cfg.hidden, cfg.d_out), ("embed", "vocab"))

    def __call__(self, x):
        h = x @ gathered(self.inp)
        h = jnp.reshape(h, (x.shape[0], self.seq, h.shape[-1] // self.seq))
        for block in self.blocks:
            h = block(h)
        return jnp.mean(rms_norm(h), axis=1) @ gathered(self.head)


def build_model(cfg: Config):
    """The student's graph, its parameters (a dict of host arrays) and their ``PartitionSpec``s:
    the logical names of each kernel mapped to mesh axes by :data:`LOGICAL_RULES`."""
    with nnx.use_eager_sharding(False):   # placed below, by global_array (any process count)
        model = Student(cfg, rngs=nnx.Rngs(cfg.seed))
    graphdef, state = nnx.split(model, nnx.Param)
    with nnx.logical_axis_rules(tuple(LOGICAL_RULES.items())):
        specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    return graphdef, nnx.to_pure_dict(state), specs


def teacher(cfg: Config):
    rng = np.random.default_rng(cfg.seed + 1)
    a = rng.standard_normal((cfg.d_in, 2 * cfg.hidden)) / np.sqrt(cfg.d_in)
    b = rng.standard_normal((2 * cfg.hidden, cfg.d_out)) / np.sqrt(2 * cfg.hidden)

    def batch(step: int):
        r = np.random.default_rng(cfg.seed + 1000 + step)
        x = r.standard_normal((cfg.batch, cfg.d_in)).astype(np.float32)
        y = np.tanh(x @ a) @ b + 0.01 * r.standard_normal((cfg.batch, cfg.d_out))
        return x, y.astype(np.float32)
    return batch


# ---------------------------------------------------------------------------------------------
# Training


def make_train_step(graphdef, tx, labels, mesh):
    """The step runs per pod (manual "dcn"): Dion3 gradients stay unreduced over "dcn"."""

    def loss_fn(params, x, y):
        model = nnx.merge(graphdef, params)
        return jnp.mean(jnp.square(model(x) - y))

    def pods_mean(x):   # one pod: nothing to average (and XLA refuses a size-1 all-reduce)
        return x if jax.lax.axis_size("dcn") == 1 else jax.lax.pmean(x, "dcn")

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)   # this pod's gradient
        # Non-matrix leaves (AdamW) are averaged over the pods as usual; the Dion3 matrices are
        # not: Dion3 averages only their selected momentum rows (compressed sync).
        grads = jax.tree.map(lambda g, l: g if l == "dion3"
                             else pods_mean(g), grads, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, pods_mean(loss)

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("dcn"), P("dcn")),
                                 out_specs=(P(), P(), P()), axis_names={"dcn"},
                                 check_vma=False), donate_argnums=(0, 1))


def make_mesh(cfg: Config) -> Mesh:
    """The ``("dcn", "fsdp", "tp", "expert")`` mesh. Over several processes: every device,
    ordered by process, so that pod r (index r along "dcn") is made of whole processes' devices
    (one process per pod when the mesh has as many pods as processes)."""
    n, text = int(np.prod(cfg.mesh)), mesh_text(cfg.mesh)
    if jax.process_count() == 1:
        return jax.make_mesh(cfg.mesh, AXES, devices=jax.devices()[:n],
                             axis_types=(AxisType.Explicit,) * len(AXES))
    if n != jax.device_count():
        raise ValueError(f"--mesh {text} must use all {jax.device_count()} devices of the "
                         f"{jax.process_count()} processes")
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices).reshape(cfg.mesh), AXES,
                axis_types=(AxisType.Explicit,) * len(AXES))


def global_array(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host value that every process holds whole (each places its part)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def setup(cfg: Config) -> dict:
    """Mesh, sharded params, optimizer state and the jitted step (``jax.set_mesh`` is the
    caller's)."""
    n, text = int(np.prod(cfg.mesh)), mesh_text(cfg.mesh)
    if len(jax.devices()) < n:
        raise ValueError(f"--mesh {text} needs {n} devices, found {len(jax.devices())}")
    if cfg.batch % n:
        raise ValueError(f"--batch {cfg.batch} must be divisible by the {n} devices")
    mesh = make_mesh(cfg)
    graphdef, params, specs = build_model(cfg)
    params = jax.tree.map(lambda x, s: global_array(np.asarray(x), NamedSharding(mesh, s)),
                          params, specs)
    labels = dion3_jax.default_param_labels(params, DIMENSION_NUMBERS)
    mesh_options = dion3_jax.MeshOptions(
        shard_axis=AXES[1:], replica_axis="dcn", selection_scope=cfg.selection_scope,
        replica_selection=cfg.replica_selection, seed=cfg.seed)
    tx = dion3_jax.dion3(cfg.lr, cfg.fraction, adam_learning_rate=cfg.adam_lr,
                         dimension_numbers=DIMENSION_NUMBERS, mesh_options=mesh_options)
    with jax.set_mesh(mesh):
        opt_state = tx.init(params)
    return {"mesh": mesh, "params": params, "opt_state": opt_state, "labels": labels,
            "specs": specs, "train_step": make_train_step(graphdef, tx, labels, mesh),
            "data_sharding": NamedSharding(mesh, P(AXES, None)),
            "batch": teacher(cfg)}


def train(cfg: Config) -> dict:
    """Trains and returns ``{"losses": [(step, loss)], "table": str, "seconds": float, ...}``.

    ``params`` and ``opt_state`` are the final global arrays (momentum synchronized over "dcn"),
    ``train_step`` the jitted step (its ``_cache_size()`` is the number of compiles).
    """
    s = setup(cfg)
    params, opt_state, train_step = s["params"], s["opt_state"], s["train_step"]
    first = 0
    with jax.set_mesh(s["mesh"]):
        if cfg.restore:
            params, opt_state, first = restore(cfg.restore, params, opt_state)
        bar = _common.Progress(cfg.steps, "train", cfg.progress and jax.process_index() == 0)
        losses, t0 = [], time.perf_counter()
        for step in range(first, first + cfg.steps):
            x, y = (global_array(a, s["data_sharding"]) for a in s["batch"](step))
            params, opt_state, loss = train_step(params, opt_state, x, y)
            if (step - first) % cfg.log_every == 0 or step == first + cfg.steps - 1:
                log_loss(bar, losses, step, float(loss))
            bar.update(1)
        bar.close()
        seconds = time.perf_counter() - t0
        # Before a checkpoint: make every pod hold the same (averaged) momentum.
        opt_state = dion3_jax.synchronize_momentum(opt_state, "dcn")
        if cfg.save:
            save(cfg.save, params, opt_state, first + cfg.steps)
    table = format_table(losses, cfg, seconds)
    return {"losses": losses, "table": table, "seconds": seconds, "params": params,
            "opt_state": opt_state, "train_step": train_step}


def log_loss(bar: _common.Progress, losses: list, step: int, loss: float) -> None:
    """Records the loss of ``step`` and shows it, with its step, beside the progress counter:
    between logged steps the counter moves on while the loss shown stays the older step's."""
    losses.append((step, loss))
    bar.set_postfix(loss=f"{loss:.4f} (step {step})")


def save(path: str, params, opt_state, step: int) -> None:
    """An orbax checkpoint of the params, the optimizer state and the step count; every process
    calls it and writes its own shards."""
    import orbax.checkpoint as ocp

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.abspath(path), {"params": params, "opt_state": opt_state,
                                      "step": np.array(step, np.int32)}, force=True)
    ckpt.wait_until_finished()
    ckpt.close()


def restore(path: str, params, opt_state):
    """Restores a ``save`` checkpoint onto the shardings of ``params`` and ``opt_state`` (this
    run's mesh, which may differ from the one that saved it); returns them and the step."""
    import orbax.checkpoint as ocp

    target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                          {"params": params, "opt_state": opt_state})
    target["step"] = np.array(0, np.int32)
    ckpt = ocp.StandardCheckpointer()
    out = ckpt.restore(os.path.abspath(path), target)
    ckpt.close()
    return out["params"], out["opt_state"], int(out["step"])


def write_results(out: str, cfg: Config, result: dict) -> None:
    """``results.json`` (config, losses) and ``params.npz`` (gathered); process 0 writes, every
    process must call it (the gather is a collective)."""
    from jax.experimental import multihost_utils

    flat = {jax.tree_util.keystr(k): v
            for k, v in jax.tree_util.tree_leaves_with_path(result["params"])}
    gathered = multihost_utils.process_allgather(flat, tiled=True)
    if jax.process_index() != 0:
        return
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, "params.npz"), **{k: np.asarray(v) for k, v in gathered.items()})
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(config=dataclasses.asdict(cfg), losses=result["losses"],
                       seconds=result["seconds"], processes=jax.process_count(),
                       devices=jax.device_count()), f, indent=1)


def format_table(losses, cfg: Config, seconds: float) -> str:
    lines = [f"Dion3 f={cfg.fraction} on a {'x'.join(map(str, cfg.mesh))} "
             f"({', '.join(AXES)}) mesh, "
             f"selection {cfg.selection_scope}, replica selection {cfg.replica_selection}: "
             f"{cfg.steps} steps in {seconds:.1f} s",
             "| step | train loss (MSE) |", "|---:|---:|"]
    lines += [f"| {s} | {l:.5f} |" for s, l in losses]
    return "\n".join(lines)


def start_backend(cfg: Config) -> None:
    """Joins the processes (``--distributed``; gloo collectives on CPUs) or sets the number of
    simulated CPU devices; must run before any device is used."""
    on_cpu = os.environ.get("JAX_PLATFORMS", "cpu") == "cpu"
    if cfg.distributed:
        if on_cpu:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.config.update("jax_num_cpu_devices", cfg.cpu_devices_per_process)
        jax.distributed.initialize(coordinator_address=cfg.coordinator,
                                   num_processes=cfg.num_processes, process_id=cfg.process_id)
    elif cfg.cpu_devices > 1 and on_cpu:
        try:  # only possible before the backend starts; harmless when it already has enough
            jax.config.update("jax_num_cpu_devices", cfg.cpu_devices)
        except RuntimeError:
            pass


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    start_backend(cfg)
    problem = device_problem(cfg)
    if problem:  # one line, as argparse reports a bad value
        print(f"{os.path.basename(__file__)}: error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    out = train(cfg)
    if cfg.out:
        write_results(cfg.out, cfg, out)
    if jax.process_index() == 0:
        print(out["table"])
    return out


if __name__ == "__main__":
    main()

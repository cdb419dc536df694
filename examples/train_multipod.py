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
"""Train a Flax NNX model with Dion3 on a ("dcn", "fsdp") mesh: FSDP inside a pod, compressed
data-parallel sync across pods.

The mesh has a slow axis ``dcn`` (pods, linked by the data-center network) and a fast axis
``fsdp`` (devices of one pod). Parameters are sharded over ``fsdp`` and replicated over ``dcn``;
the batch is split over both. The training step runs inside ``jax.shard_map(...,
axis_names={"dcn"})``, so each pod computes the gradient of its own half of the batch and the
gradients of the Dion3 matrices are NOT all-reduced over ``dcn``: Dion3
(``mesh_options=dion3_jax.MeshOptions(shard_axis="fsdp", replica_axis="dcn")``)
averages only the selected rows ``M[I, :]`` of the momentum across pods, a ``1/f`` saving of DCN
bytes. The row set ``I`` is drawn from a key shared by the pods (``replica_selection="random"``), so
the update equals the fully synchronized one; ``"norms"`` all-reduces the row norms instead. The
few non-matrix leaves (biases, the head: AdamW) are averaged over ``dcn`` as usual. Before a
checkpoint, :func:`dion3_jax.synchronize_momentum` makes the pods' momenta equal.

The task is a synthetic teacher-student regression (a random two-layer tanh network plus noise),
so the script needs no data. On CPU it simulates 8 devices as a 2 × 4 mesh by default::

    python examples/train_multipod.py                          # 2 x 4 on 8 CPU devices
    python examples/train_multipod.py --mesh 4x2 --fraction 0.125 --steps 300
    python examples/train_multipod.py --mesh 2x4 --replica-selection norms

Several processes (hosts): ``--distributed`` calls ``jax.distributed.initialize`` first (with
``--coordinator``, ``--num-processes`` and ``--process-id``, or the cluster's own variables when
they are left out). The mesh is built from every process's devices, ordered by process, so with
one process per pod ``--mesh <processes>x<devices per process>`` puts "dcn" across the processes.
The run is the single-process run on as many devices (``tests/test_train_multipod.py``). On CPUs
the collectives go through gloo, with ``--cpu-devices-per-process`` devices each. Only process 0
prints and writes::

    # two processes on one machine, 4 CPU devices each: the 2 x 4 run of 8 devices
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


@dataclasses.dataclass
class Config:
    mesh: tuple[int, int] = (2, 4)      # (dcn, fsdp)
    cpu_devices: int = 8
    d_in: int = 32
    hidden: int = 64
    layers: int = 3
    d_out: int = 16
    batch: int = 64                     # global batch (split over dcn × fsdp)
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


def _mesh(text: str) -> tuple[int, int]:
    try:
        dcn, fsdp = (int(t) for t in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must look like 2x4 (DCN x FSDP), got {text!r}") from None
    if dcn < 1 or fsdp < 1:
        raise argparse.ArgumentTypeError(f"both sizes must be >= 1, got {text!r}")
    return dcn, fsdp


def parse_args(argv=None) -> Config:
    """Parses and validates the flags (argparse errors, before any device is touched)."""
    c = Config()
    p = _common.make_parser(__doc__)
    p.add_argument("--mesh", type=_mesh, default="x".join(map(str, c.mesh)),
                   help="mesh shape DCNxFSDP (pods x devices per pod)")
    p.add_argument("--cpu-devices", type=_common.positive_int, default=c.cpu_devices,
                   help="simulated CPU devices when running on CPU")
    sizes = {"d_in": "input width of the teacher-student task (divisible by the fsdp size)",
             "hidden": "hidden width (divisible by the fsdp size)",
             "layers": "hidden layers", "d_out": "output width",
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
    is split over every device, the weights' first or second axis over "fsdp"."""
    dcn, fsdp = a.mesh
    if a.batch % (dcn * fsdp):
        return (f"--batch {a.batch} must be divisible by the {dcn * fsdp} devices of "
                f"--mesh {dcn}x{fsdp}")
    for flag, value in (("--d-in", a.d_in), ("--hidden", a.hidden)):
        if value % fsdp:
            return (f"{flag} {value} must be divisible by the fsdp size {fsdp} of --mesh "
                    f"{dcn}x{fsdp} (the weights are sharded over it)")
    return None


def device_problem(cfg: Config) -> str | None:
    """What keeps the mesh off this run's devices (a sentence), or ``None``; call it once the
    backend has started (:func:`start_backend`)."""
    dcn, fsdp = cfg.mesh
    n, found = dcn * fsdp, jax.device_count()
    if jax.process_count() > 1 and n != found:
        return (f"--mesh {dcn}x{fsdp} must use all {found} devices of the "
                f"{jax.process_count()} processes")
    if n > found:
        hint = f"; on CPU, pass --cpu-devices {n}" if jax.default_backend() == "cpu" else ""
        return f"--mesh {dcn}x{fsdp} needs {n} devices, found {found}{hint}"
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
# Model: an MLP whose weights are all-gathered for the forward pass (FSDP, Explicit sharding).


class Dense(nnx.Module):
    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (d_in, d_out)) / np.sqrt(d_in))
        self.bias = nnx.Param(jnp.zeros((d_out,)))

    def __call__(self, x):
        w = self.kernel[...]
        if not jax.sharding.get_abstract_mesh().empty:   # FSDP: gather the weight to use it
            w = jax.sharding.reshard(w, P())
        return x @ w + self.bias[...]


class MLP(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.inp = Dense(cfg.d_in, cfg.hidden, rngs=rngs)
        self.layers = nnx.List([Dense(cfg.hidden, cfg.hidden, rngs=rngs)
                                for _ in range(cfg.layers)])
        self.head = Dense(cfg.hidden, cfg.d_out, rngs=rngs)

    def __call__(self, x):
        x = jnp.tanh(self.inp(x))
        for layer in self.layers:
            x = x + jnp.tanh(layer(x))
        return self.head(x)


def param_specs(params, cfg: Config):
    """FSDP specs: matrices sharded over "fsdp" (alternating rows / columns), vectors replicated."""
    def spec(path, x):
        if x.ndim < 2:
            return P()
        name = jax.tree_util.keystr(path)
        rows = "layers" in name and int(path[1].key) % 2 == 1  # odd hidden layers: output axis
        return P(None, "fsdp") if rows else P("fsdp", None)
    return jax.tree_util.tree_map_with_path(spec, params)


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
    """The ``("dcn", "fsdp")`` mesh. Over several processes: every device, ordered by process,
    so that pod r (row r) is made of whole processes' devices (one process per pod when
    ``--mesh`` is ``<processes>x<devices per process>``)."""
    dcn, fsdp = cfg.mesh
    if jax.process_count() == 1:
        return jax.make_mesh((dcn, fsdp), ("dcn", "fsdp"), devices=jax.devices()[:dcn * fsdp])
    if dcn * fsdp != jax.device_count():
        raise ValueError(f"--mesh {dcn}x{fsdp} must use all {jax.device_count()} devices of the "
                         f"{jax.process_count()} processes")
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices).reshape(dcn, fsdp), ("dcn", "fsdp"),
                axis_types=(AxisType.Explicit,) * 2)


def global_array(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host value that every process holds whole (each places its part)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def setup(cfg: Config) -> dict:
    """Mesh, sharded params, optimizer state and the jitted step (``jax.set_mesh`` is the
    caller's)."""
    dcn, fsdp = cfg.mesh
    n = dcn * fsdp
    if len(jax.devices()) < n:
        raise ValueError(f"--mesh {dcn}x{fsdp} needs {n} devices, found {len(jax.devices())}")
    if cfg.batch % n:
        raise ValueError(f"--batch {cfg.batch} must be divisible by the {n} devices")
    mesh = make_mesh(cfg)
    model = MLP(cfg, rngs=nnx.Rngs(cfg.seed))
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    specs = param_specs(params, cfg)
    params = jax.tree.map(lambda x, s: global_array(np.asarray(x), NamedSharding(mesh, s)),
                          params, specs)
    labels = dion3_jax.default_param_labels(params)
    mesh_options = dion3_jax.MeshOptions(
        shard_axis="fsdp", replica_axis="dcn", selection_scope=cfg.selection_scope,
        replica_selection=cfg.replica_selection, seed=cfg.seed)
    tx = dion3_jax.dion3(cfg.lr, cfg.fraction, adam_learning_rate=cfg.adam_lr,
                         mesh_options=mesh_options)
    with jax.set_mesh(mesh):
        opt_state = tx.init(params)
    return {"mesh": mesh, "params": params, "opt_state": opt_state, "labels": labels,
            "train_step": make_train_step(graphdef, tx, labels, mesh),
            "data_sharding": NamedSharding(mesh, P(("dcn", "fsdp"), None)),
            "batch": teacher(cfg)}


def train(cfg: Config) -> dict:
    """Trains and returns ``{"losses": [(step, loss)], "table": str, "seconds": float, ...}``.

    ``params`` and ``opt_state`` are the final global arrays (momentum synchronized over "dcn").
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
            "opt_state": opt_state}


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
    lines = [f"Dion3 f={cfg.fraction} on a {cfg.mesh[0]}x{cfg.mesh[1]} (dcn, fsdp) mesh, "
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

"""Train a Flax NNX model with Dion3 on a ("dcn", "fsdp") mesh: FSDP inside a pod, compressed
data-parallel sync across pods.

The mesh has a slow axis ``dcn`` (pods, linked by the data-centre network) and a fast axis
``fsdp`` (devices of one pod). Parameters are sharded over ``fsdp`` and replicated over ``dcn``;
the batch is split over both. The training step runs inside ``jax.shard_map(...,
axis_names={"dcn"})``, so each pod computes the gradient of its own half of the batch and the
gradients of the Dion3 matrices are NOT all-reduced over ``dcn``: Dion3
(``mesh_options=dion3_jax.MeshOptions(shard_axis="fsdp", replica_axis="dcn")``)
averages only the selected rows ``M[I, :]`` of the momentum across pods, a ``1/f`` saving of DCN
bytes. The row set ``I`` is drawn from a key shared by the pods (``replica_selection="random"``), so
the update equals the fully synchronised one; ``"norms"`` all-reduces the row norms instead. The
few non-matrix leaves (biases, the head: AdamW) are averaged over ``dcn`` as usual. Before a
checkpoint, :func:`dion3_jax.synchronize_momentum` makes the pods' momenta equal.

The task is a synthetic teacher-student regression (a random two-layer tanh network plus noise),
so the script needs no data. On CPU it simulates 8 devices as a 2 × 4 mesh by default::

    python examples/train_multipod.py                          # 2 x 4 on 8 CPU devices
    python examples/train_multipod.py --mesh 4x2 --fraction 0.125 --steps 300
    python examples/train_multipod.py --mesh 2x4 --replica-selection norms

On several hosts, call ``jax.distributed.initialize()`` first (``--distributed``); the mesh code is
the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
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
    sizes = {"d_in": "input width of the teacher-student task", "hidden": "hidden width",
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
    p.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first (several hosts)")
    a = p.parse_args(argv)
    if a.batch % (a.mesh[0] * a.mesh[1]):
        p.error(f"--batch {a.batch} must be divisible by the {a.mesh[0] * a.mesh[1]} devices "
                f"of --mesh {a.mesh[0]}x{a.mesh[1]}")
    return Config(**vars(a))


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

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)   # this pod's gradient
        # Non-matrix leaves (AdamW) are averaged over the pods as usual; the Dion3 matrices are
        # not: Dion3 averages only their selected momentum rows (compressed sync).
        grads = jax.tree.map(lambda g, l: g if l == "dion3"
                             else jax.lax.pmean(g, "dcn"), grads, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, jax.lax.pmean(loss, "dcn")

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("dcn"), P("dcn")),
                                 out_specs=(P(), P(), P()), axis_names={"dcn"},
                                 check_vma=False), donate_argnums=(0, 1))


def setup(cfg: Config) -> dict:
    """Mesh, sharded params, optimizer state and the jitted step (``jax.set_mesh`` is the
    caller's)."""
    dcn, fsdp = cfg.mesh
    n = dcn * fsdp
    if len(jax.devices()) < n:
        raise ValueError(f"--mesh {dcn}x{fsdp} needs {n} devices, found {len(jax.devices())}")
    if cfg.batch % n:
        raise ValueError(f"--batch {cfg.batch} must be divisible by the {n} devices")
    mesh = jax.make_mesh((dcn, fsdp), ("dcn", "fsdp"), devices=jax.devices()[:n])
    model = MLP(cfg, rngs=nnx.Rngs(cfg.seed))
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    specs = param_specs(params, cfg)
    params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
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
    """Trains and returns ``{"losses": [(step, loss)], "table": str, "seconds": float, ...}``."""
    s = setup(cfg)
    params, opt_state, train_step = s["params"], s["opt_state"], s["train_step"]
    with jax.set_mesh(s["mesh"]):
        bar = _common.Progress(cfg.steps, "train", cfg.progress)
        losses, t0 = [], time.perf_counter()
        for step in range(cfg.steps):
            x, y = (jax.device_put(a, s["data_sharding"]) for a in s["batch"](step))
            params, opt_state, loss = train_step(params, opt_state, x, y)
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                losses.append((step, float(loss)))
                bar.set_postfix(loss=f"{float(loss):.4f}")
            bar.update(1)
        bar.close()
        seconds = time.perf_counter() - t0
        # Before a checkpoint: make every pod hold the same (averaged) momentum.
        opt_state = dion3_jax.synchronize_momentum(opt_state, "dcn")
    table = format_table(losses, cfg, seconds)
    return {"losses": losses, "table": table, "seconds": seconds, "params": params,
            "opt_state": opt_state}


def format_table(losses, cfg: Config, seconds: float) -> str:
    lines = [f"Dion3 f={cfg.fraction} on a {cfg.mesh[0]}x{cfg.mesh[1]} (dcn, fsdp) mesh, "
             f"selection {cfg.selection_scope}, replica selection {cfg.replica_selection}: "
             f"{cfg.steps} steps in {seconds:.1f} s",
             "| step | train loss (MSE) |", "|---:|---:|"]
    lines += [f"| {s} | {l:.5f} |" for s, l in losses]
    return "\n".join(lines)


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    if cfg.distributed:
        jax.distributed.initialize()
    elif cfg.cpu_devices > 1 and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        try:  # only possible before the backend starts; harmless when it already has enough
            jax.config.update("jax_num_cpu_devices", cfg.cpu_devices)
        except RuntimeError:
            pass
    out = train(cfg)
    print(out["table"])
    return out


if __name__ == "__main__":
    main()

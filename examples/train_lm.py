"""Train a byte-level transformer LM on the Python standard library, with Dion3 and AdamW.

The main job of ``dion3_jax``: a small decoder-only transformer (Flax NNX) learns to predict the
next byte of real text that ships with every machine, the ``.py`` sources of the Python standard
library. The same model (same initialisation), the same batches in the same order and the same
step budget are given to each optimizer in turn; the script prints a table of train and held-out
loss (nats/byte) and saves the loss curves as a PNG.

On a 2-core CPU the defaults (0.85M parameters, 400 steps of 2k bytes) run in a few minutes for
both optimizers; their learning rates and momenta were tuned for that budget (``docs/TRAINING.md``).
Every size is a flag, so the same script scales up on a GPU, e.g. to a 25M-parameter model with 16k
bytes per step, the shape of the reference quality point in DESIGN.md (not run here; re-tune the
learning rates and momenta for a new budget)::

    python examples/train_lm.py --d-model 512 --layers 8 --heads 8 --seq-len 512 --batch 32 \\
        --steps 1800 --warmup 100 --data-mb 10 --compute-dtype bfloat16

Data split: every file goes to the held-out set or to the training set by a hash of its path
relative to the stdlib root, so the split is the same on every machine and held-out files are
never trained on. Loss is the mean cross-entropy per byte in nats.

Usage::

    python examples/train_lm.py                       # Dion3 and AdamW, CPU defaults
    python examples/train_lm.py --optimizers dion3 --dion3-lr 0.04 --steps 500
    python examples/train_lm.py --help
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import math
import os
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

try:
    import dion3_jax
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import dion3_jax

OPTIMIZERS = ("dion3", "adamw", "normuon", "muon")


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    """Everything a run depends on. Every field is also a command-line flag (``--d-model`` ...)."""

    # Model.
    d_model: int = 128
    layers: int = 4
    heads: int = 4
    seq_len: int = 128
    mlp_ratio: int = 4
    compute_dtype: str = "float32"  # "bfloat16" on a GPU; parameters stay float32.
    # Data.
    batch: int = 16
    data_mb: float = 8.0  # cap on the stdlib text read (MB); GPU image has ~10 MB, CPU ~30 MB.
    heldout_percent: float = 5.0  # share of files (by path hash) kept out of training.
    # Training.
    steps: int = 400
    warmup: int = 50  # linear warm-up steps, then cosine decay to 0.
    optimizers: str = "dion3,adamw"  # comma-separated, from OPTIMIZERS.
    seed: int = 0
    # AdamW (the baseline).
    adamw_lr: float = 8e-3
    adamw_b1: float = 0.8
    adamw_b2: float = 0.95
    adamw_weight_decay: float = 0.1  # on 2D+ leaves only (not norms).
    # Dion3 (and muon / normuon, which share these settings at fraction 1).
    dion3_lr: float = 0.04
    fraction: float = 0.25
    mu: float = 0.8  # reference default 0.95; 0.8 ≈ 0.95**(1/f) wins here, see docs/TRAINING.md.
    beta2: float = 0.95
    dion3_weight_decay: float = 0.01
    dion3_adam_lr: float | None = None  # lr of Dion3's AdamW branch (embed, lm_head, norms);
    #                                     None: the same as --adamw-lr.
    # Evaluation and output.
    eval_every: int = 100
    eval_batches: int = 8  # held-out batches per periodic evaluation.
    final_eval_batches: int = 32  # batches for the final train / held-out losses.
    out: str = "runs/train_lm"
    progress: bool = True


_HELP = {
    "d_model": "model width",
    "layers": "transformer blocks",
    "heads": "attention heads (d_model must be divisible by heads)",
    "seq_len": "context length in bytes",
    "mlp_ratio": "MLP hidden size / d_model",
    "compute_dtype": "activation dtype: float32 or bfloat16 (parameters stay float32)",
    "batch": "sequences per step",
    "data_mb": "cap on the stdlib text read, in MB",
    "heldout_percent": "percent of files (chosen by path hash) held out",
    "steps": "optimizer steps per run (the same budget for every optimizer)",
    "warmup": "linear warm-up steps before the cosine decay to 0",
    "optimizers": f"comma-separated list from {', '.join(OPTIMIZERS)}",
    "seed": "seed of the initialisation and of the batch order",
    "adamw_lr": "AdamW peak learning rate",
    "adamw_b1": "AdamW beta1 (also used by Dion3's AdamW branch)",
    "adamw_b2": "AdamW beta2 (also used by Dion3's AdamW branch)",
    "adamw_weight_decay": "AdamW decoupled weight decay, on 2D leaves only",
    "dion3_lr": "Dion3 / NorMuon / Muon peak learning rate (matrices)",
    "fraction": "Dion3 row fraction f (normuon and muon use f = 1)",
    "mu": "Dion3 error-feedback decay (momentum at f = 1)",
    "beta2": "NorMuon second-moment decay",
    "dion3_weight_decay": "Dion3 decoupled weight decay of the matrices",
    "dion3_adam_lr": "lr of Dion3's AdamW branch (embed, lm_head, norms); default --adamw-lr",
    "eval_every": "steps between held-out evaluations",
    "eval_batches": "held-out batches per periodic evaluation",
    "final_eval_batches": "batches for the final train / held-out losses",
    "out": "output directory (loss.png, table.txt, results.json)",
    "progress": "show a tqdm progress bar",
}


def parse_args(argv: list[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        kw = dict(default=field.default, help=_HELP[field.name])
        if field.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif field.type == "float | None":
            parser.add_argument(flag, type=float, **kw)
        else:
            kind = {"int": int, "float": float, "str": str}[field.type]
            parser.add_argument(flag, type=kind, **kw)
    return Config(**vars(parser.parse_args(argv)))


# ---------------------------------------------------------------------------------------------
# Data: the Python standard library's sources, as bytes
# ---------------------------------------------------------------------------------------------


def _is_heldout(relpath: str, percent: float) -> bool:
    digest = hashlib.sha256(relpath.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 10_000 < percent * 100


def load_stdlib_bytes(
    data_mb: float, heldout_percent: float
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Returns (train, heldout) uint8 arrays of concatenated stdlib sources, and a summary.

    Files are read in sorted order of their path relative to the stdlib root until ``data_mb``
    megabytes have been read; each file goes wholly to one split, by a hash of that path. Files
    are separated by a NUL byte (which never occurs in Python source).
    """
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    paths = [p for p in paths if "site-packages" not in p]
    cap = int(data_mb * 1e6)
    train, heldout, total, n_files = [], [], 0, [0, 0]
    for path in paths:
        if total >= cap:
            break
        with open(path, "rb") as f:
            data = f.read() + b"\0"
        rel = os.path.relpath(path, root)
        held = _is_heldout(rel, heldout_percent)
        (heldout if held else train).append(data)
        n_files[held] += 1
        total += len(data)
    if not train or not heldout:
        raise ValueError(f"not enough stdlib text under {root} ({total=} bytes, {n_files=})")
    train_arr = np.frombuffer(b"".join(train), dtype=np.uint8)
    heldout_arr = np.frombuffer(b"".join(heldout), dtype=np.uint8)
    info = dict(
        root=root,
        train_files=n_files[0],
        heldout_files=n_files[1],
        train_bytes=int(train_arr.size),
        heldout_bytes=int(heldout_arr.size),
    )
    return train_arr, heldout_arr, info


def windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """Gathers ``data[s : s + seq_len + 1]`` for each start: (len(starts), seq_len + 1) int32."""
    return data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def fixed_eval_starts(n_bytes: int, count: int, seq_len: int) -> np.ndarray:
    """``count`` evenly spaced, non-overlapping where possible, window starts over a byte array."""
    last = n_bytes - seq_len - 1
    return np.linspace(0, last, count).astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Model: a pre-norm decoder-only transformer with rotary position embeddings
# ---------------------------------------------------------------------------------------------


def rope(x: jax.Array) -> jax.Array:
    """Rotary position embedding on (batch, seq, heads, head_dim)."""
    _, t, _, d = x.shape
    freqs = 1.0 / (10_000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs[None, :]  # (t, d/2)
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, d: int, heads: int, dtype, rngs: nnx.Rngs):
        self.heads = heads
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)
        # Separate q, k, v, o kernels, each (in, out): every one is its own matrix for Dion3.
        self.q, self.k, self.v, self.o = linear(d, d), linear(d, d), linear(d, d), linear(d, d)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        split = lambda y: y.reshape(b, t, self.heads, d // self.heads)
        q, k, v = rope(split(self.q(x))), rope(split(self.k(x))), split(self.v(x))
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.reshape(b, t, d))


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, mlp_ratio: int, dtype, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.attn = Attention(d, heads, dtype, rngs)
        self.mlp_norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.fc = nnx.Linear(d, mlp_ratio * d, use_bias=False, dtype=dtype, rngs=rngs)
        self.proj = nnx.Linear(mlp_ratio * d, d, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.proj(jax.nn.gelu(self.fc(self.mlp_norm(x))))


class ByteLM(nnx.Module):
    """Byte-level GPT. ``embed`` and ``lm_head`` are 2D but are NOT matrices for Dion3: the
    default ``dion3_jax.dion3`` labels send them (and every non-2D leaf) to its AdamW branch."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.compute_dtype)
        self.embed = nnx.Embed(
            256, cfg.d_model, dtype=dtype, embedding_init=nnx.initializers.normal(1.0), rngs=rngs
        )
        self.blocks = nnx.List(
            [Block(cfg.d_model, cfg.heads, cfg.mlp_ratio, dtype, rngs) for _ in range(cfg.layers)]
        )
        self.final_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.lm_head = nnx.Linear(
            cfg.d_model,
            256,
            use_bias=False,
            dtype=dtype,
            kernel_init=nnx.initializers.normal(cfg.d_model**-0.5),
            rngs=rngs,
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x)).astype(jnp.float32)


def loss_fn(model: ByteLM, batch: jax.Array) -> jax.Array:
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@nnx.jit
def train_step(model: ByteLM, optimizer: nnx.Optimizer, batch: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def eval_step(model: ByteLM, batch: jax.Array) -> jax.Array:
    return loss_fn(model, batch)


# ---------------------------------------------------------------------------------------------
# Optimizers
# ---------------------------------------------------------------------------------------------


def schedule(peak: float, cfg: Config) -> optax.Schedule:
    """Linear warm-up to ``peak`` over ``cfg.warmup`` steps, then cosine decay to 0."""
    warmup = min(cfg.warmup, max(cfg.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(cfg.steps, warmup + 1), 0.0)


def _decay_mask(params):
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(name: str, cfg: Config) -> tuple[optax.GradientTransformation, dict]:
    """Returns the optax transformation for ``name`` and the hyperparameters it used."""
    adam_lr = cfg.adamw_lr if cfg.dion3_adam_lr is None else cfg.dion3_adam_lr
    if name == "adamw":
        hp = dict(lr=cfg.adamw_lr, b1=cfg.adamw_b1, b2=cfg.adamw_b2, wd=cfg.adamw_weight_decay)
        tx = optax.adamw(
            schedule(cfg.adamw_lr, cfg),
            b1=cfg.adamw_b1,
            b2=cfg.adamw_b2,
            weight_decay=cfg.adamw_weight_decay,
            mask=_decay_mask,
        )
        return tx, hp
    if name in ("dion3", "normuon", "muon"):
        fraction = cfg.fraction if name == "dion3" else 1.0
        hp = dict(lr=cfg.dion3_lr, fraction=fraction, wd=cfg.dion3_weight_decay, adam_lr=adam_lr)
        kwargs = dict(
            mu=cfg.mu,
            weight_decay=cfg.dion3_weight_decay,
            adam_learning_rate=schedule(adam_lr, cfg),
            adam_b1=cfg.adamw_b1,
            adam_b2=cfg.adamw_b2,
        )
        if name == "dion3":
            tx = dion3_jax.dion3(
                schedule(cfg.dion3_lr, cfg), fraction=fraction, beta2=cfg.beta2, **kwargs
            )
        elif name == "normuon":
            tx = dion3_jax.normuon(schedule(cfg.dion3_lr, cfg), beta2=cfg.beta2, **kwargs)
        else:
            tx = dion3_jax.muon(schedule(cfg.dion3_lr, cfg), **kwargs)
        return tx, hp
    raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def evaluate(model: ByteLM, batches: np.ndarray) -> float:
    losses = [eval_step(model, jnp.asarray(b)) for b in batches]
    return float(np.mean(jax.device_get(losses)))


def run_one(name: str, cfg: Config, data: dict) -> dict:
    """Trains one model with optimizer ``name`` on the shared batch order; returns its record."""
    model = ByteLM(cfg, nnx.Rngs(cfg.seed))  # the same initialisation for every optimizer
    tx, hp = make_optimizer(name, cfg)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    train_starts = data["train_starts"]
    losses, evals = [], []
    bar = _progress(cfg.steps, name, cfg.progress)
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        batch = windows(data["train"], train_starts[step], cfg.seq_len)
        losses.append(train_step(model, optimizer, jnp.asarray(batch)))
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            evals.append((step + 1, evaluate(model, data["heldout_eval"][: cfg.eval_batches])))
            bar.set_postfix(loss=f"{float(losses[-1]):.3f}", heldout=f"{evals[-1][1]:.3f}")
        elif step % 10 == 0:
            bar.set_postfix(loss=f"{float(losses[-1]):.3f}")
        bar.update(1)
    losses = [float(x) for x in jax.device_get(losses)]
    seconds = time.perf_counter() - t0
    bar.close()
    if not all(math.isfinite(x) for x in losses):
        print(f"warning: {name} produced a non-finite training loss")
    return dict(
        optimizer=name,
        hyperparameters=hp,
        train_losses=losses,
        heldout_curve=evals,
        train_loss=evaluate(model, data["train_eval"]),
        heldout_loss=evaluate(model, data["heldout_final"]),
        seconds=seconds,
    )


def _progress(total: int, desc: str, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the examples/test extras
        tqdm = None
    if tqdm is None or not enabled:

        class _Null:
            def update(self, n):
                pass

            def set_postfix(self, **kw):
                pass

            def close(self):
                pass

        return _Null()
    return tqdm(total=total, desc=f"{desc:>8}", dynamic_ncols=True)


def prepare_data(cfg: Config) -> dict:
    train, heldout, info = load_stdlib_bytes(cfg.data_mb, cfg.heldout_percent)
    rng = np.random.default_rng(cfg.seed)
    high = train.size - cfg.seq_len - 1
    n_final = cfg.final_eval_batches * cfg.batch
    held = windows(heldout, fixed_eval_starts(heldout.size, n_final, cfg.seq_len), cfg.seq_len)
    tr = windows(train, fixed_eval_starts(train.size, n_final, cfg.seq_len), cfg.seq_len)
    # The periodic evaluation uses a spread-out subset of the final held-out windows.
    sub = held[np.linspace(0, n_final - 1, cfg.eval_batches * cfg.batch).astype(int)]
    return dict(
        train=train,
        info=info,
        # One random window start per (step, row): the same batch order for every optimizer.
        train_starts=rng.integers(0, high, size=(cfg.steps, cfg.batch)),
        train_eval=tr.reshape(cfg.final_eval_batches, cfg.batch, -1),
        heldout_final=held.reshape(cfg.final_eval_batches, cfg.batch, -1),
        heldout_eval=sub.reshape(cfg.eval_batches, cfg.batch, -1),
    )


def format_table(results: list[dict]) -> str:
    header = f"{'optimizer':<10} {'lr':>8} {'train loss':>11} {'held-out loss':>14} {'time (s)':>9}"
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r['optimizer']:<10} {r['hyperparameters']['lr']:>8.3g} {r['train_loss']:>11.4f} "
            f"{r['heldout_loss']:>14.4f} {r['seconds']:>9.1f}"
        )
    lines.append("(nats/byte; train and held-out losses measured on fixed windows after training)")
    return "\n".join(lines)


def plot_curves(results: list[dict], path: str, cfg: Config) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, r in enumerate(results):
        color = f"C{i}"
        x = np.asarray(r["train_losses"])
        k = max(1, min(25, x.size // 20))
        smooth = np.convolve(x, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(k, x.size + 1), smooth, color=color, alpha=0.6, lw=1,
                label=f"{r['optimizer']} train (lr {r['hyperparameters']['lr']:g})")
        steps, held = zip(*r["heldout_curve"])
        ax.plot(steps, held, "o-", color=color, lw=2, ms=4, label=f"{r['optimizer']} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    finals = [r["heldout_loss"] for r in results]
    ax.set_ylim(min(finals) - 0.2, min(finals) + 2.0)
    ax.set_title(
        f"byte LM on stdlib sources: d={cfg.d_model}, L={cfg.layers}, T={cfg.seq_len}, "
        f"B={cfg.batch}, {cfg.steps} steps"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(cfg: Config) -> dict:
    """Runs every optimizer in ``cfg.optimizers`` and writes the table, PNG and JSON to ``cfg.out``.

    Returns a dict with ``results`` (one record per optimizer: hyperparameters, per-step train
    losses, held-out curve, final train and held-out losses, seconds), ``table`` (str), ``plot``
    and ``json`` (paths) and ``data`` (a summary of the text used).
    """
    names = [n.strip() for n in cfg.optimizers.split(",") if n.strip()]
    for n in names:
        if n not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {n!r} in {cfg.optimizers=}; choose from {OPTIMIZERS}"
            )
    if cfg.d_model % cfg.heads or (cfg.d_model // cfg.heads) % 2:
        raise ValueError(f"d_model must be heads × an even head_dim: {cfg.d_model=}, {cfg.heads=}")
    data = prepare_data(cfg)
    model = ByteLM(cfg, nnx.Rngs(cfg.seed))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    info = data["info"]
    print(
        f"data: {info['train_files']} train files ({info['train_bytes'] / 1e6:.1f} MB), "
        f"{info['heldout_files']} held-out files ({info['heldout_bytes'] / 1e6:.2f} MB) "
        f"from {info['root']}"
    )
    print(
        f"model: {n_params / 1e6:.2f}M parameters, d_model={cfg.d_model}, layers={cfg.layers}, "
        f"heads={cfg.heads}, seq_len={cfg.seq_len}; batch={cfg.batch}, steps={cfg.steps} "
        f"({cfg.batch * cfg.seq_len * cfg.steps / 1e6:.1f}M bytes); device={jax.devices()[0]}"
    )
    results = [run_one(name, cfg, data) for name in names]
    table = format_table(results)
    print(table)
    os.makedirs(cfg.out, exist_ok=True)
    plot = os.path.join(cfg.out, "loss.png")
    plot_curves(results, plot, cfg)
    with open(os.path.join(cfg.out, "table.txt"), "w") as f:
        f.write(table + "\n")
    summary = os.path.join(cfg.out, "results.json")
    with open(summary, "w") as f:
        json.dump(dict(config=dataclasses.asdict(cfg), data=info, results=results), f, indent=1)
    print(f"wrote {plot}, {summary}")
    return dict(results=results, table=table, plot=plot, json=summary, data=info, params=n_params)


def main(argv: list[str] | None = None) -> dict:
    return train(parse_args(argv))


if __name__ == "__main__":
    main()

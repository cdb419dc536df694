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
"""Train a byte-level transformer LM on the Python standard library: Dion3, NorMuon and AdamW.

The main job of ``dion3_jax``: a small decoder-only transformer (Flax NNX) learns to predict the
next byte of real text that ships with every machine, the ``.py`` sources of the Python standard
library. Each optimizer in turn gets the same model (same initialization), the same batches in the
same order and the same step budget; the script prints a table of train and held-out loss
(nats/byte), the time of one optimizer step and the share of it spent in the optimizer update
(a full jitted step against a jitted forward + backward alone), and saves the loss curves as a PNG.

Two budgets (``--budget``): on a 2-core CPU the defaults (``cpu``: 0.85M parameters, 400 steps
of 2 KB, one seed) run in a few minutes for the three optimizers; their learning rates and
momenta were tuned for that budget (``docs/TRAINING.md``). Such a run shows that the optimizers
train and what their steps cost, not which one trains better: one seed of 400 steps does not
resolve the differences. ``gpu``, the default where JAX's first device is a GPU, trains the
quality study's model (25M parameters, 16 KB per step, bfloat16 activations, its learning rates;
``docs/QUALITY.md``) for 1800 steps with three seeds, and gives the held-out loss as mean ± std
over the seeds and each difference to Dion3 per seed; what has been recorded on a GPU is in
``docs/TRAINING.md``. A flag given explicitly overrides its budget's value. Dion3's learning rate
and momentum follow from NorMuon's by the rules the quality study supports
(``docs/QUALITY.md``): ``lr_f = lr_1 / √f`` and ``μ_f = μ_1^(1/f)``.

Data split: every file goes to the held-out set or to the training set by a hash of its path
relative to the stdlib root, so the split is the same on every machine and held-out files are
never trained on. Loss is the mean cross-entropy per byte in nats.

Each run writes ``config.json`` at the start and ``table.txt``, ``results.json`` and ``loss.png``
at the end into a new folder ``runs/train_lm/<YYYYmmdd-HHMMSS>/`` (or ``--out``; an earlier run
there is never overwritten unless ``--overwrite`` is given).

Checkpoints: ``--checkpoint-every N`` saves, every N steps and at the last step, an orbax
checkpoint per optimizer under ``<run>/checkpoints/<optimizer>/<step>/`` (``<optimizer>-seed<k>``
with several seeds): the model's and the
``nnx.Optimizer``'s state, and a JSON record of the step reached, the seed (the batch of step s
is a function of the seed and s only, so the step is the data position) and the losses and step
times so far. ``--resume <run>`` continues every optimizer from its latest checkpoint with the
run's settings (``<run>/config.json``) and writes the outputs into the same folder; earlier
outputs there are kept and the new ones get a ``-resumed<k>`` suffix. The continued run is
bitwise the uninterrupted one on the CPU (``tests/test_train_lm.py``). ``--stop-after S`` stops
every optimizer after step S with a checkpoint, e.g. to fit a time limit.

Usage::

    python examples/train_lm.py                       # Dion3, NorMuon and AdamW, --budget auto
    python examples/train_lm.py --budget gpu --steps 300 --seeds 1   # the GPU model, shorter
    python examples/train_lm.py --optimizers dion3 --steps 200
    python examples/train_lm.py --checkpoint-every 100 --out runs/mine   # then, if stopped:
    python examples/train_lm.py --resume runs/mine
    python examples/train_lm.py --help
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import importlib.util
import json
import math
import os
import shutil
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
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

OPTIMIZERS = ("dion3", "normuon", "adamw", "muon")


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
    optimizers: str = "dion3,normuon,adamw"  # comma-separated, from OPTIMIZERS.
    seed: int = 0
    seeds: int = 1  # every optimizer is trained once per seed: seed, seed + 1, ...
    budget: str = "cpu"  # the preset the defaults came from (BUDGETS); the CLI picks it.
    # AdamW (the baseline; its lr, b1 and b2 also drive the AdamW branch of the others).
    adamw_lr: float = 8e-3
    adamw_b1: float = 0.8
    adamw_b2: float = 0.95
    adamw_weight_decay: float = 0.1  # on 2D leaves only (not norms).
    # The matrices: NorMuon / Muon (f = 1) and Dion3 (f < 1).
    normuon_lr: float = 0.02
    mu: float = 0.95  # momentum at f = 1.
    beta2: float = 0.95
    dion3_weight_decay: float = 0.01
    fraction: float = 0.25
    dion3_lr: float | None = None  # None: normuon_lr / sqrt(fraction).
    dion3_mu: float | None = None  # None: mu ** (1 / fraction).
    dion3_adam_lr: float | None = None  # lr of the AdamW branch; None: adamw_lr.
    # Evaluation and output.
    eval_every: int = 100
    eval_batches: int = 8  # held-out batches per periodic evaluation.
    final_eval_batches: int = 32  # batches for the final train / held-out losses.
    timing_reps: int = 10  # forward + backward passes timed to split the step time.
    out: str | None = None  # None: a new folder runs/train_lm/<YYYYmmdd-HHMMSS>.
    overwrite: bool = False
    progress: bool = True
    # Checkpoints (run control: they never change the trajectory).
    checkpoint_every: int = 0  # 0: no checkpoints; else every N steps and at the last step.
    stop_after: int | None = None  # stop every optimizer after this step (with a checkpoint).
    resume: str | None = None  # a run folder to continue from its latest checkpoints.

    @property
    def names(self) -> list[str]:
        return [n.strip() for n in self.optimizers.split(",") if n.strip()]

    def matrix_lr(self, name: str) -> float:
        """Peak learning rate of the matrices for optimizer ``name``."""
        if name != "dion3":
            return self.normuon_lr
        if self.dion3_lr is not None:
            return self.dion3_lr
        return dion3_jax.transfer_learning_rate(self.normuon_lr, 1.0, self.fraction)

    def matrix_mu(self, name: str) -> float:
        """Momentum (error-feedback decay for Dion3) of optimizer ``name``."""
        if name != "dion3":
            return self.mu
        return self.mu ** (1.0 / self.fraction) if self.dion3_mu is None else self.dion3_mu


# (flag type, help) per field; the defaults come from Config.
_FLAGS = {
    "d_model": (_common.positive_int, "model width"),
    "layers": (_common.positive_int, "transformer blocks"),
    "heads": (_common.positive_int, "attention heads (d_model must be divisible by heads)"),
    "seq_len": (_common.positive_int, "context length in bytes"),
    "mlp_ratio": (_common.positive_int, "MLP hidden size / d_model"),
    "compute_dtype": (str, "activation dtype (parameters stay float32)"),
    "batch": (_common.positive_int, "sequences per step"),
    "data_mb": (_common.positive_float, "cap on the stdlib text read, in MB"),
    "heldout_percent": (_common.percent, "percent of files (chosen by path hash) held out"),
    "steps": (_common.positive_int, "optimizer steps per run (the same for every optimizer)"),
    "warmup": (_common.nonnegative_int, "linear warm-up steps before the cosine decay to 0"),
    "optimizers": (_common.names(OPTIMIZERS), f"comma-separated, from {', '.join(OPTIMIZERS)}"),
    "seed": (_common.nonnegative_int, "seed of the initialization and of the batch order"),
    "seeds": (_common.positive_int, "train every optimizer once per seed: --seed, --seed + 1, "
              "... (the table gives the held-out loss as mean ± std over them)"),
    "budget": (str, "preset of the defaults: cpu (the defaults shown here: 0.85M parameters, "
               "400 steps, 1 seed), gpu (the quality study's 25M-parameter model, 1800 steps, "
               "3 seeds, bfloat16 activations, its learning rates) or auto (gpu when JAX's first "
               "device is a GPU, else cpu); a flag given explicitly overrides its preset value"),
    "adamw_lr": (_common.positive_float, "AdamW peak learning rate"),
    "adamw_b1": (_common.decay, "AdamW beta1 (also the AdamW branch of Dion3 / NorMuon / Muon)"),
    "adamw_b2": (_common.decay, "AdamW beta2 (also the AdamW branch of Dion3 / NorMuon / Muon)"),
    "adamw_weight_decay": (_common.nonnegative_float, "AdamW weight decay, 2D leaves only"),
    "normuon_lr": (_common.positive_float, "NorMuon / Muon peak learning rate (matrices)"),
    "mu": (_common.decay, "NorMuon / Muon momentum"),
    "beta2": (_common.decay, "NorMuon second-moment decay (also Dion3's)"),
    "dion3_weight_decay": (_common.nonnegative_float,
                           "weight decay of the matrices (Dion3, NorMuon, Muon)"),
    "fraction": (_common.fraction, "Dion3 row fraction f, in (0, 1]"),
    "dion3_lr": (_common.positive_float, "Dion3 peak learning rate; default "
                 "--normuon-lr / sqrt(--fraction) (dion3_jax.transfer_learning_rate)"),
    "dion3_mu": (_common.decay, "Dion3 error-feedback decay; default --mu ** (1 / --fraction)"),
    "dion3_adam_lr": (_common.positive_float,
                      "lr of the AdamW branch (embed, lm_head, norms); default --adamw-lr"),
    "eval_every": (_common.positive_int, "steps between held-out evaluations"),
    "eval_batches": (_common.positive_int, "held-out batches per periodic evaluation"),
    "final_eval_batches": (_common.positive_int, "batches for the final train / held-out losses"),
    "timing_reps": (_common.positive_int, "forward + backward passes timed for the step split"),
    "out": (str, "output folder; default a new runs/train_lm/<YYYYmmdd-HHMMSS>"),
    "overwrite": (None, "allow --out to be a folder that already holds a run"),
    "progress": (None, "progress bar on a terminal, plain lines otherwise"),
    "checkpoint_every": (_common.nonnegative_int, "save an orbax checkpoint per optimizer every "
                         "N steps and at the last step, under <run>/checkpoints/; 0: never"),
    "stop_after": (_common.positive_int, "stop every optimizer after this step, with a "
                   "checkpoint, to continue later with --resume; default: run to --steps"),
    "resume": (str, "continue the run in this folder from its latest checkpoints, with its "
               "settings (config.json); new outputs get a -resumed<k> suffix"),
}

# Fields that steer a run without changing what it computes: --resume may set them anew. Every
# other field of a resumed run comes from the run's config.json and may not differ.
RUN_CONTROL = ("out", "overwrite", "progress", "checkpoint_every", "stop_after", "resume")
_UNSET = object()

# The presets of --budget: the values that differ from Config's defaults (the cpu budget). gpu is
# the quality study's model, data and learning rates (docs/QUALITY.md, tuned there at 300 steps)
# trained six times as long, with three seeds so that a difference between optimizers can be set
# against the seed-to-seed spread (docs/TRAINING.md, "The main job on a GPU").
BUDGETS = {
    "cpu": {},
    "gpu": dict(d_model=512, layers=8, heads=8, seq_len=512, batch=32, compute_dtype="bfloat16",
                data_mb=12.0, steps=1800, seeds=3, adamw_lr=2e-3, adamw_b1=0.9, normuon_lr=0.04,
                eval_every=200, eval_batches=4, final_eval_batches=16),
}


def build_parser():
    """The command line: one flag per ``Config`` field."""
    parser = _common.make_parser(__doc__)
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        kind, text = _FLAGS[field.name]
        kw = dict(default=field.default, help=text)
        if field.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif field.name == "compute_dtype":
            parser.add_argument(flag, choices=("float32", "bfloat16"), **kw)
        elif field.name == "budget":
            parser.add_argument(flag, choices=("auto", *BUDGETS), **dict(kw, default="auto"))
        else:
            parser.add_argument(flag, type=kind, **kw)
    return parser


def _parsed(parser: argparse.ArgumentParser, argv: list[str] | None) -> dict:
    args = vars(parser.parse_args(argv))
    if isinstance(args["optimizers"], list):
        args["optimizers"] = ",".join(args["optimizers"])
    return args


def _given_flags(argv: list[str] | None) -> dict:
    """The flags given on the command line (not their defaults), as ``{field: value}``."""
    explicit = build_parser()
    explicit.set_defaults(**{f.name: _UNSET for f in dataclasses.fields(Config)})
    return {k: v for k, v in _parsed(explicit, argv).items() if v is not _UNSET}


def resolve_budget(budget: str, platform: str | None = None) -> str:
    """``budget``, with ``"auto"`` resolved: ``"gpu"`` when ``platform`` is ``"gpu"``, else
    ``"cpu"``; ``platform`` defaults to JAX's first device's (``jax.devices()[0].platform``)."""
    if budget != "auto":
        return budget
    platform = jax.devices()[0].platform if platform is None else platform
    return "gpu" if platform == "gpu" else "cpu"


def budget_values(budget: str, given: dict) -> dict:
    """The values of preset ``budget`` for the fields not in ``given`` (flags given explicitly
    win), with ``budget`` itself. The gpu preset warms up over 10% of the steps."""
    values = dict(BUDGETS[budget], budget=budget)
    if budget == "gpu":
        values["warmup"] = max(1, round(0.1 * given.get("steps", values["steps"])))
    return {k: v for k, v in values.items() if k == "budget" or k not in given}


def parse_args(argv: list[str] | None = None, platform: str | None = None) -> Config:
    """Parses and validates the flags; every error exits through argparse before data loads.

    ``--budget`` picks the defaults (``BUDGETS``; ``auto`` by ``platform``, default JAX's first
    device's); a flag given explicitly keeps its value. With ``--resume DIR`` the settings come
    from ``DIR/config.json``; a flag given on the command line must agree with it, except the
    run-control flags (``RUN_CONTROL``).
    """
    parser = build_parser()
    args = _parsed(parser, argv)
    given = _given_flags(argv)
    if args["resume"] is not None:
        saved = saved_config(args["resume"])
        if isinstance(saved, str):
            parser.error(saved)
        run = {k: v for k, v in saved.items() if k not in RUN_CONTROL}
        clash = [k for k in run if k in given and given[k] != run[k]]
        if clash:
            parser.error(f"--resume {args['resume']}: the run was started with "
                         + ", ".join(f"--{k.replace('_', '-')} {run[k]}" for k in clash)
                         + "; leave these flags out (a resumed run keeps its settings)")
        args |= dict(budget=Config.budget) | run  # a run saved before --budget used cpu's
        if "checkpoint_every" not in given:
            args["checkpoint_every"] = saved.get("checkpoint_every", 0)
    else:
        args |= budget_values(resolve_budget(args["budget"], platform), given)
    cfg = Config(**args)
    problem = check_config(cfg)
    if problem:
        parser.error(problem)
    return cfg


def saved_config(run_dir: str) -> dict | str:
    """The settings a run in ``run_dir`` was started with, or what is wrong (a sentence)."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        return f"--resume {run_dir}: no config.json there (not a folder of train_lm.py runs)"
    with open(path) as f:
        saved = json.load(f)
    unknown = set(saved) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        return f"--resume {run_dir}: config.json has unknown settings {sorted(unknown)}"
    return saved


def _check_resume(cfg: Config) -> str | None:
    saved = saved_config(cfg.resume)
    if isinstance(saved, str):
        return saved
    if cfg.out is not None and os.path.abspath(cfg.out) != os.path.abspath(cfg.resume):
        return f"--out {cfg.out}: a resumed run writes into its own folder {cfg.resume}"
    mine = dataclasses.asdict(cfg)
    clash = [k for k in saved if k not in RUN_CONTROL and saved[k] != mine[k]]
    if clash:
        return (f"--resume {cfg.resume}: settings differ from the run's config.json: "
                + ", ".join(f"{k} {mine[k]!r} (run: {saved[k]!r})" for k in clash))
    return None


def check_config(cfg: Config) -> str | None:
    """Returns what is wrong with ``cfg`` (as a sentence), or ``None``."""
    bad = [n for n in cfg.names if n not in OPTIMIZERS]
    if bad or not cfg.names:
        return f"--optimizers: invalid choice {bad or cfg.optimizers!r} (choose from {OPTIMIZERS})"
    if cfg.d_model % cfg.heads or (cfg.d_model // cfg.heads) % 2:
        return f"--d-model must be --heads × an even head size, got {cfg.d_model}, {cfg.heads}"
    if not 0 < cfg.fraction <= 1:
        return f"--fraction must be in (0, 1], got {cfg.fraction}"
    if cfg.budget not in BUDGETS:
        return (f"--budget must be one of {', '.join(BUDGETS)} in a Config, got {cfg.budget!r} "
                f"(parse_args resolves auto)")
    if cfg.resume is not None:
        return _check_resume(cfg)
    if cfg.out and not cfg.overwrite and any(
            os.path.exists(os.path.join(cfg.out, f)) for f in ("results.json", "config.json")):
        return f"--out {cfg.out} already holds a run; pass --overwrite or another folder"
    return None


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


def embed_bytes(embed: nnx.Embed, tokens: jax.Array) -> jax.Array:
    """``embed(tokens)`` as a one-hot product (:func:`one_hot_rows`): same values, cheaper
    gradient."""
    return one_hot_rows(embed.embedding[...], tokens, embed.dtype)


def one_hot_rows(table: jax.Array, tokens: jax.Array, dtype=None) -> jax.Array:
    """``table[tokens]`` in ``dtype`` (default the table's), computed as a one-hot product.

    The gradient of a row gather is a scatter-add. With 256 byte values and 16 K tokens per
    batch, a GPU's atomic adds queue up on the few frequent rows: on an H200 that one scatter
    took 40–140 ms of the quality study's 25M-parameter step (``jax.profiler``, 2026-12-01).
    The one-hot product's gradient is a (256 × tokens) · (tokens × d) matmul instead.
    """
    table = table.astype(dtype or table.dtype)
    one_hot = jax.nn.one_hot(tokens, table.shape[0], dtype=table.dtype)
    return jnp.matmul(one_hot, table, precision=jax.lax.Precision.HIGHEST)  # exact rows (no TF32)


def attention_implementation(dtype) -> str | None:
    """cuDNN's fused attention on a GPU in 16-bit activations (it needs them); else XLA's."""
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if jax.default_backend() == "gpu" and sixteen_bit else None


class Attention(nnx.Module):
    def __init__(self, d: int, heads: int, dtype, rngs: nnx.Rngs):
        self.heads = heads
        self.implementation = attention_implementation(dtype)
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)
        # Separate q, k, v, o kernels, each (in, out): every one is its own matrix for Dion3.
        self.q, self.k, self.v, self.o = linear(d, d), linear(d, d), linear(d, d), linear(d, d)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        split = lambda y: y.reshape(b, t, self.heads, d // self.heads)
        q, k, v = rope(split(self.q(x))), rope(split(self.k(x))), split(self.v(x))
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                         implementation=self.implementation)
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
        x = embed_bytes(self.embed, tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x)).astype(jnp.float32)


def loss_fn(model: ByteLM, batch: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy (nats) of a batch of ``seq_len + 1`` byte windows."""
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@nnx.jit
def train_step(model: ByteLM, optimizer: nnx.Optimizer, batch: jax.Array) -> jax.Array:
    """One optimizer step (forward, backward, update); returns the batch loss."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def grad_step(model: ByteLM, batch: jax.Array):
    """Forward and backward only: the step without the optimizer, to time the two apart."""
    return nnx.grad(loss_fn)(model, batch)


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


_TX_CACHE: dict = {}


def make_optimizer(name: str, cfg: Config) -> tuple[optax.GradientTransformation, dict]:
    """Returns the optax transformation for ``name`` and the hyperparameters it used.

    The same settings give the same (stateless) transformation object, so that the jitted step
    compiled for one run serves the next one in the same process (a stopped and a resumed run,
    another seed: the seed does not enter the transformation).
    """
    key = (name, tuple((k, v) for k, v in dataclasses.asdict(cfg).items()
                       if k not in RUN_CONTROL + ("seed", "seeds")))
    if key not in _TX_CACHE:
        _TX_CACHE[key] = _make_optimizer(name, cfg)
    tx, hp = _TX_CACHE[key]
    return tx, dict(hp)


def _make_optimizer(name: str, cfg: Config) -> tuple[optax.GradientTransformation, dict]:
    if name == "adamw":
        hp = dict(lr=cfg.adamw_lr, b1=cfg.adamw_b1, b2=cfg.adamw_b2, wd=cfg.adamw_weight_decay)
        tx = optax.adamw(schedule(cfg.adamw_lr, cfg), b1=cfg.adamw_b1, b2=cfg.adamw_b2,
                         weight_decay=cfg.adamw_weight_decay, mask=_decay_mask)
        return tx, hp
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")
    adam_lr = cfg.adamw_lr if cfg.dion3_adam_lr is None else cfg.dion3_adam_lr
    lr, mu = cfg.matrix_lr(name), cfg.matrix_mu(name)
    fraction = cfg.fraction if name == "dion3" else 1.0
    hp = dict(lr=lr, mu=mu, fraction=fraction, wd=cfg.dion3_weight_decay, adam_lr=adam_lr)
    kwargs = dict(mu=mu, weight_decay=cfg.dion3_weight_decay, adam_b1=cfg.adamw_b1,
                  adam_b2=cfg.adamw_b2, adam_learning_rate=schedule(adam_lr, cfg))
    if name == "dion3":
        tx = dion3_jax.dion3(schedule(lr, cfg), fraction=fraction, beta2=cfg.beta2, **kwargs)
    elif name == "normuon":
        tx = dion3_jax.normuon(schedule(lr, cfg), beta2=cfg.beta2, **kwargs)
    else:
        tx = dion3_jax.muon(schedule(lr, cfg), **kwargs)
    return tx, hp


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def evaluate(model: ByteLM, batches: np.ndarray) -> float:
    losses = [eval_step(model, jnp.asarray(b)) for b in batches]
    return float(np.mean(jax.device_get(losses)))


def _timed(fn, *args) -> float:
    """Seconds of one call of ``fn(*args)``, waiting for its result."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


class Checkpoints:
    """The orbax checkpoints of one optimizer's run, in ``<run>/checkpoints/<label>/<step>/``
    (``run_label``: the optimizer's name, with ``-seed<k>`` when the run has several seeds).

    Each holds ``state`` (the model's and the ``nnx.Optimizer``'s state as pure dicts of arrays,
    restored onto the shardings of the live objects) and ``record`` (JSON: the step reached, the
    seed and the losses and step times so far). The batch of step s is a function of the seed and
    s alone, so the step is the whole data position; the model has no other randomness.
    """

    def __init__(self, run_dir: str, name: str):
        import orbax.checkpoint as ocp  # only runs that checkpoint need orbax

        self.ocp = ocp
        path = os.path.abspath(os.path.join(run_dir, "checkpoints", name))
        self.manager = ocp.CheckpointManager(
            path, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, model: ByteLM, optimizer: nnx.Optimizer, record: dict) -> None:
        """Saves the state after ``step`` steps (asynchronously; ``close`` waits)."""
        ocp = self.ocp
        state = {"model": nnx.to_pure_dict(nnx.state(model)),
                 "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)))

    def restore(self, model: ByteLM, optimizer: nnx.Optimizer) -> dict:
        """Loads the latest checkpoint into ``model`` and ``optimizer``; returns its record."""
        ocp = self.ocp
        live = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                              {k: nnx.to_pure_dict(v) for k, v in live.items()})
        step = self.manager.latest_step()
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), record=ocp.args.JsonRestore()))
        for key, obj in (("model", model), ("optimizer", optimizer)):
            nnx.replace_by_pure_dict(live[key], out["state"][key])
            nnx.update(obj, live[key])
        return out["record"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _new_record(cfg: Config) -> dict:
    return dict(step=0, seed=cfg.seed, train_losses=[], heldout_curve=[], step_s=[], grad_s=[],
                seconds=0.0)


def _train_steps(name: str, cfg: Config, data: dict, model, optimizer, rec: dict,
                 ckpt: Checkpoints | None) -> None:
    """Trains from ``rec["step"]`` to ``--steps`` (or ``--stop-after``), updating ``rec``."""
    last = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
    # Forward + backward alone is timed between training steps, under the same load as they are.
    time_at = set(np.linspace(1, cfg.steps - 1, cfg.timing_reps).astype(int)) if cfg.steps > 1 \
        else set()
    first = jnp.asarray(windows(data["train"], data["train_starts"][0], cfg.seq_len))
    # nnx.jit walks the graph of its arguments at every call, at a cost that grows with the
    # number of leaves (Dion3's state has several per matrix) and not with their size; a cached
    # partial walks the model and the optimizer once, so the step times time the step.
    step_fn = nnx.cached_partial(train_step, model, optimizer)
    grad_fn = nnx.cached_partial(grad_step, model)
    jax.block_until_ready(grad_fn(first))  # compiled (once for all runs) before timing
    bar = _common.Progress(last - rec["step"], name, cfg.progress)
    losses, t0 = [], time.perf_counter()
    for step in range(rec["step"], last):
        batch = jnp.asarray(windows(data["train"], data["train_starts"][step], cfg.seq_len))
        if step in time_at:
            rec["grad_s"].append(_timed(grad_fn, batch))
        t = time.perf_counter()
        losses.append(jax.block_until_ready(step_fn(batch)))
        rec["step_s"].append(time.perf_counter() - t)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            rec["heldout_curve"].append(
                (step + 1, evaluate(model, data["heldout_eval"][: cfg.eval_batches])))
            bar.set_postfix(loss=f"{float(losses[-1]):.3f}",
                            heldout=f"{rec['heldout_curve'][-1][1]:.3f}")
        elif step % 10 == 0:
            bar.set_postfix(loss=f"{float(losses[-1]):.3f}")
        bar.update(1)
        if ckpt is not None and ((step + 1) % max(cfg.checkpoint_every, 1) == 0
                                 or step + 1 == last):
            _sync_record(rec, step + 1, losses, t0)
            losses, t0 = [], time.perf_counter()
            ckpt.save(step + 1, model, optimizer, rec)
    _sync_record(rec, last, losses, t0)
    bar.close()


def _sync_record(rec: dict, step: int, losses: list, t0: float) -> None:
    rec["train_losses"] += [float(x) for x in jax.device_get(losses)]
    rec["seconds"] += time.perf_counter() - t0
    rec["step"] = step


def run_label(name: str, cfg: Config) -> str:
    """The name of one optimizer's run for ``cfg.seed``: ``name`` alone with one seed, else
    ``name-seed<k>`` (its progress lines and its checkpoint folder)."""
    return name if cfg.seeds == 1 else f"{name}-seed{cfg.seed}"


def run_one(name: str, cfg: Config, data: dict, run_dir: str | None = None):
    """Trains one model with optimizer ``name`` on the batch order of ``cfg.seed``.

    Returns ``(record, model)``; the record is ``None`` when ``--stop-after`` stopped the run
    before ``--steps``. With ``--checkpoint-every`` or ``--stop-after`` checkpoints are saved
    under ``run_dir``; with ``--resume`` training continues from the latest one there.
    """
    model = ByteLM(cfg, nnx.Rngs(cfg.seed))  # the same initialization for every optimizer
    tx, hp = make_optimizer(name, cfg)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    label = run_label(name, cfg)
    saving = cfg.checkpoint_every > 0 or cfg.stop_after is not None
    ckpt = Checkpoints(run_dir, label) if run_dir and (saving or cfg.resume) else None
    rec = _new_record(cfg)
    if cfg.resume and ckpt.latest_step() is not None:
        rec = ckpt.restore(model, optimizer)
        print(f"{label}: resumed at step {rec['step']} from {cfg.resume}")
    try:
        _train_steps(label, cfg, data, model, optimizer, rec, ckpt if saving else None)
    finally:
        if ckpt is not None:
            ckpt.close()
    if rec["step"] < cfg.steps:
        return None, model
    return _finish_record(name, hp, rec, model, data), model


def _finish_record(name: str, hp: dict, rec: dict, model, data: dict) -> dict:
    losses, step_s, grad_s = rec["train_losses"], rec["step_s"], rec["grad_s"]
    if not all(math.isfinite(x) for x in losses):
        print(f"warning: {name} produced a non-finite training loss")
    return dict(
        optimizer=name, seed=rec["seed"], hyperparameters=hp, train_losses=losses,
        heldout_curve=[tuple(e) for e in rec["heldout_curve"]],
        train_loss=evaluate(model, data["train_eval"]),
        heldout_loss=evaluate(model, data["heldout_final"]), seconds=rec["seconds"],
        # The first step compiles; the median of the others is the steady-state step time.
        step_ms=1e3 * float(np.median(step_s[1:] or step_s)),
        grad_ms=1e3 * float(np.median(grad_s)) if grad_s else float("nan"),
    )


def prepare_data(cfg: Config) -> dict:
    """Loads the text; fixes the batch order (one start per step and row) and the eval windows."""
    train, heldout, info = load_stdlib_bytes(cfg.data_mb, cfg.heldout_percent)
    high = train.size - cfg.seq_len - 1
    n_final = cfg.final_eval_batches * cfg.batch
    held = windows(heldout, fixed_eval_starts(heldout.size, n_final, cfg.seq_len), cfg.seq_len)
    tr = windows(train, fixed_eval_starts(train.size, n_final, cfg.seq_len), cfg.seq_len)
    # The periodic evaluation uses a spread-out subset of the final held-out windows.
    sub = held[np.linspace(0, n_final - 1, cfg.eval_batches * cfg.batch).astype(int)]
    return dict(
        train=train,
        info=info,
        high=high,
        train_starts=train_starts(cfg.seed, cfg.steps, cfg.batch, high),
        train_eval=tr.reshape(cfg.final_eval_batches, cfg.batch, -1),
        heldout_final=held.reshape(cfg.final_eval_batches, cfg.batch, -1),
        heldout_eval=sub.reshape(cfg.eval_batches, cfg.batch, -1),
    )


def train_starts(seed: int, steps: int, batch: int, high: int) -> np.ndarray:
    """The window starts of every training batch, (steps, batch), uniform in [0, high).

    Row s depends on ``seed`` and s only (numpy draws the rows in order), not on ``steps`` nor on
    anything that happened in training: a resumed run sees the batches of the uninterrupted one.
    """
    return np.random.default_rng(seed).integers(0, high, size=(steps, batch))


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------


def optimizer_cells(step_ms: float, grad_ms: float) -> tuple[str, str]:
    """The table's two optimizer cells: ``step − fwd+bwd`` in ms and its share of the step.

    The difference is printed as measured, signed, with a ``*`` when it is negative (the step
    timed faster than forward + backward alone, so the two timings do not split it); the share
    only when the difference is positive; ``-`` for both without a forward + backward timing.
    """
    diff = step_ms - grad_ms
    if not math.isfinite(diff):
        return "-", "-"
    share = f"{100 * diff / step_ms:.0f}%" if diff > 0 else "-"
    return f"{diff:+.1f}" + ("*" if diff < 0 else ""), share


def by_optimizer(results: list[dict]) -> dict[str, list[dict]]:
    """The records grouped by optimizer, in the order the optimizers first appear."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r["optimizer"], []).append(r)
    return groups


def mean_std(values) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; nan for a single value)."""
    x = np.asarray(values, dtype=np.float64)
    return float(x.mean()), float(x.std(ddof=1)) if x.size > 1 else float("nan")


def format_table(results: list[dict]) -> str:
    """The results table, one row per optimizer: losses, step time and the optimizer's part.

    With several seeds the held-out loss is the mean ± sample standard deviation over them, the
    train loss their mean, the step times the medians of the per-seed medians and the time the
    sum; a last column counts the seeds.
    """
    groups = by_optimizer(results)
    several = any(len(g) > 1 for g in groups.values())
    held_w = 15 if several else 9
    header = (f"{'optimizer':<9} {'lr':>7} {'μ':>6} {'train loss':>10} "
              f"{'held-out' + (' mean±std' if several else ''):>{held_w}} "
              f"{'step ms':>8} {'fwd+bwd ms':>10} {'optimizer ms':>12} {'optimizer %':>11} "
              f"{'time (s)':>8}" + (f" {'seeds':>5}" if several else ""))
    lines = [header, "-" * len(header)]
    for name, group in groups.items():
        hp = group[0]["hyperparameters"]
        mu = hp.get("mu", hp.get("b1"))
        step_ms = float(np.median([r["step_ms"] for r in group]))
        grad_ms = float(np.median([r["grad_ms"] for r in group]))
        held, sd = mean_std([r["heldout_loss"] for r in group])
        held_cell = f"{held:.4f}±{sd:.4f}" if len(group) > 1 else f"{held:.4f}"
        opt_ms, share = optimizer_cells(step_ms, grad_ms)
        lines.append(
            f"{name:<9} {hp['lr']:>7.3g} {mu:>6.3g} "
            f"{np.mean([r['train_loss'] for r in group]):>10.4f} {held_cell:>{held_w}} "
            f"{step_ms:>8.1f} {grad_ms:>10.1f} {opt_ms:>12} {share:>11} "
            f"{sum(r['seconds'] for r in group):>8.1f}" + (f" {len(group):>5}" if several else ""))
    lines += [
        "(nats/byte on fixed windows after training" + ("; held-out: mean ± sample std over the "
                                                        "seeds" if several else "")
        + "; μ is b1 for adamw; step ms: median jitted step;",
        " fwd+bwd ms: median jitted forward + backward alone, timed between the same run's steps;",
        " optimizer ms: step - fwd+bwd as measured, * when negative (the step timed below "
        "forward + backward alone);",
        " optimizer %: (step - fwd+bwd) / step, for a positive difference only"
        + ("; times: medians over the seeds, time (s): all seeds, compilation included)"
           if several else ")")]
    return "\n".join(lines)


def paired_differences(results: list[dict]) -> list[str]:
    """One line per other optimizer: Dion3's (else the first optimizer's) held-out loss minus
    its, per seed (same initialization and batches), as mean ± sample std and a verdict."""
    groups = by_optimizer(results)
    ref = "dion3" if "dion3" in groups else next(iter(groups))
    mine = {r["seed"]: r["heldout_loss"] for r in groups[ref]}
    lines = []
    for name, group in groups.items():
        diffs = [mine[r["seed"]] - r["heldout_loss"] for r in group if r["seed"] in mine]
        if name == ref or len(diffs) < 2:
            continue
        mean, sd = mean_std(diffs)
        lower = sum(d < 0 for d in diffs)
        if lower in (0, len(diffs)) and abs(mean) > sd:
            verdict = (f"{ref} {'ahead' if mean < 0 else 'behind'} on every seed, by more "
                       f"than the std of the differences")
        else:
            verdict = "a tie within the seed-to-seed spread"
        lines.append(f"  held-out {ref} - {name}: {mean:+.4f} ± {sd:.4f} over {len(diffs)} seeds "
                     f"({ref} lower on {lower} of {len(diffs)}): {verdict}")
    return lines


GPU_EVIDENCE = ('docs/TRAINING.md, "The main job on a GPU" (each run recorded there with its '
                'command, commit, date and GPU)')


def closing_lines(cfg: Config, results: list[dict], n_params: int) -> list[str]:
    """What the run can show and what it cannot, in plain words, and where the GPU evidence is."""
    names = ", ".join(by_optimizer(results))
    size = (f"{n_params / 1e6:.2f}M-parameter model, {cfg.steps} steps "
            f"({cfg.batch * cfg.seq_len * cfg.steps / 1e6:.1f}M bytes), {cfg.seeds} seed"
            + ("s" if cfg.seeds > 1 else ""))
    lines = [f"What this run can show ({cfg.budget} budget: {size}):",
             f"- that {names} train this model from the same initialization on the same batches, "
             f"and what a step and its optimizer update cost on this machine (step ms, "
             f"optimizer %)."]
    pairs = paired_differences(results)
    if pairs:
        lines += ["- the ranking as far as the seeds resolve it (paired by seed):", *pairs]
    lines.append("What it cannot show:")
    median = lambda group, key: float(np.median([r[key] for r in group]))
    unresolved = [n for n, g in by_optimizer(results).items()
                  if not median(g, "step_ms") > median(g, "grad_ms")]
    if unresolved:
        lines.append(f"- the optimizer's cost for {', '.join(unresolved)}: the step timed at or "
                     "below forward + backward alone, so the timings did not resolve it (other "
                     "load on the machine makes them noisy).")
    if cfg.budget == "cpu":
        lines += [
            "- which optimizer trains better: one seed, and at the default CPU budget three seeds "
            "spread by 0.02-0.03 nats/byte (docs/TRAINING.md, \"Seed check\"), so no difference "
            "in the table is a ranking." if cfg.seeds == 1 else
            "- whether this ranking holds for a larger model and a longer run.",
            "- what the optimizers cost at scale: at this size the polar factors are small next "
            "to the forward and backward passes; Dion3's step saves time at large matrix shapes "
            "(docs/BENCHMARKS.md).",
            "The GPU evidence: on a GPU `bash scripts/train.sh` trains the quality study's "
            "25M-parameter model for 1800 steps with 3 seeds (--budget gpu); what has been "
            "recorded on a GPU is in " + GPU_EVIDENCE + "."]
    else:
        lines += [
            "- the paper's scale (1B+ parameters, billions of tokens), where optimizers can rank "
            "differently; the learning rates are the quality study's 300-step bests "
            "(docs/QUALITY.md), not re-tuned for this budget.",
            f"- Dion3's saving in the optimizer step: at width {cfg.d_model} the polar factors "
            "are cheap; it shows at large matrix shapes (docs/BENCHMARKS.md)."
            + ("" if cfg.seeds > 1 else " With one seed, no difference here is a ranking."),
            "What has been recorded on a GPU: " + GPU_EVIDENCE + "."]
    return lines


def plot_curves(results: list[dict], path: str, cfg: Config) -> None:
    """Smoothed train loss and held-out loss per optimizer, saved as a PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, group) in enumerate(by_optimizer(results).items()):
        color = f"C{i}"
        for j, r in enumerate(group):  # one curve per seed, labelled once
            x = np.asarray(r["train_losses"])
            k = max(1, min(25, x.size // 20))
            smooth = np.convolve(x, np.ones(k) / k, mode="valid")
            ax.plot(np.arange(k, x.size + 1), smooth, color=color, alpha=0.6, lw=1,
                    label=None if j else f"{name} train (lr {r['hyperparameters']['lr']:.3g})")
            steps, held = zip(*r["heldout_curve"])
            ax.plot(steps, held, "o-", color=color, lw=2, ms=4,
                    label=None if j else f"{name} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    finals = [r["heldout_loss"] for r in results]
    ax.set_ylim(min(finals) - 0.2, min(finals) + 2.0)
    ax.set_title(f"byte LM on stdlib sources: d={cfg.d_model}, L={cfg.layers}, "
                 f"T={cfg.seq_len}, B={cfg.batch}, {cfg.steps} steps"
                 + (f", {cfg.seeds} seeds" if cfg.seeds > 1 else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


OUTPUTS = ("table", ".txt"), ("results", ".json"), ("loss", ".png")


def output_suffix(out: str) -> str:
    """``""``, or ``-resumed<k>`` (the first free k) when ``out`` already holds outputs."""
    for k in range(1000):
        suffix = f"-resumed{k}" if k else ""
        if not any(os.path.exists(os.path.join(out, n + suffix + e)) for n, e in OUTPUTS):
            return suffix
    raise RuntimeError(f"no free output name in {out}")


def write_outputs(out: str, cfg: Config, info: dict, results: list[dict],
                  suffix: str = "") -> dict:
    """Writes ``table.txt`` and ``results.json`` first, then ``loss.png`` if matplotlib exists
    (each name with ``suffix`` before the extension)."""
    table = format_table(results)
    table_path = os.path.join(out, f"table{suffix}.txt")
    with open(table_path, "w") as f:
        f.write(table + "\n")
    summary = os.path.join(out, f"results{suffix}.json")
    with open(summary, "w") as f:
        json.dump(dict(config=dataclasses.asdict(cfg), out=out, data=info, results=results), f,
                  indent=1)
    plot = os.path.join(out, f"loss{suffix}.png")
    try:
        plot_curves(results, plot, cfg)
    except ImportError as e:
        print(f"note: no plot ({e}); install matplotlib for {plot}. The table and the results "
              f"are written.")
        plot = None
    print(f"wrote {', '.join(p for p in (table_path, summary, plot) if p)}")
    return dict(table=table, plot=plot, json=summary)


def output_dir(cfg: Config) -> str:
    """The run folder: ``--resume``'s, ``cfg.out`` (created if needed), or a new
    ``runs/train_lm/<YYYYmmdd-HHMMSS>``. A new run writes its ``config.json`` there (and, with
    ``--overwrite``, first removes the checkpoints of the run it replaces)."""
    if cfg.resume is not None:
        return cfg.resume
    if cfg.out is None:
        out = _common.new_run_dir(os.path.join("runs", "train_lm"))
    else:
        out = cfg.out
        os.makedirs(out, exist_ok=True)
        shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=1)
    return out


def run_all(cfg: Config, data: dict, out: str) -> dict:
    """Every optimizer for every seed, seed after seed: ``{run_label: (record, model)}``.

    Each seed has its own initialization and batch order, the same for every optimizer.
    """
    runs = {}
    for seed in range(cfg.seed, cfg.seed + cfg.seeds):
        seed_cfg = dataclasses.replace(cfg, seed=seed)
        seed_data = dict(data, train_starts=train_starts(seed, cfg.steps, cfg.batch,
                                                         data["high"]))
        for name in cfg.names:
            label = run_label(name, seed_cfg)
            rec, model = runs[label] = run_one(name, seed_cfg, seed_data, out)
            if rec is not None:
                print(f"{label}: held-out {rec['heldout_loss']:.4f} (train "
                      f"{rec['train_loss']:.4f}), step {rec['step_ms']:.1f} ms, forward + "
                      f"backward {rec['grad_ms']:.1f} ms, {rec['seconds']:.0f} s", flush=True)
        done = [rec for rec, _ in runs.values() if rec is not None]
        if 0 < seed - cfg.seed < cfg.seeds - 1 and len(done) == len(runs):
            # A long run shows its table so far (the final one follows the last seed).
            print(f"after seeds {cfg.seed}-{seed}:\n{format_table(done)}", flush=True)
    return runs


def train(cfg: Config) -> dict:
    """Runs every optimizer in ``cfg.optimizers`` and writes the table, JSON and PNG.

    Returns a dict with ``results`` (one record per optimizer: hyperparameters, per-step train
    losses, held-out curve, final train and held-out losses, seconds, step_ms, grad_ms),
    ``table`` (str), ``out``, ``plot`` (path or ``None`` without matplotlib), ``json`` (path),
    ``data`` (a summary of the text used), ``params`` (the parameter count), ``models`` (the
    trained ``ByteLM`` per optimizer) and ``stopped``. With ``--stop-after`` before ``--steps``
    nothing is written but the checkpoints, ``results`` is ``None`` and ``stopped`` is true.
    """
    problem = check_config(cfg)
    if problem:
        raise ValueError(problem)
    out = output_dir(cfg)
    data = prepare_data(cfg)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(ByteLM(cfg, nnx.Rngs(0)), nnx.Param)))
    info = data["info"]
    print(f"data: {info['train_files']} train files ({info['train_bytes'] / 1e6:.1f} MB), "
          f"{info['heldout_files']} held-out files ({info['heldout_bytes'] / 1e6:.2f} MB) "
          f"from {info['root']}")
    print(f"model: {n_params / 1e6:.2f}M parameters, d_model={cfg.d_model}, layers={cfg.layers}, "
          f"heads={cfg.heads}, seq_len={cfg.seq_len}; batch={cfg.batch}, steps={cfg.steps} "
          f"({cfg.batch * cfg.seq_len * cfg.steps / 1e6:.1f}M bytes); budget={cfg.budget}, "
          f"seeds={cfg.seeds}; device={jax.devices()[0]}; output: {out}")
    runs = run_all(cfg, data, out)
    models = {label: model for label, (_, model) in runs.items()}
    results = [rec for rec, _ in runs.values()]
    if None in results:
        print(f"stopped after step {cfg.stop_after} of {cfg.steps}; checkpoints in "
              f"{os.path.join(out, 'checkpoints')}; continue with: python {sys.argv[0]} "
              f"--resume {out}")
        return dict(results=None, out=out, data=info, params=n_params, models=models,
                    stopped=True)
    suffix = output_suffix(out) if cfg.resume else ""
    if suffix:
        print(f"note: {out} already holds outputs of an earlier run; they are kept and this "
              f"run's are written with the suffix {suffix}")
    written = write_outputs(out, cfg, info, results, suffix)
    print(written["table"])
    closing = closing_lines(cfg, results, n_params)
    print("\n".join(closing))
    return dict(results=results, out=out, data=info, params=n_params, models=models,
                stopped=False, closing=closing, **written)


def main(argv: list[str] | None = None) -> dict:
    return train(parse_args(argv))


if __name__ == "__main__":
    main()

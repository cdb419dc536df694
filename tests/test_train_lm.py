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
"""Smoke test of the main job, ``examples/train_lm.py``: a tiny byte LM trains with Dion3."""

import importlib.util
import math
import os
import sys

import numpy as np
import pytest

from seeds import module_seed

pytestmark = pytest.mark.tooling

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()

_PATH = os.path.join(os.path.dirname(__file__), "..", "examples", "train_lm.py")


@pytest.fixture(scope="module")
def train_lm():
    spec = importlib.util.spec_from_file_location("train_lm", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_lm"] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


# The tiny run: long enough to learn; also the uninterrupted run the resume test compares with.
TINY = dict(d_model=32, layers=1, heads=2, seq_len=32, batch=8, steps=60, warmup=5,
            data_mb=1.0, optimizers="dion3,adamw", dion3_lr=0.04, adamw_lr=4e-3,
            eval_every=20, eval_batches=2, final_eval_batches=4, timing_reps=2, progress=False)


@pytest.fixture(scope="module")
def tiny_run(train_lm, tmp_path_factory):
    """``(cfg, train(cfg))`` of TINY: ~20 s on the 2-core machine (two optimizers compile and
    train), run once for the two tests that use it (adjacent, so that one xdist worker runs
    both)."""
    cfg = train_lm.Config(**TINY, out=str(tmp_path_factory.mktemp("tiny_run")))
    return cfg, train_lm.train(cfg)


@pytest.mark.slow
def test_tiny_run_learns(tiny_run):
    cfg, out = tiny_run

    results = {r["optimizer"]: r for r in out["results"]}
    assert set(results) == {"dion3", "adamw"}
    dion3 = results["dion3"]
    losses = dion3["train_losses"]
    assert len(losses) == cfg.steps
    assert all(math.isfinite(x) for x in losses)
    # ln(256) = 5.55 nats/byte at initialization; a tiny model learns byte frequencies and common
    # bigrams within a few dozen steps.
    initial = sum(losses[:3]) / 3
    final = sum(losses[-10:]) / 10
    assert initial > 5.0, initial
    assert final < initial - 1.5, (initial, final)
    assert math.isfinite(dion3["heldout_loss"]) and dion3["heldout_loss"] < initial - 1.5
    assert math.isfinite(dion3["train_loss"])
    assert [s for s, _ in dion3["heldout_curve"]] == [20, 40, 60]

    # Same init and same batches for both optimizers: identical loss at step 0.
    assert results["adamw"]["train_losses"][0] == pytest.approx(losses[0], rel=1e-6)

    # Held-out files are never trained on, and both splits are non-empty.
    assert out["data"]["train_files"] > 0 and out["data"]["heldout_files"] > 0

    # Artifacts: the PNG, the table (on disk and returned), the JSON summary.
    with open(out["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "held-out" in out["table"] and "dion3" in out["table"] and "adamw" in out["table"]
    assert "step ms" in out["table"] and "optimizer %" in out["table"]
    # Step times of the full step and of forward + backward alone, per optimizer.
    assert all(r["step_ms"] > 0 and r["grad_ms"] > 0 for r in out["results"])
    with open(os.path.join(cfg.out, "table.txt")) as f:
        assert f.read().strip() == out["table"]
    assert os.path.getsize(out["json"]) > 0


# ---------------------------------------------------------------------------------------------
# Checkpoint and resume: a run stopped halfway and resumed equals the uninterrupted run, bitwise.

def _params(model):
    import jax
    from flax import nnx

    flat = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model)))
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


@pytest.mark.slow  # the runs reuse the steps tiny_run compiled
def test_stopped_and_resumed_run_is_bitwise_the_uninterrupted_one(train_lm, tiny_run, tmp_path):
    full = tiny_run[1]
    half = TINY["steps"] // 2
    run = str(tmp_path / "run")
    stopped = train_lm.train(train_lm.Config(**TINY, out=run, checkpoint_every=20,
                                             stop_after=half))
    assert stopped["stopped"] and stopped["results"] is None
    assert not os.path.exists(os.path.join(run, "results.json"))
    for name in TINY["optimizers"].split(","):
        # Saved after steps 20 and 30 (every 20 steps and where it stopped), both kept.
        assert sorted(os.listdir(os.path.join(run, "checkpoints", name))) == ["20", "30"], name
        # The stopped model really is halfway: it differs from the finished one.
        a, b = _params(stopped["models"][name]), _params(full["models"][name])
        assert any(not np.array_equal(a[k], b[k]) for k in a), name

    resumed = train_lm.train(train_lm.Config(**TINY, resume=run, checkpoint_every=20))
    assert not resumed["stopped"] and resumed["out"] == run
    for r_full, r_res in zip(full["results"], resumed["results"]):
        name = r_full["optimizer"]
        assert r_res["optimizer"] == name
        # The losses of every step (the resumed ones included) and the final losses, bitwise.
        assert len(r_res["train_losses"]) == TINY["steps"]
        assert r_res["train_losses"] == r_full["train_losses"], name
        assert r_res["heldout_curve"] == r_full["heldout_curve"], name
        assert r_res["heldout_loss"] == r_full["heldout_loss"], name
        a, b = _params(resumed["models"][name]), _params(full["models"][name])
        assert sorted(a) == sorted(b) and len(a) > 5
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{name} {k}")
    assert sorted(os.listdir(os.path.join(run, "checkpoints", "dion3"))) == ["40", "60"]

    # Resuming the finished run again trains nothing, gives the same results and keeps the
    # earlier outputs: the new ones get a suffix.
    with open(os.path.join(run, "results.json")) as f:
        first = f.read()
    again = train_lm.train(train_lm.Config(**TINY, resume=run))
    assert again["json"] == os.path.join(run, "results-resumed1.json")
    with open(os.path.join(run, "results.json")) as f:
        assert f.read() == first
    assert [r["train_losses"] for r in again["results"]] == \
        [r["train_losses"] for r in full["results"]]


def test_heldout_split_is_disjoint_and_deterministic(train_lm):
    train1, held1, info1 = train_lm.load_stdlib_bytes(0.3, 5.0)
    train2, held2, info2 = train_lm.load_stdlib_bytes(0.3, 5.0)
    assert info1 == info2 and (train1 == train2).all() and (held1 == held2).all()
    assert info1["train_files"] > 0 and info1["heldout_files"] > 0
    # Each file goes to one side by a hash of its relative path: about the requested share.
    share = sum(train_lm._is_heldout(f"m{i}.py", 5.0) for i in range(4000)) / 4000
    assert 0.03 < share < 0.07


def test_parse_args_round_trip(train_lm):
    cfg = train_lm.parse_args(
        ["--d-model", "64", "--optimizers", "adamw", "--dion3-adam-lr", "0.001", "--no-progress"]
    )
    assert cfg.d_model == 64 and cfg.optimizers == "adamw"
    assert cfg.dion3_adam_lr == 0.001 and cfg.progress is False
    assert train_lm.parse_args([]) == train_lm.Config()
    assert train_lm.parse_args(["--optimizers", "dion3,adamw"]).names == ["dion3", "adamw"]
    with pytest.raises(ValueError, match="optimizer"):
        train_lm.make_optimizer("sgd", cfg)
    with pytest.raises(ValueError, match="--d-model"):
        train_lm.train(train_lm.Config(d_model=30, heads=4))


@pytest.mark.slow
def test_normuon_and_muon_take_a_step(train_lm):
    """The other two choices of --optimizers (dion3 and adamw are covered above)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    cfg = train_lm.Config(d_model=16, layers=1, heads=2, seq_len=8, batch=2, steps=10, warmup=0)
    batch = jnp.asarray(np.arange(2 * 9).reshape(2, 9), dtype=jnp.int32)
    for name in ("normuon", "muon"):
        model = train_lm.ByteLM(cfg, nnx.Rngs(0))
        kernel_before = np.asarray(model.blocks[0].fc.kernel[...])
        tx, _ = train_lm.make_optimizer(name, cfg)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        loss = train_lm.train_step(model, optimizer, batch)
        assert np.isfinite(float(loss)), name
        assert not np.allclose(kernel_before, model.blocks[0].fc.kernel[...]), name


def test_dion3_defaults_follow_the_transfer_rules(train_lm):
    """Dion3's lr and μ come from NorMuon's: lr·√f and μ^(1/f) kept unless set explicitly."""
    cfg = train_lm.Config(normuon_lr=0.02, mu=0.95, fraction=0.25)
    assert cfg.matrix_lr("dion3") == pytest.approx(0.04)
    assert cfg.matrix_mu("dion3") == pytest.approx(0.95**4)
    assert cfg.matrix_lr("normuon") == 0.02 and cfg.matrix_mu("normuon") == 0.95
    cfg = train_lm.Config(dion3_lr=0.1, dion3_mu=0.5)
    assert cfg.matrix_lr("dion3") == 0.1 and cfg.matrix_mu("dion3") == 0.5
    _, hp = train_lm.make_optimizer("dion3", train_lm.Config(fraction=0.125))
    assert hp["fraction"] == 0.125 and hp["mu"] == pytest.approx(0.95**8)


def test_batch_order_depends_on_seed_and_step_only(train_lm):
    long = train_lm.train_starts(3, 50, 4, 1000)
    short = train_lm.train_starts(3, 20, 4, 1000)
    np.testing.assert_array_equal(long[:20], short)
    assert not np.array_equal(train_lm.train_starts(4, 20, 4, 1000), short)


def test_resume_takes_the_run_settings_and_refuses_others(train_lm, tmp_path, capsys):
    cfg = train_lm.Config(steps=7, d_model=64, checkpoint_every=3, out=str(tmp_path))
    train_lm.output_dir(cfg)  # writes config.json, as a run does at its start
    resumed = train_lm.parse_args(["--resume", str(tmp_path), "--no-progress"])
    assert resumed.steps == 7 and resumed.d_model == 64 and resumed.checkpoint_every == 3
    assert resumed.resume == str(tmp_path) and not resumed.progress
    # The run's own values may be repeated; another value is refused before any data loads.
    assert train_lm.parse_args(["--resume", str(tmp_path), "--steps", "7"]).steps == 7
    for argv, message in [(["--steps", "8"], "the run was started with --steps 7"),
                          (["--out", str(tmp_path / "x")], "writes into its own folder")]:
        with pytest.raises(SystemExit):
            train_lm.parse_args(["--resume", str(tmp_path), *argv])
        assert message in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        train_lm.parse_args(["--resume", str(tmp_path / "nothing")])
    assert "no config.json" in capsys.readouterr().err
    # train() checks a Config given directly, too.
    with pytest.raises(ValueError, match="settings differ"):
        train_lm.train(train_lm.Config(steps=9, d_model=64, resume=str(tmp_path)))
    # A new run never lands in a folder that holds one (its config.json), unless --overwrite.
    with pytest.raises(SystemExit):
        train_lm.parse_args(["--out", str(tmp_path)])
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_hot_embedding_equals_the_gather_and_its_scatter_gradient(train_lm, dtype):
    """``embed_bytes`` (a one-hot product, no scatter in its gradient) gives ``embed(tokens)``
    exactly, and its gradient is the float64 scatter-add of the output cotangents."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    rng = np.random.default_rng(SEED)
    embed = nnx.Embed(256, 8, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    tokens = jnp.asarray(rng.integers(0, 256, (3, 50)))  # repeats: several tokens per row
    np.testing.assert_array_equal(train_lm.embed_bytes(embed, tokens), embed(tokens))

    cot = rng.standard_normal((3, 50, 8))
    loss = lambda t: jnp.sum(train_lm.one_hot_rows(t, tokens, embed.dtype) * cot)
    grad = jax.grad(loss)(embed.embedding[...])
    want = np.zeros((256, 8))
    np.add.at(want, np.asarray(tokens).ravel(), cot.reshape(-1, 8))
    tol = 1e-6 if dtype == "float32" else 2e-2  # bfloat16 cotangents (8 bits of mantissa)
    np.testing.assert_allclose(grad, want, rtol=tol, atol=tol * np.abs(want).max())


# ---------------------------------------------------------------------------------------------
# Budgets, seeds and the closing lines.

def test_budget_follows_the_platform_and_explicit_flags_win(train_lm):
    """--budget auto picks the gpu preset on a GPU (the platform faked here) and the defaults on
    a CPU; a flag given explicitly keeps its value; the gpu warm-up is 10% of the steps."""
    assert train_lm.parse_args([], platform="cpu") == train_lm.Config()
    assert train_lm.parse_args([]).budget == train_lm.resolve_budget("auto")
    gpu = train_lm.parse_args([], platform="gpu")
    want = dict(budget="gpu", d_model=512, layers=8, heads=8, seq_len=512, batch=32,
                compute_dtype="bfloat16", steps=1800, warmup=180, seeds=3, adamw_lr=2e-3,
                adamw_b1=0.9, normuon_lr=0.04, fraction=0.25, seed=0)
    assert {k: getattr(gpu, k) for k in want} == want
    # The quality study's Dion3 settings follow from NorMuon's by the transfer rules.
    assert gpu.matrix_lr("dion3") == pytest.approx(0.08)
    assert gpu.matrix_mu("dion3") == pytest.approx(0.95**4)
    short = train_lm.parse_args(["--steps", "300", "--seeds", "1", "--d-model", "256"],
                                platform="gpu")
    assert (short.steps, short.warmup, short.seeds, short.d_model, short.layers) == \
        (300, 30, 1, 256, 8)
    assert train_lm.parse_args(["--budget", "gpu", "--warmup", "7"], platform="cpu").warmup == 7
    assert train_lm.parse_args(["--budget", "cpu"], platform="gpu") == train_lm.Config()
    assert [train_lm.resolve_budget("auto", p) for p in ("gpu", "cpu", "tpu")] == \
        ["gpu", "cpu", "cpu"]
    # The budget a Config names must be a preset ("auto" is the command line's alone).
    assert "--budget" in train_lm.check_config(train_lm.Config(budget="auto"))


def _records(losses: dict, steps_ms: dict | None = None) -> list[dict]:
    """Result records ``{optimizer: [held-out loss per seed]}``, seed-major as train() makes."""
    names = list(losses)
    return [dict(optimizer=n, seed=s, hyperparameters=dict(lr=0.01, mu=0.9), train_loss=1.0,
                 heldout_loss=losses[n][s], seconds=2.0, step_ms=(steps_ms or {}).get(n, 10.0),
                 grad_ms=8.0)
            for s in range(len(losses[names[0]])) for n in names]


def test_table_and_paired_differences_over_seeds(train_lm):
    """Mean ± sample std of the held-out loss per optimizer, and Dion3 minus each other one per
    seed, against numpy on random losses (seed printed)."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print("seed", seed)
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.7, 0.8, 3)
    losses = {"dion3": base - 0.05, "normuon": base + rng.uniform(-0.01, 0.01, 3),
              "adamw": base}
    table = train_lm.format_table(_records(losses)).splitlines()
    assert "held-out mean±std" in table[0] and table[0].split()[-1] == "seeds"
    rows = {line.split()[0]: line.split() for line in table[2:5]}
    for name, x in losses.items():
        assert rows[name][4] == f"{np.mean(x):.4f}±{np.std(x, ddof=1):.4f}", name
        assert rows[name][-1] == "3" and rows[name][9] == "6.0"  # seconds summed over seeds
    lines = train_lm.paired_differences(_records(losses))
    assert len(lines) == 2
    d = losses["dion3"] - losses["adamw"]  # -0.05 on every seed, spread ~0
    assert f"{d.mean():+.4f} ± {d.std(ddof=1):.4f} over 3 seeds" in lines[1]
    assert "lower on 3 of 3" in lines[1] and "ahead on every seed" in lines[1]
    # Signs that disagree between seeds are a tie, whatever the mean.
    mixed = {"dion3": np.array([0.70, 0.80, 0.75]), "normuon": np.array([0.75, 0.70, 0.76])}
    (line,) = train_lm.paired_differences(_records(mixed))
    assert "lower on 2 of 3" in line and "a tie within the seed-to-seed spread" in line
    # One seed: no difference line at all.
    assert train_lm.paired_differences(_records({"dion3": [0.7], "adamw": [0.8]})) == []


def test_closing_lines_say_what_the_run_cannot_show(train_lm):
    """The CPU run points at the GPU evidence, a section docs/TRAINING.md has; the GPU run
    states the paired differences and its own limits."""
    cpu = train_lm.closing_lines(train_lm.Config(), _records({"dion3": [1.43], "adamw": [1.44]}),
                                 850_000)
    text = "\n".join(cpu)
    assert "What it cannot show:" in text and "no difference in the table is a ranking" in text
    assert "0.85M-parameter model, 400 steps (0.8M bytes), 1 seed" in text
    assert train_lm.GPU_EVIDENCE in text and "1800 steps with 3 seeds" in text
    assert "paired by seed" not in text and "did not resolve it" not in text
    slow_adamw = _records({"dion3": [1.43], "adamw": [1.44]}, {"adamw": 7.5})  # fwd+bwd 8 ms
    text = "\n".join(train_lm.closing_lines(train_lm.Config(), slow_adamw, 850_000))
    assert "the optimizer's cost for adamw: the step timed at or below" in text
    with open(os.path.join(os.path.dirname(_PATH), "..", "docs", "TRAINING.md")) as f:
        assert "\n## The main job on a GPU\n" in f.read()

    gpu_cfg = train_lm.parse_args([], platform="gpu")
    losses = {"dion3": [0.76, 0.77, 0.78], "normuon": [0.77, 0.78, 0.79],
              "adamw": [0.80, 0.81, 0.80]}
    text = "\n".join(train_lm.closing_lines(gpu_cfg, _records(losses), 25_400_000))
    assert "gpu budget: 25.40M-parameter model, 1800 steps (29.5M bytes), 3 seeds" in text
    assert "held-out dion3 - normuon: -0.0100 ± 0.0000 over 3 seeds" in text
    assert "not re-tuned for this budget" in text and "What has been recorded on a GPU" in text
    assert "no difference in the table is a ranking" not in text


@pytest.mark.slow
def test_seed_k_of_a_several_seed_run_is_the_run_with_that_seed(train_lm, tmp_path):
    """--seeds 2 trains seed 0 then seed 1, each with its own checkpoint folder; seed 1's run is
    bitwise the single run with --seed 1 (same initialization, same batches)."""
    tiny = dict(TINY, optimizers="adamw", steps=4, eval_every=2)
    both = train_lm.train(train_lm.Config(**tiny, seeds=2, checkpoint_every=2,
                                          out=str(tmp_path / "both")))
    assert [(r["optimizer"], r["seed"]) for r in both["results"]] == [("adamw", 0), ("adamw", 1)]
    assert sorted(os.listdir(tmp_path / "both" / "checkpoints")) == ["adamw-seed0",
                                                                     "adamw-seed1"]
    one = train_lm.train(train_lm.Config(**tiny, seed=1, out=str(tmp_path / "one")))
    assert one["results"][0]["train_losses"] == both["results"][1]["train_losses"]
    assert one["results"][0]["heldout_loss"] == both["results"][1]["heldout_loss"]
    assert both["results"][0]["train_losses"][0] != both["results"][1]["train_losses"][0]
    assert both["table"].splitlines()[0].split()[-1] == "seeds"
    assert any("What it cannot show" in line for line in both["closing"])

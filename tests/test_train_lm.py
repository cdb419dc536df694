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

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
"""The examples' command lines: bad values fail at once through argparse, runs never overwrite
each other, a missing matplotlib only costs the plot, and progress falls back to plain lines."""

from __future__ import annotations

import datetime
import io
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)

import _common  # noqa: E402

pytestmark = pytest.mark.tooling


def _run(args: list[str], cwd: str = ROOT, env: dict | None = None, timeout: float = 120):
    full_env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **(env or {}))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)
    return proc, time.perf_counter() - t0


# One bad value per example, run as a user would: exit status 2, argparse's message, no data
# read, within seconds (the scripts load data or start devices only after parsing). Further
# values per script: in-process below.
BAD_ARGS = [
    ("train_lm.py", ["--fraction", "2"], "argument --fraction: 2 is outside (0, 1]"),
    ("train_multipod.py", ["--fraction", "0"], "argument --fraction: 0 is outside (0, 1]"),
    ("polar_standalone.py", ["--coefficients", "foo"], "argument --coefficients: invalid choice"),
    ("quality_study.py", ["--steps", "0"], "argument --steps: 0 is outside [1, inf)"),
    ("quality_report.py", ["no/such.jsonl"], "JSONL: no such file 'no/such.jsonl'"),
]


@pytest.mark.slow  # a process each; the fast loop keeps the in-process checks below
@pytest.mark.parametrize("script,args,message", BAD_ARGS, ids=lambda v: str(v)[:30])
def test_bad_values_fail_fast_with_the_argparse_message(script, args, message):
    proc, seconds = _run([os.path.join(EXAMPLES, script), *args])
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "data:" not in proc.stdout  # train_lm prints "data: ..." once the text is loaded
    assert seconds < 20, seconds


def _parse_error(parse, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_train_lm_rejects_bad_values_before_loading(capsys, tmp_path):
    import train_lm

    cases = {
        ("--optimizers", "lion"): "argument --optimizers: invalid choice: 'lion'",
        ("--optimizers", "dion3,lion"): "invalid choice: 'lion'",
        ("--optimizer", "dion3"): "unrecognized arguments: --optimizer dion3",
        ("--compute-dtype", "float64"): "invalid choice: 'float64'",
        ("--steps", "0"): "--steps: 0 is outside",
        ("--mu", "1.0"): "--mu: 1.0 is outside [0, 1)",
        ("--heads", "3"): "--d-model must be --heads",
        ("--learning-rate", "1"): "unrecognized arguments",
        ("--dion3", "0.1"): "unrecognized arguments",  # no abbreviation of --dion3-lr
    }
    for argv, message in cases.items():
        assert message in _parse_error(train_lm.parse_args, list(argv), capsys), argv
    # Both list spellings are accepted.
    assert train_lm.parse_args(["--optimizers", "adamw,dion3"]).optimizers == "adamw,dion3"
    # An earlier run in --out is not overwritten unless asked.
    (tmp_path / "results.json").write_text("{}")
    err = _parse_error(train_lm.parse_args, ["--out", str(tmp_path)], capsys)
    assert "already holds a run" in err
    assert train_lm.parse_args(["--out", str(tmp_path), "--overwrite"]).overwrite


def test_other_examples_reject_bad_values(capsys):
    import polar_standalone
    import quality_study
    import train_lm
    import train_multipod

    cases = [
        (train_multipod.parse_args, ["--mesh", "2by4"], "must look like 2x4"),
        (train_multipod.parse_args, ["--mesh", "3x3"], "divisible by the 9 devices"),
        (train_multipod.parse_args, ["--mesh", "1x3", "--batch", "72"],
         "--d-in 32 must be divisible by the fsdp size 3 of --mesh 1x3"),
        (train_multipod.parse_args, ["--mesh", "2x3", "--batch", "72"],
         "--d-in 32 must be divisible by the fsdp size 3 of --mesh 2x3"),
        (train_multipod.parse_args, ["--mesh", "3x3", "--batch", "72", "--d-in", "33"],
         "--hidden 64 must be divisible by the fsdp size 3 of --mesh 3x3"),
        (train_multipod.parse_args, ["--replica-selection", "x"], "invalid choice: 'x'"),
        (train_multipod.parse_args, ["--frac", "0.5"], "unrecognized arguments"),
        (train_multipod.parse_args, ["--process-id", "1"], "--process-id only with --distributed"),
        (train_multipod.parse_args, ["--distributed", "--num-processes", "2", "--process-id",
                                     "2"], "--process-id 2 must be < --num-processes 2"),
        (train_multipod.parse_args, ["--distributed", "--coordinator", "host"], "HOST:PORT"),
        (train_multipod.parse_args, ["--restore", "no/such/ckpt"], "no such folder"),
        (train_lm.parse_args, ["--resume", "no/such/run"], "no config.json there"),
        (train_lm.parse_args, ["--stop-after", "0"], "--stop-after: 0 is outside"),
        (polar_standalone.parse_args, ["--shape", "2", "0", "4"], "0 is outside"),
        (polar_standalone.parse_args, ["--shape", "2", "4"], "expected 3 arguments"),
        (polar_standalone.parse_args, ["--coef", "you"], "unrecognized arguments"),
        (quality_study.parse_args, ["--heads", "3"], "--d-model must be"),
        (quality_study.parse_args, ["--report", "no/such.jsonl"], "no such file"),
        (quality_study.parse_args, ["--compute-dtype", "float16"], "invalid choice"),
        (quality_study.parse_args, ["--param-dtype", "float16"], "invalid choice"),
        (quality_study.parse_args, ["--rounding", "twice"], "needs --param-dtype bfloat16"),
        (quality_study.parse_args, ["--plan", "rounding", "--param-dtype", "bfloat16"],
         "pass neither"),
    ]
    for parse, argv, message in cases:
        assert message in _parse_error(parse, argv, capsys), argv


def test_polar_standalone_presets_match_the_library():
    import dion3_jax
    import polar_standalone

    assert set(polar_standalone.COEFFICIENTS) == set(dion3_jax.newton_schulz.COEFFICIENT_PRESETS)


def test_help_shows_defaults_on_every_flag():
    import polar_standalone
    import quality_report
    import quality_study
    import train_lm

    for parser in (train_lm.build_parser(), quality_study.build_parser(),
                   quality_report.build_parser()):
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, action.dest
        assert "(default:" in parser.format_help()
    with pytest.raises(SystemExit):
        polar_standalone.parse_args(["--help"])


def test_timestamped_run_dirs_never_overwrite(tmp_path, monkeypatch):
    now = datetime.datetime(2026, 12, 1, 9, 30, 0)
    first = _common.new_run_dir(str(tmp_path), now)
    second = _common.new_run_dir(str(tmp_path), now)
    assert os.path.basename(first) == "20261201-093000"
    assert os.path.basename(second) == "20261201-093000-2"
    assert os.path.isdir(first) and os.path.isdir(second)

    import train_lm

    monkeypatch.chdir(tmp_path)
    a = train_lm.output_dir(train_lm.Config())
    b = train_lm.output_dir(train_lm.Config())
    assert a != b and os.path.dirname(a) == os.path.join("runs", "train_lm")


def test_progress_prints_plain_lines_off_a_terminal():
    stream = io.StringIO()  # not a terminal
    bar = _common.Progress(20, "dion3", enabled=True, lines=4, stream=stream)
    for step in range(20):
        bar.set_postfix(loss=f"{5 - step / 10:.2f}")
        bar.update(1)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 and lines[-1].startswith("dion3: step 20/20")
    assert "loss=3.10" in lines[-1]

    quiet = io.StringIO()
    bar = _common.Progress(20, "dion3", enabled=False, stream=quiet)
    bar.update(20)
    assert quiet.getvalue() == ""


TINY = ["--d-model", "16", "--layers", "1", "--heads", "2", "--seq-len", "16", "--batch", "4",
        "--steps", "4", "--warmup", "1", "--data-mb", "0.3", "--eval-every", "2",
        "--eval-batches", "1", "--final-eval-batches", "2", "--timing-reps", "1",
        "--optimizers", "adamw"]


@pytest.mark.slow
def test_train_lm_without_matplotlib_still_writes_its_results(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    out = tmp_path / "run"
    proc, _ = _run([os.path.join(EXAMPLES, "train_lm.py"), *TINY, "--out", str(out)],
                   env={"PYTHONPATH": str(shim)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "note: no plot" in proc.stdout
    assert (out / "table.txt").read_text().startswith("optimizer")
    results = json.loads((out / "results.json").read_text())
    assert [r["optimizer"] for r in results["results"]] == ["adamw"]
    assert not (out / "loss.png").exists()
    # The plain progress lines (stdout is a pipe here, not a terminal).
    assert "adamw: step 4/4" in proc.stdout


def test_write_outputs_without_matplotlib(tmp_path, monkeypatch):
    """The same fallback in-process (fast): the table and JSON come first, the plot is skipped."""
    import train_lm

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    cfg = train_lm.Config(steps=2)
    record = dict(optimizer="adamw", hyperparameters=dict(lr=1e-3, b1=0.9), train_losses=[5.0, 4.0],
                  heldout_curve=[(2, 4.5)], train_loss=4.1, heldout_loss=4.5, seconds=1.0,
                  step_ms=10.0, grad_ms=8.0)
    written = train_lm.write_outputs(str(tmp_path), cfg, {}, [record])
    assert written["plot"] is None
    assert "20%" in written["table"]  # (10 - 8) / 10 of the step is the optimizer
    assert (tmp_path / "table.txt").exists() and (tmp_path / "results.json").exists()


def test_train_lm_table_prints_the_optimizer_time_as_measured():
    """``step − fwd+bwd`` as measured (a negative one marked, not clamped to 0%), and the share
    of the step only when the difference is positive."""
    import train_lm

    base = dict(hyperparameters=dict(lr=1e-3, b1=0.9), train_loss=4.1, heldout_loss=4.5,
                seconds=1.0)
    rows = [dict(base, optimizer="dion3", step_ms=10.0, grad_ms=8.0),
            dict(base, optimizer="adamw", step_ms=7.5, grad_ms=8.0),
            dict(base, optimizer="normuon", step_ms=9.0, grad_ms=float("nan"))]
    lines = train_lm.format_table(rows).splitlines()
    assert "optimizer ms" in lines[0] and "optimizer %" in lines[0]
    cells = {line.split()[0]: line.split()[7:9] for line in lines[2:5]}
    assert cells == {"dion3": ["+2.0", "20%"], "adamw": ["-0.5*", "-"],
                     "normuon": ["-", "-"]}, cells
    assert "negative" in train_lm.format_table(rows)


def test_train_multipod_refuses_a_mesh_larger_than_the_devices(capsys):
    """One line naming the mesh and the devices found, before any model is built."""
    import train_multipod

    with pytest.raises(SystemExit) as e:
        train_multipod.main(["--mesh", "4x4", "--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train_multipod.py: error: --mesh 4x4 needs 16 "
                                               "devices, found "), err


def test_train_multipod_progress_names_the_step_of_the_loss():
    """Between logged steps the counter moves on and the loss shown says which step it is from."""
    import train_multipod

    stream, losses = io.StringIO(), []
    bar = _common.Progress(8, "train", enabled=True, lines=4, stream=stream)
    for step in range(8):
        if step % 5 == 0 or step == 7:
            train_multipod.log_loss(bar, losses, step, 1.0 / (step + 1))
        bar.update(1)
    assert losses == [(0, 1.0), (5, 1 / 6), (7, 1 / 8)]
    assert stream.getvalue().splitlines() == [
        "train: step 2/8 (0 s) loss=1.0000 (step 0)", "train: step 4/8 (0 s) loss=1.0000 (step 0)",
        "train: step 6/8 (0 s) loss=0.1667 (step 5)", "train: step 8/8 (0 s) loss=0.1250 (step 7)"]


def _fake(path, text: str) -> None:
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(0o755)


@pytest.mark.parametrize("case", ["gpu python3", "gpu, python3 without it", "no gpu",
                                  "DION3_PYTHON"])
def test_train_sh_picks_the_python_that_sees_the_gpu(tmp_path, case):
    """scripts/train.sh on a machine with an NVIDIA GPU runs the python3 whose JAX sees it (the
    pinned environment holds JAX's CPU build), says so, and else uses the pinned environment;
    DION3_PYTHON overrides both. Fakes stand in for nvidia-smi, python3 and the environment."""
    root, bin_dir = tmp_path / "repo", tmp_path / "bin"
    (root / "scripts").mkdir(parents=True)
    bin_dir.mkdir()
    for name in ("train.sh", "setup_env.sh"):
        shutil.copy(os.path.join(ROOT, "scripts", name), root / "scripts" / name)
    venv = root / ".venv" / "bin"
    venv.mkdir(parents=True)
    _fake(venv / "python", 'echo "pinned python ran: $*"\n')  # setup_env's checks pass too
    (root / ".venv" / ".dion3_installed").touch()
    gpu = case != "no gpu"
    _fake(bin_dir / "nvidia-smi", f'echo "{"GPU 0: Fake GPU (UUID: GPU-0)" if gpu else ""}"\n')
    sees = 0 if case != "gpu, python3 without it" else 1
    _fake(bin_dir / "python3", f'if [ "$1" = "-" ]; then cat >/dev/null; echo "jax 0.11.2"; '
                               f'exit {sees}; fi\necho "system python3 ran: $*"\n')
    _fake(bin_dir / "mine", 'echo "DION3_PYTHON ran: $*"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("DION3_VENV", "DION3_PYTHON")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    if case == "DION3_PYTHON":
        env["DION3_PYTHON"] = str(bin_dir / "mine")
    proc = subprocess.run(["bash", str(root / "scripts" / "train.sh"), "--steps", "3"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    ran = {"gpu python3": "system python3", "gpu, python3 without it": "pinned python",
           "no gpu": "pinned python", "DION3_PYTHON": "DION3_PYTHON"}[case]
    assert f"{ran} ran: examples/train_lm.py --steps 3" in proc.stdout, proc.stdout
    assert ("JAX sees it (jax 0.11.2)" in proc.stdout) == (case == "gpu python3")
    assert ("does not see it" in proc.stderr) == (case == "gpu, python3 without it")

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
"""``docs/QUALITY.md`` is what ``examples/quality_study.py --report`` makes of the committed
results, and the report's tables are computed from the runs (not typed in)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from seeds import module_seed

pytestmark = pytest.mark.tooling

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()

pytest.importorskip("matplotlib")

ROOT = os.path.join(os.path.dirname(__file__), "..")
RESULTS = "docs/quality/h200_results.jsonl"
ROUNDING = "docs/quality/h200_rounding.jsonl"  # --plan rounding: its own section
#: --plan floor: its own section, from five calls (each resumed the earlier files; the fourth
#: and fifth re-ran the 16-bit momenta, and their runs replace the earlier ones).
FLOOR = ("docs/quality/h100_floor.jsonl docs/quality/h100_floor_f16.jsonl "
         "docs/quality/h100_floor_bf16p.jsonl docs/quality/h100_floor_16bit.jsonl "
         "docs/quality/h100_floor_16bit_seed2.jsonl")
NOTES = "docs/quality/notes.md"
#: The command docs/QUALITY.md quotes (the GPU run's, with the library copy on PYTHONPATH).
COMMAND = ("PYTHONPATH=runs/quality_lib python3 examples/quality_study.py "
           "--out runs/quality/study.jsonl --time-budget 550 --compile-workers 8")


@pytest.fixture(scope="module")
def study():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import quality_report
    import quality_study

    return quality_study, quality_report


def test_committed_report_is_regenerated_from_the_committed_results(study, tmp_path,
                                                                    monkeypatch):
    quality_study, _ = study
    monkeypatch.chdir(ROOT)
    doc = tmp_path / "QUALITY.md"
    quality_study.main(["--report", RESULTS, ROUNDING, *FLOOR.split(), "--notes", NOTES, "--doc",
                        str(doc), "--plots", str(tmp_path), "--command", COMMAND])
    with open("docs/QUALITY.md") as f:
        assert doc.read_text() == f.read(), (
            "docs/QUALITY.md is stale: regenerate it with quality_study.py --report "
            f"{RESULTS} {ROUNDING} {FLOOR} --notes {NOTES} --command '{COMMAND}'")
    assert {p.name for p in tmp_path.glob("*.png")} >= {"curves.png", "lr.png", "heatmap.png"}


def test_grid_cells_are_the_seed_0_runs(study, tmp_path):
    """Cells are read from the runs: shuffle the losses and the table follows them."""
    _, quality_report = study
    runs = quality_report.load([os.path.join(ROOT, RESULTS)])["runs"]
    rng = np.random.default_rng(SEED)
    for r in runs:
        r["final_heldout"] = float(rng.uniform(1, 2))
    cells = quality_report.grid_cells(quality_report.group(runs))
    for r in runs:
        if r["opt"] == "dion3" and r["seed"] == 0 and r["phase"] == "grid":
            assert cells[(r["fraction"], r["lr_mult"])] <= r["final_heldout"]
    normuon = {r["lr"]: r["final_heldout"] for r in runs if r["opt"] == "normuon" and
               r["seed"] == 0 and r["phase"] != "time" and r["wd"] == 0.01}
    best = min(normuon, key=normuon.get)
    assert cells[(1.0, 1.0)] == normuon[best]


def test_quality_report_has_a_command_line_of_its_own():
    script = os.path.join(ROOT, "examples", "quality_report.py")
    run = lambda *a: subprocess.run([sys.executable, script, *a], capture_output=True,  # noqa
                                    text=True, timeout=60)
    help_ = run("--help")
    assert help_.returncode == 0 and help_.stdout.startswith("usage: quality_report.py"), help_
    for flag in ("JSONL", "--notes", "--doc", "--plots", "--command", "docs/QUALITY.md"):
        assert flag in help_.stdout, flag
    bare = run()
    assert bare.returncode == 2 and "the following arguments are required: JSONL" in bare.stderr


def test_both_command_lines_make_the_same_report(study, monkeypatch):
    """``quality_report.py FILES ...`` and ``quality_study.py --report FILES ...`` make one call."""
    quality_study, quality_report = study
    calls = []
    monkeypatch.setattr(quality_report, "report", lambda *a: calls.append(a) or a[1])
    monkeypatch.chdir(ROOT)
    flags = ["--notes", NOTES, "--doc", "d.md", "--plots", "p", "--command", "c"]
    quality_report.main([RESULTS, ROUNDING, *FLOOR.split(), *flags])
    quality_study.main(["--report", RESULTS, ROUNDING, *FLOOR.split(), *flags])
    assert calls == [([RESULTS, ROUNDING, *FLOOR.split()], "d.md", "p", "c", NOTES)] * 2, calls

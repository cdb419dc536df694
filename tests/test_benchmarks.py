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
"""The benchmark scripts run end to end on the CPU in their small configurations (smoke only:
no timing is asserted; timings are reported by the scripts, never by tests)."""

from __future__ import annotations

import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

from seeds import module_seed

pytestmark = pytest.mark.tooling

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _benchmark(name: str):
    """The module ``benchmarks/<name>.py``, imported with ``benchmarks/`` on the path for the
    import only."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


# One run for every path of the step benchmark: the baselines, compiled up front on two threads,
# FSDP on a mesh of two devices, each Dion3 variant with and without megabatching; standard NS
# here (profile_step runs Gram NS) at f = 1/4 (bench_commits runs f = 1).
_BENCH_STEP = ["--small", "--reps", "1", "--compile-workers", "2", "--fsdp", "--no-megabatch",
               "--cpu-devices", "2", "--fractions", "0.25", "--methods", "standard",
               "--backends", "xla"]
_PROFILE_STEP = ["--small", "--fraction", "0.25", "--steps", "2", "--queued", "--show-hlo",
                 "sort", "--fsdp", "--cpu-devices", "4", "--xla-option",
                 "xla_cpu_enable_fast_math=false"]


#: (script, its arguments): the scripts that set no process-wide option.
_IN_PROCESS = [
    # One of the small shapes: every shape takes the same loop (the float32 reference, each
    # variant, optax's NS), and each costs about a second of compiles; the batched one also
    # takes optax's reshape.
    ("bench_polar", ["--small", "--reps", "1", "--shapes", "4x64x256"]),
    ("bench_selection", ["--small", "--reps", "1", "--rotate", "2"]),
    ("bench_layout", ["--small", "--reps", "1", "--fractions", "0.25"]),
    ("bench_payload", ["--small", "--reps", "1", "--variants", "default", "w8", "--fractions",
                       "0.25"]),
    # No GPU warm-up: on the CPU one 8192² bfloat16 product of the warm-up loop takes seconds.
    ("bench_kernels", ["--smoke", "--polar", "--peers", "--warmup-s", "0", "--reps", "1",
                       "--rotate", "2"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,args", _IN_PROCESS, ids=[name for name, _ in _IN_PROCESS])
def test_benchmark_script_runs_in_process(name, args, capsys, request):
    """The scripts that set no process-wide option run their ``main(args)`` in this process:
    one interpreter start (and JAX import) fewer each."""
    if name == "bench_kernels":
        # The suite turns most XLA optimizations off (conftest.py), which makes bench_kernels'
        # smoke run twice as slow: its run time outweighs its compile time.
        request.getfixturevalue("default_xla_optimizations")
    capsys.readouterr()
    _benchmark(name).main(args)
    assert "ms" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("args", [["benchmarks/bench_step.py", *_BENCH_STEP],
                                  ["benchmarks/profile_step.py", *_PROFILE_STEP]],
                         ids=["bench_step", "profile_step"])
def test_benchmark_script_runs(args):
    """The scripts that simulate CPU devices (``--cpu-devices``: set before JAX's backend
    starts) run as commands."""
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ms" in out.stdout


#: A one-layer model of square matrices (d = ff = 64), for the tests of the script's own options:
#: one shape group, so its Dion3 step compiles in about half the time of the tiny model's
#: (--d 64 --ff 176: three groups), and the script takes the same path whatever the shapes.
_SQUARE = ["--layers", "1", "--d", "64", "--ff", "64"]


def _bench_compile(capsys, *args: str):
    """What ``bench_compile.main(args)`` prints, run in this process: one interpreter start
    fewer per test. test_bench_compile_cache_dir runs the script as a command
    (its persistent cache is a process-wide setting)."""
    capsys.readouterr()
    _benchmark("bench_compile").main(list(args))
    return capsys.readouterr().out


@pytest.mark.slow  # a benchmark's smoke run; the fast loop stays under its budget
def test_bench_compile_lower_for_h200_counts_kernels(capsys):
    """bench_compile.py --lower-for-h200 (no GPU): the default step lowers Mosaic GPU kernels
    (the passes at least), the step with every product and pass in XLA none, and a float16
    momentum's step (``--mu-dtypes``) as many as the default's."""
    # Square 256² matrices: one shape group, so one statistics and one payload kernel per step,
    # each lowered in about half a second (d ≠ ff: three groups, six kernels).
    # test_row_stats_stochastic.py lowers a 16-bit momentum's kernels for wide and tall leaves.
    out = _bench_compile(capsys, "--layers", "1", "--d", "256", "--ff", "256", "--fractions",
                         "1", "--lower-for-h200", "--list-kernels", "--mu-dtypes", "float16")
    table, listing = out.split("\n\n", 1)
    rows = {" ".join(line.split()[1:-3]): int(line.split()[-1])
            for line in table.splitlines()[2:]}
    assert set(rows) == {"dion3 f=1", "dion3 f=1 no kernels", "dion3 f=1 mu=float16"}, out
    assert rows["dion3 f=1"] >= 2 and rows["dion3 f=1 no kernels"] == 0, out
    assert rows["dion3 f=1 mu=float16"] == rows["dion3 f=1"], out
    # --list-kernels: one line per counted kernel, its wrapper and its types (the default
    # step's section first).
    first = listing.split("\n\n")[0]
    assert first.splitlines()[0].startswith("1 layers, dion3 f=1:"), out
    kernels = [line.split()[0] for line in first.splitlines() if line.startswith("  ")]
    assert len(kernels) == rows["dion3 f=1"], out
    assert any(k.startswith("accumulate_rows_mosaic") for k in kernels), out
    assert all("tensor<" in line for line in listing.splitlines() if line.startswith("  "))


@pytest.mark.slow  # a benchmark's smoke run; the fast loop stays under its budget
def test_bench_compile_ops_table(capsys):
    """bench_compile.py --ops: one row per per-matrix pass, its compile milliseconds per
    instance and its fusions per instance (the passes are the step's: each compiles to at
    least one kernel)."""
    out = _bench_compile(capsys, "--ops", "2", "--d", "64")
    rows = [line.rsplit(None, 2) for line in out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["S = d ⊙ M + G", "S and its two row sums",
                                    "payload gather S[:, I] → f16", "update gather + parameter",
                                    "AdamW's update", "slice of a per-group array"], out
    assert all(float(ms) > 0 and float(fusions) >= 1 for _, ms, fusions in rows), out


@pytest.mark.slow  # a benchmark's smoke run; the fast loop stays under its budget
def test_bench_compile_no_kernel_rows(capsys):
    """bench_compile.py --no-kernel-rows: each Dion3 step also compiled with no kernel, in a
    row of its own, after AdamW's."""
    out = _bench_compile(capsys, *_SQUARE, "--fractions", "1", "0.5", "--no-kernel-rows")
    names = [" ".join(line.split()[1:-5]) for line in out.splitlines()[2:]]
    assert names == ["adamw", "dion3 f=1", "dion3 f=1 no kernels", "dion3 f=0.5",
                     "dion3 f=0.5 no kernels"], out


@pytest.mark.slow  # a benchmark's smoke run; the fast loop stays under its budget
def test_bench_compile_cache_dir(tmp_path):
    """bench_compile.py --cache-dir: the first run writes its executables into the persistent
    cache, a second identical run finds every one there (it writes none)."""
    cmd = [sys.executable, "benchmarks/bench_compile.py", *_SQUARE, "--fractions", "1",
           "--cache-dir", str(tmp_path)]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    entries = sorted(p.name for p in tmp_path.iterdir())
    assert len([e for e in entries if e.startswith("jit_step")]) == 2, entries  # AdamW, Dion3
    second = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == entries
    assert [line.split()[1] for line in second.stdout.splitlines()[2:]] == ["adamw", "dion3"]


@pytest.mark.slow  # a benchmark's smoke run; the fast loop stays under its budget
def test_bench_compile_first_call(capsys):
    """bench_compile.py --first-call: under each variant's row, the seconds of its compiled
    step's first and second call on allocated leaves."""
    out = _bench_compile(capsys, *_SQUARE, "--fractions", "1", "--first-call")
    lines = out.splitlines()[2:]
    assert [line.split()[:2] for line in lines[1::2]] == [["adamw", "first"], ["dion3", "f=1"]]
    for line in lines[1::2]:
        first, second = map(float, re.search(r"first call (\S+) s, second (\S+) s", line).groups())
        assert first > 0 and second > 0, line


@pytest.mark.slow
def test_bench_compile_repeats(capsys):
    """bench_compile.py --repeats 2: two rounds of rows, then a median row per variant whose
    ratio is its median total over AdamW's (the tiny model, f = 1 only)."""
    # Not _SQUARE: the ratio is printed to 0.1 and the totals to 0.01 s, and with a Dion3 step
    # that compiles in half the time their rounding could add up to more than the 5 % below.
    out = _bench_compile(capsys, "--layers", "1", "--d", "64", "--ff", "176", "--fractions", "1",
                         "--repeats", "2")
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [r[1] for r in rows] == ["adamw", "dion3", "adamw", "dion3", "adamw", "dion3"]
    totals = {name: sorted(float(r[-2]) for r in rows[:4] if r[1] == name)
              for name in ("adamw", "dion3")}
    median = {name: sum(t) / 2 for name, t in totals.items()}  # the median of two
    assert rows[4][2] == rows[5][3] == "(median)", out
    assert float(rows[4][-2]) == pytest.approx(median["adamw"], abs=0.006)
    assert float(rows[5][-2]) == pytest.approx(median["dion3"], abs=0.006)
    # (the printed totals are rounded to 0.01 s, so their ratio only to a few percent)
    assert float(rows[5][-1]) == pytest.approx(median["dion3"] / median["adamw"], rel=0.05)


def test_bench_commits_renames_imports_to_any_suffix():
    rename = _benchmark("bench_commits").rename_imports
    source = ("from dion3_jax import _polar\nimport pallas_kernels\n"
              "    from pallas_kernels._mosaic import f  # indented\nimport numpy\n")
    assert rename(source, "_b") == (
        "from dion3_jax_b import _polar\nimport pallas_kernels_b as pallas_kernels\n"
        "    from pallas_kernels_b._mosaic import f  # indented\nimport numpy\n")
    assert rename(source) == rename(source, "_old")  # the default
    assert "from dion3_jax_old import _polar" in rename(source)
    with pytest.raises(ValueError, match="dion3_jax._polar"):
        rename("import dion3_jax._polar\n", "_b")


def test_bench_commits_old_dirs_are_named_by_distinct_suffixes(tmp_path):
    """One ``--old-dir`` is "old"; several are named by their packages' suffixes, which must
    differ; a directory without a SUFFIX file holds "_old" packages."""
    old_dirs = _benchmark("bench_commits").old_dirs
    made = {}
    for name, suffix in [("a", "_a"), ("b", "_b"), ("c", "_a"), ("plain", None),
                         ("w", "_adamw")]:
        d = tmp_path / name
        d.mkdir()
        (d / "COMMIT").write_text(f"c0mm1t{name}\n")
        if suffix:
            (d / "SUFFIX").write_text(suffix)
        made[name] = str(d)
    assert old_dirs([made["plain"]]) == {"old": (made["plain"], "_old", "c0mm1tplain")}
    assert old_dirs([made["a"]]) == {"old": (made["a"], "_a", "c0mm1ta")}
    assert old_dirs([made["a"], made["b"], made["plain"]]) == {
        "a": (made["a"], "_a", "c0mm1ta"), "b": (made["b"], "_b", "c0mm1tb"),
        "old": (made["plain"], "_old", "c0mm1tplain")}
    with pytest.raises(ValueError, match=r"--old-dir .*/c: .*'_a'"):
        old_dirs([made["a"], made["c"]])
    with pytest.raises(ValueError, match=r"--old-dir .*/w: .*'_adamw'.*AdamW's row"):
        old_dirs([made["a"], made["w"]])


@pytest.mark.slow
def test_bench_commits_times_several_exported_versions_in_one_table(tmp_path):
    """Two exports of HEAD (suffixes _a and _b) and the working tree in the same rounds: one
    ms column per version and one ``new / name`` ratio per older one. (The exports run
    ``main`` in this process: they import neither version; the timed run, which does, is a
    command.)"""
    bench_commits = _benchmark("bench_commits")
    for suffix in ("_a", "_b"):
        assert bench_commits.main(["--commit", "HEAD", "--export-to", str(tmp_path / suffix),
                                   "--suffix", suffix]) == []
        assert (tmp_path / suffix / f"dion3_jax{suffix}" / "__init__.py").exists()
    out = subprocess.run([sys.executable, "benchmarks/bench_commits.py", "--small", "--reps", "1",
                          "--fractions", "1", "--old-dir", str(tmp_path / "_a"),
                          str(tmp_path / "_b")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    header = lines.index("| fraction | a ms | b ms | new ms | new / a | new / b |")
    (row,) = [[float(v) for v in line.split("|")[1:-1]] for line in lines[header + 2:]]
    f, a, b, new, new_a, new_b = row
    assert f == 1.0 and min(a, b, new) > 0, out.stdout
    assert new_a == pytest.approx(new / a, rel=0.02)
    assert new_b == pytest.approx(new / b, rel=0.02)


@pytest.mark.slow
def test_bench_commits_against_head():
    """bench_commits.py imports HEAD's packages under other names next to the working tree's and
    prints one table row per fraction asked for; with ``--adamw`` AdamW's step joins the rounds
    and each version's ratio to it is its time over AdamW's (both versions the same code here,
    so only the table is checked; f = 1, the cheaper step to compile twice)."""
    out = subprocess.run([sys.executable, "benchmarks/bench_commits.py", "--small", "--commit",
                          "HEAD", "--reps", "1", "--fractions", "1", "--adamw"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    header = lines.index("| fraction | AdamW ms | old ms | old × AdamW | new ms | new × AdamW "
                         "| new / old |")
    rows = [[float(v) for v in line.split("|")[1:-1]] for line in lines[header + 2:]]
    assert [r[0] for r in rows] == [1.0], out.stdout
    for f, adamw, old, old_x, new, new_x, ratio in rows:
        assert min(adamw, old, new) > 0, out.stdout
        # (the ms are printed to 0.01: the ratios of the printed values agree to about that)
        assert old_x == pytest.approx(old / adamw, rel=0.02)
        assert new_x == pytest.approx(new / adamw, rel=0.02)
        assert ratio == pytest.approx(new / old, rel=0.02)


@pytest.mark.slow
def test_profile_step_profiles_an_exported_version_first(tmp_path, capsys):
    """profile_step.py --old-dir: HEAD exported by bench_commits.py is profiled before the
    working tree, in one process, a set of tables each, the older one named by its commit, both
    with the momentum dtype named; it refuses options that write one step's results."""
    _benchmark("bench_commits").export_dir("HEAD", tmp_path / "h", "_h")
    cmd = [sys.executable, "benchmarks/profile_step.py", "--small", "--fraction", "1",
           "--steps", "1", "--top", "2", "--old-dir", str(tmp_path / "h"), "--mu-dtype",
           "float16"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    commit = (tmp_path / "h" / "COMMIT").read_text().strip()
    heads = [line for line in out.stdout.splitlines() if line.startswith("# ")]
    assert len(heads) == 2, out.stdout
    assert f": old = {commit}: dion3 f=1 (its defaults, mu=float16)," in heads[0], heads
    assert ": dion3 f=1 gram auto passes=auto mu=float16," in heads[1], heads
    assert out.stdout.count("| op kind | ops | ms / step | share |") == 2, out.stdout
    # (refused while parsing its arguments, before any JAX work: run in this process)
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        _benchmark("profile_step").main([*cmd[2:], "--json", str(tmp_path / "ops.json")])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "--old-dir" in err, err[-2000:]
    assert not (tmp_path / "ops.json").exists()


def test_polar_standalone_example():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import polar_standalone
    finally:
        sys.path.pop(0)
    res = polar_standalone.main(["--shape", "2", "32", "96"])
    for method in ("gram", "standard"):
        assert 0.7 < res[method]["sv_min"] and res[method]["sv_max"] < 1.25
        assert res[method]["rel_err"] < 0.2


def test_replica_sync_dtype_ring_mean():
    """The emulated 16-bit ring all-reduce rounds like one float16 per addition (scaled: no
    overflow even for entries far above float16's range)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import jax.numpy as jnp
    import numpy as np
    import replica_sync_dtype as rsd

    rng = np.random.default_rng(SEED)
    parts = 1e6 * rng.standard_normal((8, 16, 32))  # ≫ 65504: only the shared scale saves it
    exact = parts.mean(0)
    assert rsd.rel(rsd.ring_mean(parts, jnp.float32), exact) < 1e-6
    err16 = rsd.rel(rsd.ring_mean(parts, jnp.float16), exact)
    assert 1e-5 < err16 < 8 * 2.0 ** -11  # rounded, by at most a few float16 ulps


@pytest.mark.slow
def test_replica_sync_dtype_table(capsys):
    """The table, one row per wire (``main`` in this process: the script sets no process-wide
    option)."""
    capsys.readouterr()
    _benchmark("replica_sync_dtype").main(["--rows", "32", "--cols", "64", "--replicas", "2",
                                           "--trials", "1", "--steps", "4"])
    assert capsys.readouterr().out.count("| 2 |") == 3


@pytest.mark.slow
def test_bench_kernels_runs_only_the_shapes_asked_for(capsys, default_xla_optimizations):
    """``--shapes`` keeps the cases whose printed shape is listed, and no other (with XLA's
    default optimizations, under which this smoke run takes half the time)."""
    bench_kernels = _benchmark("bench_kernels")
    bench_kernels.main(["--smoke", "--shapes", "2x128x128", "--warmup-s", "0", "--reps", "1",
                        "--rotate", "2"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith(("syrk ", "sym_matmul "))]
    assert rows and {(r[0], r[1]) for r in rows} == {("sym_matmul", "2x128x128")}, rows


def test_bench_kernels_counts_the_products_of_gram_newton_schulz():
    """The breakdown's counts, read off the jaxpr: one of each kind, then the default polar (five
    steps, a restart at step 2: two Gram matrices, two applications of Q, 5 + 3 + 6 products of
    symmetric matrices)."""
    import jax.numpy as jnp
    import numpy as np

    import dion3_jax
    import pallas_kernels

    bench_kernels = _benchmark("bench_kernels")

    def one_of_each(x, g):
        gram = pallas_kernels.syrk(x, implementation="xla")
        sym = pallas_kernels.sym_matmul(gram, g, gram, alpha=2.0, beta=1.0, implementation="xla")
        return jnp.matmul(sym, x)

    x = np.ones((16, 48), np.float16)
    g = np.eye(16, dtype=np.float16)
    counts = bench_kernels.count_products(one_of_each, x, g)
    assert counts == {"syrk": 1, "sym_matmul": 1, "matmul": 1}, counts
    for shape in ((16, 48), (48, 16)):
        counts = bench_kernels.count_products(
            lambda v: dion3_jax.polar(v, method="gram", backend="xla"), np.ones(shape, np.float16))
        assert counts == {"syrk": 2, "sym_matmul": 14, "matmul": 2}, (shape, counts)


@pytest.mark.slow
def test_polar_dtype_orders_the_dtypes_by_their_rounding():
    """bfloat16 rounds the polar's iteration more than float16; float32 is the reference."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import polar_dtype

    table = {(r["method"], r["dtype"]): r for r in polar_dtype.rows((2, 32, 128), seeds=1)}
    for method in ("gram", "standard"):
        assert table[method, "float32"]["distance"] == 0.0
        assert 0 < table[method, "float16"]["distance"] < table[method, "bfloat16"]["distance"]
        bf16 = table[method, "bfloat16"]
        assert 0.6 < bf16["sv_min"] and bf16["sv_max"] < 1.4


def test_bench_payload_reads_mosaic_blocks_and_skips_those_a_shape_refuses():
    """``--mosaic-blocks ROWS,COLS,CHUNK,STAGES`` becomes a ``MosaicPayloadConfig``; a block
    choice the kernel does not take for a group's shape gives that group no row."""
    from pallas_kernels._payload_mosaic import MosaicPayloadConfig

    bench_payload = _benchmark("bench_payload")
    config = bench_payload._mosaic_config("32,128,512,4")
    assert config == MosaicPayloadConfig(rows=32, cols=128, chunk=512, stages=4)
    # 8 columns: no power-of-two divisor of at least 16, so no block of this choice fits.
    assert bench_payload._mosaic_block_rows(1, (64, 24), [config], reps=1, interpret=True) == []


def test_bench_row_stats_reads_its_variants():
    """``mosaic:STRIP,STEP,CHUNK,STAGES`` becomes a Mosaic config; the named implementations
    pass through; anything else is refused."""
    from pallas_kernels._row_stats_mosaic import MosaicRowStatsConfig

    bench_row_stats = _benchmark("bench_row_stats")
    assert bench_row_stats.parse_variant("pallas_triton") == ("pallas_triton", None)
    assert bench_row_stats.parse_variant("mosaic:64,64,512,2") == (
        "mosaic", MosaicRowStatsConfig(strip=64, step=64, chunk=512, stages=2))
    with pytest.raises(ValueError, match="unknown variant 'triton'"):
        bench_row_stats.parse_variant("triton")


def test_kernel_model_reproduces_its_calibration_and_counts_the_polar():
    """model_kernels.py: the 4096² ``sym_matmul`` it is calibrated on comes back at 96.3 µs (264
    items, two per CTA on 132 SMs); the step's products follow the default polar (f = 1/4's
    attention payloads: 2 Gram products, 14 symmetric ones, padded 1024 × 4096), and products
    under ``AUTO_MIN_WORK`` are left to XLA."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import model_kernels as mk
    finally:
        sys.path.pop(0)
    t = mk.timing(mk.Product("sym_matmul", 1, 4096, 4096, 1), 132, 0.664, 5.67)
    assert (t.items, t.waves, t.fill) == (264, 2, 1.0)
    assert t.us == pytest.approx(96.3, abs=0.1)
    assert t.hidden_us == pytest.approx(t.us - 2 * 5.67)
    attention = mk.payload_products(32, 4096, 4096, 0.25)
    assert attention == [mk.Product("syrk", 32, 1024, 4096, 2),
                         mk.Product("sym_matmul", 32, 1024, 1024, 14)]
    # f = 1/8's MLP payloads: 1376 selected rows padded to 1408; square f = 1: standard NS.
    assert mk.payload_products(16, 4096, 11008, 0.125)[1] == mk.Product(
        "sym_matmul", 16, 1408, 1408, 14)
    assert mk.payload_products(32, 4096, 4096, 1.0) == [
        mk.Product("syrk", 32, 4096, 4096, 5), mk.Product("sym_matmul", 32, 4096, 4096, 5)]
    assert mk.in_xla(mk.Product("sym_matmul", 8, 512, 512, 14))
    assert not mk.in_xla(mk.Product("sym_matmul", 32, 512, 512, 14))


def test_bench_commits_memory_and_polar_variant_columns(capsys):
    """``step_memory`` reads XLA's analysis of a compiled step (its arguments' bytes exactly),
    and a polar variant (``--polar``) gets a ``name / new`` ratio column, not a ``new / name``
    one."""
    import jax
    import numpy as np

    bench_commits = _benchmark("bench_commits")
    a, b = np.ones((64, 32), np.float32), np.ones((32, 16), np.float32)
    compiled = jax.jit(lambda x, y: x @ y).lower(a, b).compile()
    args_gib, peak_gib = bench_commits.step_memory(compiled)
    assert args_gib * 2**30 == pytest.approx(a.nbytes + b.nbytes)
    assert peak_gib >= args_gib
    rows = [{"fraction": 0.25, "adamw_ms": None,
             "ms": {"old": 4.0, "new": 2.0, "new pe4+bound r-": 1.5}}]
    bench_commits.print_table(rows, ["old", "new", "new pe4+bound r-"], adamw=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("| fraction | old ms | new ms | new pe4+bound r- ms | new / old "
                        "| new pe4+bound r- / new |")
    assert lines[2] == "| 0.25 | 4.00 | 2.00 | 1.50 | 0.500 | 0.750 |"


def test_bench_commits_refuses_a_step_that_cannot_fit_beside_the_others():
    """``check_fits``: a step whose arguments and temporaries, less the gradients that every
    version shares, exceed the device's free memory raises ``MemoryError`` with both numbers
    (XLA's allocator would wait and retry); one that fits, or a backend without memory
    statistics, passes."""
    import numpy as np

    bench_commits = _benchmark("bench_commits")
    grads = {"w": np.zeros((4096, 8192), np.float32)}       # 1/8 GiB
    peak = 3.0 + 1 / 8 + 0.01                               # GiB
    need = 3.01
    stats = {"bytes_limit": 8 * 2**30}
    bench_commits.check_fits(grads, peak, None)
    bench_commits.check_fits(grads, peak, dict(stats, bytes_in_use=2**30 * (8 - need - 0.01)))
    tight = dict(stats, bytes_in_use=2**30 * (8 - need + 0.1))
    with pytest.raises(MemoryError, match=r"needs 3\.01 GiB .* 2\.91 GiB free of 8\.00 GiB"):
        bench_commits.check_fits(grads, peak, tight)

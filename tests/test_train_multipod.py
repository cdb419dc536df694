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
"""examples/train_multipod.py in a short configuration on 8 simulated CPU devices (the default
2x2x2x1 mesh of dcn, fsdp, tp and expert axes, and 1x2x2x2), and as two processes joined by
jax.distributed (--distributed) against the single-process run."""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

import dion3_jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import train_multipod  # noqa: E402

pytestmark = [pytest.mark.tooling,
              pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")]


#: What LOGICAL_RULES make of each kernel's logical names (path suffix → spec).
EXPECTED_SPECS = {
    "['inp']": P("fsdp", "tp"),                       # ("embed", "mlp")
    "['attn']['q']": P("fsdp", "tp"),                 # ("embed", "heads")
    "['attn']['k']": P("fsdp", "tp"),
    "['attn']['v']": P("fsdp", "tp"),
    "['attn']['o']": P("tp", "fsdp"),                 # ("heads", "embed")
    "['mlp']['up']": P("fsdp", "tp"),                 # ("embed", "mlp")
    "['mlp']['down']": P("tp", "fsdp"),               # ("mlp", "embed")
    "['moe']['router']": P("fsdp", None),             # ("embed", None)
    "['moe']['experts_up']": P("expert", "fsdp", "tp"),    # ("exp", "embed", "mlp")
    "['moe']['experts_down']": P("expert", "tp", "fsdp"),  # ("exp", "mlp", "embed")
    "['head']": P("fsdp", "tp"),                      # ("embed", "vocab")
}


def _expected_spec(path: str) -> P:
    (spec,) = [v for k, v in EXPECTED_SPECS.items() if path.endswith(k)]
    return spec


def test_mesh_flag_takes_four_sizes_or_the_two_of_dcn_and_fsdp(capsys):
    parse = train_multipod.parse_args
    assert parse(["--no-progress"]).mesh == (2, 2, 2, 1)
    assert parse(["--mesh", "2x4"]).mesh == (2, 4, 1, 1)
    assert parse(["--mesh", "1x2x2x2"]).mesh == (1, 2, 2, 2)
    cases = [
        (["--mesh", "2x2x2"], "must look like 2x4 (DCN x FSDP) or 2x2x2x1"),
        (["--mesh", "2x0x2x2"], "every size must be >= 1"),
        (["--mesh", "1x2x2x2", "--experts", "3"],
         "--experts 3 must be divisible by the expert size 2 of --mesh 1x2x2x2"),
        (["--mesh", "1x1x8x1", "--hidden", "36", "--heads", "3", "--mlp", "64"],
         "--hidden 36 must be divisible by the tp size 8 of --mesh 1x1x8x1"),
        (["--mesh", "1x2x4x1", "--mlp", "34"],
         "--mlp 34 must be divisible by the tp size 4 of --mesh 1x2x4x1"),
        (["--mesh", "1x2x4x1", "--d-out", "6"],
         "--d-out 6 must be divisible by the tp size 4 of --mesh 1x2x4x1"),
        (["--heads", "5"], "--hidden 64 must be divisible by --heads 5"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            parse(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert message in err, (argv, err)


def _is_dion3_state(x) -> bool:
    return isinstance(x, dion3_jax.ScaleByDion3State)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """``short_run(mesh)``: the config, a fresh ``setup`` (the state before any step), a 20-step
    run of ``main`` on ``mesh`` (every step's loss logged) and the folder of its ``--out``
    results: one compile of the step per mesh, shared by the tests of this module (the
    two-process test's single-process reference included)."""
    runs = {}

    def run(mesh: str):
        if mesh not in runs:
            out = tmp_path_factory.mktemp(f"short_run_{mesh}")
            args = ["--mesh", mesh, "--steps", "20", "--log-every", "1", "--no-progress",
                    "--out", str(out)]
            cfg = train_multipod.parse_args(args)
            runs[mesh] = cfg, train_multipod.setup(cfg), train_multipod.main(args), out
        return runs[mesh]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["2x2x2x1", "1x2x2x2"])
def test_short_run_loss_goes_down_and_keeps_the_shardings(short_run, mesh):
    cfg, s, out, _ = short_run(mesh)
    assert dict(zip(s["mesh"].axis_names, s["mesh"].devices.shape)) == dict(
        zip(train_multipod.AXES, cfg.mesh))
    losses = [l for _, l in out["losses"]]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], out["table"]
    assert "| step |" in out["table"]
    assert out["train_step"]._cache_size() == 1   # one compile for all 20 steps

    # The params carry their logical names' specs, before and after the steps; the optimizer
    # state keeps the shardings that init gave it (momenta like the params).
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(s["params"])]
    assert len(paths) == len(EXPECTED_SPECS)
    for path, p0, p1 in zip(paths, jax.tree.leaves(s["params"]), jax.tree.leaves(out["params"])):
        want = NamedSharding(s["mesh"], _expected_spec(path))
        assert p0.sharding.is_equivalent_to(want, p0.ndim), (path, p0.sharding)
        assert p1.sharding.is_equivalent_to(want, p1.ndim), (path, p1.sharding)
    before, after = jax.tree.leaves(s["opt_state"]), jax.tree.leaves(out["opt_state"])
    assert len(before) == len(after)
    for x0, x1 in zip(before, after):
        assert x1.sharding.is_equivalent_to(x0.sharding, x1.ndim), (x0.sharding, x1.sharding)
    (dion3_state,) = [x for x in jax.tree.leaves(out["opt_state"], is_leaf=_is_dion3_state)
                      if _is_dion3_state(x)]
    momenta = {jax.tree_util.keystr(k): m
               for k, m in jax.tree_util.tree_leaves_with_path(dion3_state.momentum)}
    assert sorted(momenta) == sorted(p for p in paths if p != "['head']")   # head: AdamW
    for path, m in momenta.items():
        assert m.sharding.is_equivalent_to(
            NamedSharding(s["mesh"], _expected_spec(path)), m.ndim), (path, m.sharding)
    # Replicas hold identical weights (one value per array, equal on every device).
    for leaf in jax.tree.leaves(out["params"]):
        shards = {}
        for sh in leaf.addressable_shards:
            key = str(sh.index)
            if key in shards:
                np.testing.assert_array_equal(np.asarray(sh.data), shards[key])
            shards[key] = np.asarray(sh.data)


@pytest.mark.slow
def test_dion3_gradients_are_not_all_reduced_over_dcn(short_run):
    cfg, s, out, _ = short_run("2x2x2x1")  # its step, compiled once (this lowering reuses it)
    x, y = (train_multipod.global_array(a, s["data_sharding"]) for a in s["batch"](0))
    with jax.set_mesh(s["mesh"]):
        hlo = out["train_step"].lower(out["params"], out["opt_state"], x, y).compile().as_text()
    dcn = 0
    for line in hlo.splitlines():
        m = re.search(r"= (.*) all-reduce(?:-start)?\(", line)
        if m and re.search(r"replica_groups=.*\{'dcn'\}", line):
            for dims in re.findall(r"[a-z]+[0-9]*\[([0-9,]*)\]", m.group(1)):
                dcn += int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    labels = jax.tree.leaves(s["labels"])
    leaves = jax.tree.leaves(s["params"])
    dion3_elems = sum(p.addressable_shards[0].data.size   # one device's shards
                      for p, l in zip(leaves, labels) if l == "dion3")
    other_elems = sum(p.size for p, l in zip(leaves, labels) if l != "dion3")
    # Per device: the AdamW leaves, the loss and the selected momentum rows only (≈ f of the
    # device's Dion3 shards: measured exactly f), never the Dion3 gradients themselves.
    print(f"all-reduced over dcn per device: {dcn} elements; AdamW leaves {other_elems}, "
          f"Dion3 shards {dion3_elems}, f = {cfg.fraction}")
    bound = other_elems + 1 + 1.2 * cfg.fraction * dion3_elems
    assert 0 < dcn <= bound, (dcn, other_elems, dion3_elems)


# ---------------------------------------------------------------------------------------------
# --distributed: two processes on localhost (4 CPU devices each, gloo collectives) against the
# single-process run on 8 devices.

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "examples", "train_multipod.py")
RUN = ["--steps", "6", "--log-every", "1", "--no-progress", "--fraction", "0.25"]
# Measured: max |params difference| 2.8e-4 (kernels of order 0.1), losses 2e-5 relative: the
# cross-process all-reduces run through gloo in another order, and six steps of top-k row
# selection and Newton-Schulz carry the last-bit differences forward.
PARAM_TOL, LOSS_RTOL = 1e-3, 1e-3


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch_pair(out, timeout: float = 300) -> list[int | None]:
    """Both processes of the distributed run; a failed or late one gets both killed (by pid)."""
    import subprocess
    import time

    port = str(_free_port())
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs, logs = [], []
    try:
        for i in range(2):
            logs.append(open(out / f"p{i}.log", "w"))
            procs.append(subprocess.Popen(
                [sys.executable, SCRIPT, *RUN, "--out", str(out / "dist"), "--distributed",
                 "--coordinator", f"localhost:{port}", "--num-processes", "2",
                 "--process-id", str(i), "--cpu-devices-per-process", "4"],
                env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if None not in codes or any(codes):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for log in logs:
            log.close()
    return [p.returncode for p in procs]


def _log(out, i) -> str:
    text = (out / f"p{i}.log").read_text()
    return "".join(ln for ln in text.splitlines(True) if not ln.startswith("[Gloo]"))


def _single_process_params(train_step) -> tuple[dict, dict]:
    """The params of the single-process run of ``RUN`` after its last step and after the step
    before, by a compiled ``train_step`` of the same configuration (no second compile), keyed
    like ``params.npz``."""
    cfg = train_multipod.parse_args(RUN)
    s = train_multipod.setup(cfg)
    params, opt_state, after = s["params"], s["opt_state"], []
    with jax.set_mesh(s["mesh"]):
        for step in range(cfg.steps):
            x, y = (train_multipod.global_array(a, s["data_sharding"]) for a in s["batch"](step))
            params, opt_state, _ = train_step(params, opt_state, x, y)
            if step >= cfg.steps - 2:
                after.append({jax.tree_util.keystr(k): np.asarray(v)
                              for k, v in jax.tree_util.tree_leaves_with_path(params)})
    assert train_step._cache_size() == 1
    return after[1], after[0]


@pytest.mark.slow  # ~20 s on 2 CPU cores: the pair of processes (the in-process run is shared)
def test_two_processes_equal_the_single_process_run(short_run, tmp_path):
    """The single-process reference is the module's 20-step run on the same mesh and
    configuration: the learning rates are constant, so its first ``RUN`` steps (losses from its
    ``results.json``, params from its compiled step) are those of a ``RUN`` of its own."""
    import json

    codes = _launch_pair(tmp_path)
    logs = _log(tmp_path, 0) + _log(tmp_path, 1)
    if any(c != 0 for c in codes) and "gloo" in logs.lower() and (
            "not" in logs.lower() or "unavailable" in logs.lower()):
        pytest.skip(f"CPU collectives through gloo are unavailable: {logs[-500:]}")
    assert codes == [0, 0], f"exit codes {codes}\n{logs[-4000:]}"
    # Only process 0 prints the table.
    assert "| step |" in _log(tmp_path, 0) and "| step |" not in _log(tmp_path, 1)

    cfg, _, out, single_out = short_run("2x2x2x1")
    run_cfg = train_multipod.parse_args(RUN)   # the same run but for its length and outputs
    assert dataclasses.replace(cfg, steps=run_cfg.steps, log_every=run_cfg.log_every,
                               out=None) == run_cfg
    dist = dict(np.load(tmp_path / "dist" / "params.npz"))
    single, short = _single_process_params(out["train_step"])
    info = json.loads((tmp_path / "dist" / "results.json").read_text())
    assert info["processes"] == 2 and info["devices"] == 8
    ref = json.loads((single_out / "results.json").read_text())
    assert ref["processes"] == 1

    d_loss = np.array([l for _, l in info["losses"]])
    s_loss = np.array([l for _, l in ref["losses"][:len(d_loss)]])
    assert [s for s, _ in info["losses"]] == [s for s, _ in ref["losses"][:len(d_loss)]]
    assert sorted(dist) == sorted(single) and len(dist) == len(EXPECTED_SPECS)
    err = {k: float(np.max(np.abs(dist[k] - single[k]))) for k in single}
    print(f"max |params difference| {max(err.values()):.2g}, max |loss difference| relative "
          f"{np.max(np.abs(d_loss - s_loss) / s_loss):.2g}")
    assert max(err.values()) < PARAM_TOL, err
    np.testing.assert_allclose(d_loss, s_loss, rtol=LOSS_RTOL)
    assert d_loss[-1] < 0.75 * d_loss[0]  # it trained
    # The tolerance can tell runs apart: one step fewer is far outside it.
    assert max(float(np.max(np.abs(short[k] - single[k]))) for k in single) > 10 * PARAM_TOL

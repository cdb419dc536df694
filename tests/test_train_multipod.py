"""examples/train_multipod.py in a short configuration on 8 simulated CPU devices (2 × 4)."""

from __future__ import annotations

import os
import re
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import train_multipod  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


@pytest.mark.slow
def test_short_run_loss_goes_down():
    out = train_multipod.main(["--steps", "40", "--log-every", "10", "--no-progress"])
    losses = [l for _, l in out["losses"]]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], out["table"]
    assert "| step |" in out["table"]
    # Replicas hold identical weights (one value per array, equal on every device).
    for leaf in jax.tree.leaves(out["params"]):
        shards = {}
        for s in leaf.addressable_shards:
            key = str(s.index)
            if key in shards:
                np.testing.assert_array_equal(np.asarray(s.data), shards[key])
            shards[key] = np.asarray(s.data)


@pytest.mark.slow
def test_dion3_gradients_are_not_all_reduced_over_dcn():
    cfg = train_multipod.parse_args(["--steps", "1", "--fraction", "0.125"])
    s = train_multipod.setup(cfg)
    x, y = (jax.device_put(a, s["data_sharding"]) for a in s["batch"](0))
    with jax.set_mesh(s["mesh"]):
        hlo = s["train_step"].lower(s["params"], s["opt_state"], x, y).compile().as_text()
    dcn = 0
    for line in hlo.splitlines():
        m = re.search(r"= (.*) all-reduce(?:-start)?\(", line)
        if m and re.search(r"replica_groups=.*\{'dcn'\}", line):
            for dims in re.findall(r"[a-z]+[0-9]*\[([0-9,]*)\]", m.group(1)):
                dcn += int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    labels = jax.tree.leaves(s["labels"])
    leaves = jax.tree.leaves(s["params"])
    dion3_elems = sum(p.size for p, l in zip(leaves, labels) if l == "dion3") // cfg.mesh[1]
    other_elems = sum(p.size for p, l in zip(leaves, labels) if l != "dion3")
    # Per device: the AdamW leaves, the loss and the selected momentum rows only (≈ f of the
    # device's Dion3 shard), never the Dion3 gradients themselves.
    assert dcn <= other_elems + 1 + 0.2 * dion3_elems, (dcn, other_elems, dion3_elems)

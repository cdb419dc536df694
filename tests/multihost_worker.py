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
"""One process of the multi-host test (tests/test_multihost.py launches it; not a test itself).

``--num-processes 2 --process-id i --port P``: ``jax.distributed.initialize`` on localhost with
CPU collectives through gloo and 4 CPU devices per process, so the ``("dcn", "fsdp") = (2, 4)``
mesh has "dcn" across the two processes. ``--num-processes 1``: one process with 8 CPU devices
and the same mesh (the single-process reference).

Scenarios (a small MLP regression trained with ``dion3_jax.dion3``: two Dion3 matrices, an AdamW
head and bias; batches from numpy seeds):

``fsdp``
  every matrix sharded over ``("dcn", "fsdp")`` (8 devices), STEPS steps; after step CKPT_STEP
  the params and optimizer state are saved with orbax from every process.
``compressed``
  matrices sharded over "fsdp", replicated over "dcn"; ``MeshOptions(replica_axis="dcn",
  replica_selection="random")`` and the step inside ``jax.shard_map`` over "dcn": each pod
  computes the gradient of its own half of the batch (process r builds only pod r's rows).
  After step CKPT_STEP ``synchronize_momentum`` then save. Alongside, the fully synchronized
  run (plain jit over the whole batch: the mean gradient), and each process's local copy of the
  momentum before the final synchronization.

``--phase train`` runs the scenarios from step 0 and saves the checkpoints; ``--phase resume``
(fresh processes) restores them onto targets built from ``tx.init`` and runs the remaining steps.
Process 0 writes ``<out>/<phase>_<scenario>.npz`` (globally gathered arrays); every process
writes ``<out>/<phase>_<scenario>_local<i>.npz`` (its addressable copy of the momentum).

Exit status 77 with a line starting ``GLOO_UNAVAILABLE`` when this jax build cannot run CPU
collectives through gloo.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

STEPS = 4
CKPT_STEP = 2          # the checkpoint holds the state after this many steps
BATCH, D_IN, HIDDEN, D_OUT = 32, 16, 32, 8
GLOO_UNAVAILABLE = 77


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-processes", type=int, choices=(1, 2), required=True)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--phase", choices=("train", "resume"), default="train")
    p.add_argument("--scenarios", nargs="+", choices=("fsdp", "compressed"),
                   default=["fsdp", "compressed"])
    return p.parse_args(argv)


def start_jax(args):
    """Configures and starts the backend; exits GLOO_UNAVAILABLE if gloo cannot be used."""
    import jax
    if args.num_processes == 1:
        jax.config.update("jax_num_cpu_devices", 8)
        return jax
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_num_cpu_devices", 4)
        jax.distributed.initialize(coordinator_address=f"localhost:{args.port}",
                                   num_processes=2, process_id=args.process_id,
                                   initialization_timeout=120)
        devices = jax.devices()
    except Exception as e:  # noqa: BLE001  (the reason is reported, the test skips on it)
        if "gloo" in str(e).lower() or "collectives" in str(e).lower():
            print(f"GLOO_UNAVAILABLE: {type(e).__name__}: {e}", flush=True)
            sys.exit(GLOO_UNAVAILABLE)
        raise
    assert len(devices) == 8 and jax.process_count() == 2, (devices, jax.process_count())
    return jax


def main(argv=None):
    args = parse_args(argv)
    jax = start_jax(args)
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
    import numpy as np
    import optax
    import orbax.checkpoint as ocp

    import dion3_jax

    t0 = time.perf_counter()
    pid = jax.process_index()

    # Pod r = the devices of process r (dcn across the processes); the same layout (by device
    # id) in the single-process reference.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(2, 4), ("dcn", "fsdp"),
                axis_types=(AxisType.Explicit,) * 2)
    if args.num_processes == 2:
        for r in range(2):
            assert {d.process_index for d in mesh.devices[r]} == {r}, mesh.devices

    polar = dion3_jax.make_orthogonalizer(method="standard", compute_dtype=jnp.float32)

    def specs(shard):
        return {"w_in": P(None, shard), "w_hid": P(shard, None), "head": P(shard, None),
                "bias": P()}

    def init_params(shard):
        rng = np.random.default_rng(0)
        host = {"w_in": rng.standard_normal((D_IN, HIDDEN)) / np.sqrt(D_IN),
                "w_hid": rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN),
                "head": rng.standard_normal((HIDDEN, D_OUT)) / np.sqrt(HIDDEN),
                "bias": 0.1 * rng.standard_normal((HIDDEN,))}
        return {k: global_array(v.astype(np.float32), NamedSharding(mesh, specs(shard)[k]))
                for k, v in host.items()}

    def global_array(host, sharding):
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    def pod_batch(step, pod):
        """Pod ``pod``'s half of the batch of ``step`` (only that pod's process builds it)."""
        r = np.random.default_rng([step, pod])
        x = r.standard_normal((BATCH // 2, D_IN)).astype(np.float32)
        y = np.sin(x[:, :D_OUT] * 2.0 + x[:, D_OUT:].sum(1, keepdims=True) * 0.3)
        return x, y.astype(np.float32)

    def batch(step):
        """The global batch (x, y), sharded over both axes; pod r's rows come from process r."""
        sharding = NamedSharding(mesh, P(("dcn", "fsdp"), None))
        built = {}

        def rows(which, idx):
            pod = idx[0].start // (BATCH // 2) if idx[0].start is not None else 0
            if pod not in built:
                built[pod] = pod_batch(step, pod)
            lo = (idx[0].start or 0) - pod * (BATCH // 2)
            n = (idx[0].stop or BATCH) - (idx[0].start or 0)
            return built[pod][which][lo:lo + n][:, idx[1]]
        return tuple(jax.make_array_from_callback((BATCH, d), sharding,
                                                  lambda idx, w=w: rows(w, idx))
                     for w, d in ((0, D_IN), (1, D_OUT)))

    def loss_fn(params, x, y):
        # FSDP: every weight is gathered (resharded to replicated) where it is used.
        w = {k: jax.sharding.reshard(v, P()) for k, v in params.items()}
        h = jnp.tanh(x @ w["w_in"])
        h = jnp.tanh(h @ w["w_hid"] + w["bias"])
        return jnp.mean(jnp.square(h @ w["head"] - y))

    def make_tx(mesh_options):
        return dion3_jax.dion3(0.05, 0.25, weight_decay=0.01, adam_learning_rate=0.01,
                               orthogonalizer=polar, mesh_options=mesh_options)

    def plain_step(tx):
        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        return jax.jit(step)

    def compressed_step(tx, labels):
        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)   # this pod's gradient
            grads = jax.tree.map(lambda g, l: g if l == "dion3" else jax.lax.pmean(g, "dcn"),
                                 grads, labels)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state,
                    jax.lax.pmean(loss, "dcn"))
        return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("dcn"), P("dcn")),
                                     out_specs=(P(), P(), P()), axis_names={"dcn"},
                                     check_vma=False))

    def flat(tree, prefix):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {prefix + jax.tree_util.keystr(path): leaf for path, leaf in leaves
                if isinstance(leaf, jax.Array)}

    def write(name, **trees):
        arrays = {}
        for prefix, tree in trees.items():
            arrays.update(flat(tree, prefix))
        gathered = multihost_utils.process_allgather(arrays, tiled=True)
        if pid == 0:
            np.savez(os.path.join(args.out, f"{args.phase}_{name}.npz"),
                     **{k: np.asarray(v) for k, v in gathered.items()})

    def write_local(name, tree):
        """This process's own copy of every leaf (its pod's, for leaves replicated over dcn)."""
        out = {}
        for k, x in flat(tree, "").items():
            host = np.zeros(x.shape, x.dtype)
            for s in x.addressable_shards:
                host[s.index] = np.asarray(s.data)
            out[k] = host
        np.savez(os.path.join(args.out, f"{args.phase}_{name}_local{pid}.npz"), **out)

    def ckpt_path(name):
        return os.path.join(os.path.abspath(args.out), f"ckpt_{name}")

    def save(name, params, opt_state):
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(ckpt_path(name), {"params": params, "opt": opt_state})
        ckpt.wait_until_finished()
        ckpt.close()

    def restore(name, params, opt_state):
        """Restores onto the shardings of freshly initialized params and state."""
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                              {"params": params, "opt": opt_state})
        ckpt = ocp.StandardCheckpointer()
        out = ckpt.restore(ckpt_path(name), target)
        ckpt.close()
        same = jax.tree.map(lambda a, b: a.sharding == b.sharding, out, target)
        assert all(jax.tree.leaves(same)), "restored shardings differ from the target"
        return out["params"], out["opt"]

    with jax.default_matmul_precision("highest"), jax.set_mesh(mesh):
        if "fsdp" in args.scenarios:
            tx = make_tx(dion3_jax.MeshOptions())
            step = plain_step(tx)
            params = init_params(("dcn", "fsdp"))
            opt_state = tx.init(params)
            first = CKPT_STEP if args.phase == "resume" else 0
            if args.phase == "resume":
                params, opt_state = restore("fsdp", params, opt_state)
            losses = []
            for i in range(first, STEPS):
                params, opt_state, loss = step(params, opt_state, *batch(i))
                losses.append(loss)
                if args.phase == "train" and i + 1 == CKPT_STEP:
                    save("fsdp", params, opt_state)
            write("fsdp", params=params, opt=opt_state, loss={"loss": jnp.stack(losses)})

        if "compressed" in args.scenarios:
            labels = dion3_jax.default_param_labels(init_params("fsdp"))
            tx = make_tx(dion3_jax.MeshOptions(shard_axis="fsdp", replica_axis="dcn",
                                               replica_selection="random", seed=5))
            comp = compressed_step(tx, labels)
            params = init_params("fsdp")
            opt_state = tx.init(params)
            first = CKPT_STEP if args.phase == "resume" else 0
            if args.phase == "resume":
                params, opt_state = restore("compressed", params, opt_state)
            else:
                sync = plain_step(tx)       # the fully synchronized run (mean gradient)
                s_params, s_state = params, opt_state
            for i in range(first, STEPS):
                x, y = batch(i)
                params, opt_state, _ = comp(params, opt_state, x, y)
                if args.phase == "train":
                    s_params, s_state, _ = sync(s_params, s_state, x, y)
                    if i + 1 == CKPT_STEP:
                        opt_state = dion3_jax.synchronize_momentum(opt_state, "dcn")
                        save("compressed", params, opt_state)
            write_local("compressed_unsynced", opt_state)
            synced = dion3_jax.synchronize_momentum(opt_state, "dcn")
            write("compressed", params=params, opt=synced)
            if args.phase == "train":
                # (compressed sync decays its rows itself: compared with the momentum folded)
                write("synchronized", params=s_params, opt=dion3_jax.fold_momentum_scale(s_state))
    multihost_utils.sync_global_devices("done")
    print(f"process {pid}/{args.num_processes} {args.phase} {args.scenarios}: "
          f"{time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()

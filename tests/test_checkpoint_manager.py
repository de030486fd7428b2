"""The orbax training checkpointer: items, keep-K, restore onto another mesh layout, kill during a save."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.checkpoint.manager import TrainCheckpointer, abstract_like


class Tiny(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.arange(64.0).reshape(8, 8))
        self.b = nnx.Param(jnp.linspace(-1, 1, 8))


def _state(mesh):
    params = nnx.state(Tiny())
    tx = optax.adamw(1e-2)
    opt = tx.init(params)
    _, opt = tx.update(jax.tree.map(jnp.ones_like, params), opt, params)  # non-trivial moments
    state = {"params": params, "opt": opt, "step": jnp.asarray(7, jnp.int32)}
    return jax.device_put(state, NamedSharding(mesh, P()))


def test_save_restore_onto_another_mesh_layout_keep_k(tmp_path):
    mesh_a = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    mesh_b = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    state = _state(mesh_a)
    with TrainCheckpointer(tmp_path / "ck", array_items=("state",), json_items=("data", "config"),
                           save_every=1, keep=2) as ck:
        for step in (1, 2, 3):
            assert ck.save(step, {"state": state}, {"data": {"next": step}, "config": {"lr": 0.1}}, force=True)
        # A donated / overwritten state right after save() must not corrupt the checkpoint.
        with jax.set_mesh(mesh_a):
            state = jax.jit(lambda s: jax.tree.map(jnp.zeros_like, s), donate_argnums=0)(state)
        ck.wait()
        assert ck.all_steps() == [2, 3] and ck.latest_step() == 3
        abstract = jax.eval_shape(lambda: _state(mesh_a))
        spec = lambda x: NamedSharding(mesh_b, P("x", "y") if x.ndim == 2 else P("y"))  # noqa: E731
        params = abstract["params"]
        target = {"params": abstract_like(params, jax.tree.map(spec, params)),
                  "opt": abstract_like(abstract["opt"], NamedSharding(mesh_b, P())),
                  "step": abstract_like(abstract["step"], NamedSharding(mesh_b, P()))}
        restored = ck.restore(None, {"state": target})
    expected = _state(mesh_a)
    assert restored["data"] == {"next": 3} and restored["config"] == {"lr": 0.1}
    got = restored["state"]
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    w = got["params"]["w"].get_value()
    assert w.sharding.mesh.axis_names == ("x", "y") and w.sharding.spec == P("x", "y")
    assert w.addressable_shards[0].data.shape == (4, 2)
    assert got["params"]["b"].get_value().sharding.spec == P("y")


def test_restore_errors_without_checkpoint(tmp_path):
    with TrainCheckpointer(tmp_path / "none", array_items=("state",)) as ck:
        assert ck.latest_step() is None
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            ck.restore(None, {"state": {}})
        with pytest.raises(ValueError, match="items missing"):
            ck.save(1, {})


SAVER = textwrap.dedent("""
    import sys, time
    import jax, jax.numpy as jnp
    from composer_jax.checkpoint.manager import TrainCheckpointer
    ck = TrainCheckpointer(sys.argv[1], array_items=("state",), save_every=1, keep=5)
    ck.save(1, {"state": {"x": jnp.full((256,), 1.0)}}, force=True)
    ck.wait()
    print("saved 1", flush=True)
    big = {f"x{i}": jnp.full((4_000_000,), float(i)) for i in range(24)}   # ~380 MB: a slow save
    ck.save(2, {"state": big}, force=True)
    print("saving 2", flush=True)
    ck.wait()
    print("saved 2", flush=True)
""")


def test_kill_during_save_leaves_previous_checkpoint_restorable(tmp_path):
    directory = tmp_path / "ck"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(directory)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "saved 1"
        deadline = time.time() + 120
        while time.time() < deadline:  # kill once step 2's temporary directory exists
            if any(p.name.startswith("2") and p.name != "2" for p in directory.iterdir()):
                break
            time.sleep(0.01)
        else:
            pytest.fail("step 2's save never started")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    with TrainCheckpointer(directory, array_items=("state",)) as ck:
        assert ck.latest_step() == 1
        target = {"state": {"x": jax.ShapeDtypeStruct((256,), jnp.float32)}}
        np.testing.assert_array_equal(ck.restore(None, target)["state"]["x"], np.ones(256))
        # the partial save is cleaned up: orbax removes it in a background thread once the manager opens
        partial = lambda: any(p.name.startswith("2") for p in directory.iterdir())  # noqa: E731
        deadline = time.time() + 30
        while partial() and time.time() < deadline:
            time.sleep(0.05)
        assert not partial()

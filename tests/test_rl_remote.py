"""The rollout engine in a separate process (rollout.transport=directory, rl/exchange/): weight
snapshots and batch files round-trip exactly, a half-written file is never read; an engine process
(its own JAX runtime and devices) takes the learner's weight versions and its batches train the
learner within the staleness bound, and a resumed learner hands it the checkpoint's sampler state;
bad settings, a silent engine and a silent learner are one-line errors."""

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from composer_jax import cli
from composer_jax.config import ConfigError, MeshConfig
from composer_jax.cpu_devices import without_device_count
from composer_jax.infer.generate import engine_grids
from composer_jax.envs.monitor import Finding, Report
from composer_jax.model import CausalLM
from composer_jax.model_dirs import run_chat
from composer_jax.parallel import DualMesh, shard_model
from composer_jax.rl.batch import RolloutBatch
from composer_jax.rl.exchange import directory, heartbeat
from composer_jax.rl.exchange.directory import ExchangeError
from composer_jax.rl.exchange.engine_end import EngineExchange
from composer_jax.rl.exchange.learner_end import LearnerExchange
from composer_jax.rl.exchange.npz import read_batch, unpack, write_batch
from composer_jax.rl.exchange.transport_files import FileWeightClient, FileWeightServer
from composer_jax.rl.exchange.settings import check_same_settings, engine_settings
from composer_jax.rl.exchange.transport_device import DeviceWeightClient, DeviceWeightServer
from composer_jax.rl.engines import engine_states
from composer_jax.rl.loop import RLTrainer
from composer_jax.rl.rollout import ProducedBatch, engine_sampling
from composer_jax.rl.rollout_log import read_rollouts
from composer_jax.rl.run_config import load_rl_config
from composer_jax.rl.sampler import Prompt, TaskSampler
from composer_jax.train.metrics import read_metrics
from tests.rl_parity import parity_tasks
from tests.test_rl_loop import TINY

REPO = Path(__file__).resolve().parents[1]
REMOTE = ["rollout.transport=directory"]


def _config(run_dir, *overrides):
    return load_rl_config("rl-tiny", [*TINY, f"run_dir={run_dir}", *REMOTE, *overrides])


def test_weight_version_round_trip(tmp_path):
    """The tiny model's parameters on 8 devices (fsdp and ep), some in bfloat16, written as a version by
    the learner's side and read by the engine's into a layout of its own (2 devices) and onto the host
    layout: bit for bit in the structure asked for; old versions are pruned; a parameter the version lacks
    is an error naming it."""
    cfg = _config(tmp_path)
    model = shard_model(CausalLM(cfg.model, rngs=nnx.Rngs(3)), DualMesh(MeshConfig(), model=cfg.model))
    state = nnx.state(model)
    leaves, treedef = jax.tree.flatten(state)
    state = jax.tree.unflatten(treedef, [x.astype(jnp.bfloat16) if i % 3 == 0 else x for i, x in enumerate(leaves)])
    server = FileWeightServer(tmp_path)
    for version in range(5):
        server.offer(state, version)
    server.close()
    client = FileWeightClient(tmp_path, state)
    assert client.versions() == [2, 3, 4] and client.pull(1) is None
    engine = shard_model(CausalLM(cfg.model, rngs=nnx.Rngs(0)), engine_grids(cfg.model, jax.devices()[:2]))
    engine_like = jax.tree.unflatten(treedef, [x.astype(jnp.bfloat16) if i % 3 == 0 else x for i, x in
                                               enumerate(jax.tree.leaves(nnx.state(engine)))])
    for like in (engine_like, jax.tree.map(np.asarray, state)):
        back = FileWeightClient(tmp_path, like).pull(4)
        assert jax.tree.structure(back) == jax.tree.structure(state)
        for want, got, where in zip(jax.tree.leaves(state), jax.tree.leaves(back), jax.tree.leaves(like)):
            assert got.dtype == want.dtype and np.array_equal(np.asarray(got).view(np.uint8),
                                                              np.asarray(want).view(np.uint8))
            assert got.sharding == getattr(where, "sharding", got.sharding)
    partial = FileWeightServer(tmp_path / "part")
    partial.offer({"embed": np.zeros(3)}, 1)
    with pytest.raises(ExchangeError, match=r"no parameter '\w+"):
        FileWeightClient(tmp_path / "part", state).pull(1)


def _produced() -> ProducedBatch:
    rng = np.random.default_rng(0)
    b, s, k, t = 4, 10, 1, 6
    batch = RolloutBatch(tokens=rng.integers(0, 256, (b, s), np.int32),
                         positions=np.tile(np.arange(s, dtype=np.int32), (b, 1)), segment_ids=np.ones((b, s), np.int32),
                         generated=rng.random((b, s)) < 0.5, behaviour_logprobs=-rng.random((b, s), np.float32),
                         rewards=rng.random(b, np.float32), group_ids=np.array([0, 0, 1, 1], np.int32),
                         teacher_tokens=rng.integers(0, 256, (b, k, t), np.int32),
                         teacher_map=np.full((b, k, t), -1, np.int32))
    sampler = TaskSampler(["a", "b", "c"])
    prompts = sampler.draw(2)
    report = Report((Finding("test_files", 0, "edit", "tests/test_a.py"), Finding("no_action", 1, "", "")))
    return ProducedBatch(5, batch, [p.draw for p in prompts], prompts[:1], [prompts[0].draw], np.array([[3, 4, -1, -1], [4, 4, -1, -1]]),
                         {"reward_mean": 0.1 + 0.2, "rollouts": 4.0}, [("0/0", report), ("0/1", Report())],
                         sampler.state_dict(), {"counts": {"trainable": 1, "dropped_equal": 0}}, (1.5e9, 1.5e9 + 0.25),
                         [json.dumps({"pick": "best", "episode": "0/1", "reward": 0.5, "text": "a\u00e9",
                                     "tokens": [97, 195, 169], "monitor": report.to_json()})])


def test_batch_file_round_trips_every_field(tmp_path):
    produced = _produced()
    write_batch(tmp_path / "b.npz", produced)
    back = read_batch(tmp_path / "b.npz")
    for name in ProducedBatch.__dataclass_fields__:
        want, got = getattr(produced, name), getattr(back, name)
        if name == "batch":
            for field in RolloutBatch._fields:
                a, b = getattr(want, field), getattr(got, field)
                assert (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b)), field
        elif isinstance(want, np.ndarray):
            assert got.dtype == want.dtype and np.array_equal(got, want), name
        else:
            assert got == want, name
    assert isinstance(back.trained[0], Prompt) and back.reports[0][1].flagged


def test_a_half_written_file_is_never_read(tmp_path, monkeypatch):
    """A writer that dies before its rename leaves only a hidden temporary file: the learner keeps
    waiting (then times out) instead of reading it; the completed write is read, and removed at the next
    publish."""
    learner = LearnerExchange(tmp_path, start_index=5, engine_states=[{}], timeout_s=0.5)
    learner.start()
    target = learner.dir / "batches" / "00000005.npz"

    def crash(*args):
        raise OSError("killed before the rename")

    with monkeypatch.context() as patched:
        patched.setattr(directory.os, "replace", crash)
        with pytest.raises(OSError, match="killed"):
            write_batch(target, _produced())
    assert not target.exists() and len(list(target.parent.iterdir())) == 1      # the temporary file only
    with pytest.raises(ExchangeError, match="no batch 5 from the rollout engine"):
        learner.next_batch()
    write_batch(target, _produced())
    assert learner.next_batch().index == 5 and target.exists()   # until the next publish: every process has read it
    learner.publish({"w": np.zeros(2, np.float32)}, 6)
    assert not target.exists()


def test_a_new_session_replaces_the_previous_and_reports_a_failed_engine(tmp_path):
    """A restarted learner removes the previous session only (the directory may hold other files) and
    the engine side sees that session end; an engine's failure line reaches the learner at once."""
    (tmp_path / "other").mkdir()
    first = LearnerExchange(tmp_path, start_index=0, engine_states=[{}], timeout_s=60)
    first.start()
    engine = EngineExchange(tmp_path, EngineExchange.wait_session(tmp_path, 1), like={}, timeout_s=60)
    assert engine.session["session"] == first.session["session"] and not engine.ended()
    second = LearnerExchange(tmp_path, start_index=3, engine_states=[{}], timeout_s=60)
    second.start()
    assert engine.ended() and not first.dir.exists() and (tmp_path / "other").is_dir()
    assert EngineExchange.wait_session(tmp_path, 1, after=first.session["session"])["start"] == 3
    EngineExchange(tmp_path, second.session, like={}, timeout_s=60).fail("RuntimeError: the engine broke")
    with pytest.raises(ExchangeError, match="^the rollout engine failed: RuntimeError: the engine broke$"):
        second.next_batch()


def test_a_killed_engine_is_noticed_by_its_heartbeat(tmp_path, monkeypatch):
    """A heartbeat left by an engine from before (never seen changing) proves nothing: the learner waits
    the whole batch timeout. One seen beating that then stands still (the engine killed) stops the
    learner within the grace period, naming the engine's process, long before the timeout."""
    monkeypatch.setattr(heartbeat, "HEARTBEAT_GRACE_S", 0.5)
    (tmp_path / heartbeat.HEARTBEAT_FILE).write_text('{"beat": 7, "host": "old", "pid": 1}')
    learner = LearnerExchange(tmp_path, start_index=0, engine_states=[{}], timeout_s=2)
    learner.start()
    with pytest.raises(ExchangeError, match="^no batch 0 from the rollout engine"):
        learner.next_batch()

    learner = LearnerExchange(tmp_path, start_index=0, engine_states=[{}], timeout_s=60)
    learner.start()
    with heartbeat.Heartbeat(tmp_path, every=0.05):
        time.sleep(0.3)
        with pytest.raises(ExchangeError, match="no batch 0"):     # alive and beating: only the timeout ends this
            learner.timeout_s = 1
            learner.next_batch()
    learner.timeout_s = 60
    began = time.monotonic()
    with pytest.raises(ExchangeError, match=rf"^the rollout engine \(pid {os.getpid()} on .+\) stopped: its heartbeat"):
        learner.next_batch()
    assert time.monotonic() - began < 5


def test_the_engine_refuses_a_config_other_than_the_learners(tmp_path):
    """Host-local settings may differ (paths, devices, timeouts); a setting the batches depend on may not."""
    learner = engine_settings(_config(tmp_path / "a"))
    same = _config(tmp_path / "b", "cpu_devices=2", f"rollout.exchange_dir={tmp_path}", "rollout.engine_timeout_s=5")
    check_same_settings(learner, engine_settings(same))
    with pytest.raises(ExchangeError, match=r"differs from the learner's at 'rl.max_staleness' \(2, the learner's 1\)"):
        check_same_settings(learner, engine_settings(_config(tmp_path / "a", "rl.max_staleness=2")))
    with pytest.raises(ExchangeError, match=r"at 'rl.log_rollouts_every' \(0, the learner's 10\)"):   # the engine picks them
        check_same_settings(learner, engine_settings(_config(tmp_path / "a", "rl.log_rollouts_every=0")))


def _engine_env(devices: int) -> dict:
    flags = f"{without_device_count(os.environ.get('XLA_FLAGS', ''))} --xla_force_host_platform_device_count={devices}"
    return {**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": flags.strip()}


def _engine(overrides: list[str], devices: int = 2) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.rl_engine_process", *overrides, f"cpu_devices={devices}"],
                            env=_engine_env(devices), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_engine_process_trains_the_learner_within_the_staleness_bound(tmp_path, monkeypatch):
    """One engine process (2 devices) against the learner here (8 devices), rl.max_staleness=1: 3 steps,
    then the learner dies without its stop marker (as under SIGKILL) and the same run is resumed to 5.
    The engine loads several weight versions and follows the new learner session, starting it from
    the checkpoint's weights (version 3) and sampler state, so the prompts drawn over the whole run are
    each drawn once, in sequence; every step trains its batch (none refused as stale, rows trained),
    the recorded staleness stays within 1 and the engine does run ahead."""
    run_dir = tmp_path / "run"
    overrides = [*TINY, f"run_dir={run_dir}", *REMOTE, "rl.max_staleness=1", "rollout.engine_timeout_s=300",
                 "rl.log_rollouts_every=2"]
    engine = _engine([*overrides, "rl.steps=5"])
    try:
        with monkeypatch.context() as killed:
            killed.setattr(LearnerExchange, "stop", lambda self: None)
            first = RLTrainer(load_rl_config("rl-tiny", [*overrides, "rl.steps=3"]), parity_tasks()).run()
        second = RLTrainer(load_rl_config("rl-tiny", [*overrides, "rl.steps=5"]), parity_tasks()).run()
        out, err = engine.communicate(timeout=120)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.communicate()
    assert engine.returncode == 0, err[-3000:]
    served = json.loads(out.strip().splitlines()[-1])
    assert first["end_step"] == 3 and (second["start_step"], second["end_step"]) == (3, 5)
    assert served["sessions"] == 2 and len(set(served["versions"][0])) >= 2 and served["versions"][1][0] == 3, served

    records = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        assert r["dropped_stale_batches"] == 0
        assert 0 <= (r["step"] - 1) - r["batch_version_min"] == r["staleness_max"] <= 1
    assert max(r["staleness_max"] for r in records) == 1, "the engine never ran ahead of the learner"
    assert sum(len(r["trained_draws"]) for r in records) > 0 and all(np.isfinite(r["loss"]) for r in records)
    draws = [d for r in records for d in r["batch_draws"]]
    assert draws == list(range(len(draws))), draws
    lines = read_rollouts(run_dir)      # the engine's picks, carried in its batch files
    assert [(r["step"], r["pick"]) for r in lines] == [(s, p) for s in (2, 4) for p in ("best", "worst", "random")]
    tokenizer = run_chat(run_dir).load_tokenizer()
    assert all(tokenizer.decode(r["tokens"]) == r["text"] for r in lines)


@pytest.mark.slow
def test_two_engine_processes_take_turns_each_on_its_share_of_the_tasks(tmp_path, monkeypatch):
    """rollout.engines=2: two engine processes (2 devices each) against the learner here (8 devices),
    rl.max_staleness=1: 4 steps, then the learner dies without its stop marker and the run resumes to 6.
    Batch i comes from engine i % 2, which draws only from its half of the tasks; each engine's draws run
    in sequence over the whole run (the checkpoint resumed each from its own sampler state); staleness
    stays within the bound and both engines load several weight versions and follow the new session."""
    run_dir = tmp_path / "run"
    overrides = [*TINY, f"run_dir={run_dir}", *REMOTE, "rl.max_staleness=1", "rollout.engine_timeout_s=300",
                 "rollout.engines=2"]
    engines = [_engine(["--engine", str(k), *overrides, "rl.steps=6"]) for k in range(2)]
    try:
        with monkeypatch.context() as killed:
            killed.setattr(LearnerExchange, "stop", lambda self: None)
            first = RLTrainer(load_rl_config("rl-tiny", [*overrides, "rl.steps=4"]), parity_tasks()).run()
        second = RLTrainer(load_rl_config("rl-tiny", [*overrides, "rl.steps=6"]), parity_tasks()).run()
        outs = [engine.communicate(timeout=120) for engine in engines]
    finally:
        for engine in engines:
            if engine.poll() is None:
                engine.kill()
                engine.communicate()
    for engine, (_, err) in zip(engines, outs):
        assert engine.returncode == 0, err[-3000:]
    assert (first["end_step"], second["start_step"], second["end_step"]) == (4, 4, 6)
    for out, _ in outs:
        served = json.loads(out.strip().splitlines()[-1])
        assert served["sessions"] == 2 and all(len(set(v)) >= 2 for v in served["versions"]), served

    ids = list(parity_tasks().train)
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    draws = {0: [], 1: []}
    for r in records:
        engine = (r["step"] - 1) % 2            # no batch dropped: batch i trains at step i + 1
        assert r["dropped_stale_batches"] == 0 and 0 <= r["staleness_max"] <= 1, r
        assert set(r["trained_tasks"]) <= set(ids[engine::2]), (r["step"], r["trained_tasks"])
        draws[engine] += r["batch_draws"]
    assert all(d == list(range(len(d))) for d in draws.values()), draws


def test_each_engine_samples_its_share_and_a_checkpoint_resumes_only_its_engine_count(tmp_path):
    """Engine k of n samples tasks k, k + n, ... with its own random stream; a share left empty, or a
    checkpoint of another engine count, is one ConfigError naming rollout.engines."""
    cfg = _config(tmp_path, *REMOTE, "rollout.engines=3")
    ids = [f"t{i}" for i in range(7)]
    shares = [sorted(engine_sampling(cfg, ids, k)[0].stats) for k in range(3)]
    assert shares == [["t0", "t3", "t6"], ["t1", "t4"], ["t2", "t5"]]
    assert engine_sampling(cfg, ids, 1)[0].cfg.seed == cfg.sampler.seed + 1
    with pytest.raises(ConfigError, match="rollout.engines.*3 engines for 2 training tasks: engine 2 has none"):
        engine_sampling(cfg, ids[:2], 2)
    one = {"sampler": {"draws": 4}, "groups": {}}
    assert engine_states(one, 1) == [one] and engine_states({"engines": [one, one]}, 2) == [one, one]
    with pytest.raises(ConfigError, match=r"rollout.engines.*holds the task sampling of 1 engine\(s\), not 2: resume "
                                          r"with rollout.engines=1"):
        engine_states(one, 2)


@pytest.mark.parametrize("command, overrides, key", [
    ("rl", ["rollout.exchange_dir={tmp}/missing"], "rollout.exchange_dir"),
    ("rl-engine", ["rollout.exchange_dir={tmp}/missing"], "rollout.exchange_dir"),
    ("rl", ["run_dir={tmp}/a_file/run"], "rollout.exchange_dir"),         # the default RUN_DIR/exchange: unwritable
    ("rl", ["rollout.devices=2"], "rollout.devices"),
    ("rl", ["rollout.transport=thread", "rollout.weight_transfer=device"], "rollout.weight_transfer"),
    ("rl", ["rollout.engines=2", "rollout.transport=thread"], "rollout.engines"),
    ("rl-engine", ["rollout.engines=2", "--engine", "2"], "rollout.engines"),
    ("rl", ["rollout.engines=2", "rollout.weights=[int4]"], "rollout.weights"),
    ("rl-engine", ["rollout.weights=[int4, int8]"], "rollout.weights[1]"),
])
def test_bad_remote_settings_are_one_line_naming_the_key(tmp_path, capsys, command, overrides, key):
    (tmp_path / "a_file").write_text("")
    status = cli.main([command, *TINY, f"run_dir={tmp_path / 'run'}", *REMOTE,
                       *[o.format(tmp=tmp_path) for o in overrides]])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1 and key in err, err
    assert not (tmp_path / "run").exists()


def test_learner_without_an_engine_stops_with_one_line(tmp_path, capsys):
    status = cli.main(["rl", *TINY, f"run_dir={tmp_path / 'run'}", *REMOTE, "rollout.engine_timeout_s=2"])
    err = capsys.readouterr().err.strip()
    assert status == 1 and len(err.splitlines()) == 1, err
    assert "no batch 0 from the rollout engine (composer-jax rl-engine) in 2 s" in err


def test_engine_without_a_learner_stops_with_one_line(tmp_path, capsys):
    status = cli.main(["rl-engine", *TINY, f"run_dir={tmp_path / 'run'}", *REMOTE, "rollout.engine_timeout_s=2"])
    err = capsys.readouterr().err.strip()
    assert status == 1 and len(err.splitlines()) == 1, err
    assert "no learner session" in err and "composer-jax rl" in err


def test_weights_pulled_device_to_device_into_the_engines_layout(tmp_path):
    """rollout.weight_transfer=device: the learner here (8 devices, its own layout) offers versions 0..3;
    an engine process on 2 devices pulls version 0, then, asked for >= 1 once 1..3 are offered, the newest
    (3): both arrive bit for bit in the engine's own shardings (checked there). A version the engine
    skipped is never scheduled (the learner's server holds no unpulled copy), the learner holds the newest
    2 versions only, and the pull requests are gone."""
    cfg = _config(tmp_path, "rollout.weight_transfer=device")
    model = CausalLM(cfg.model, rngs=nnx.Rngs(2))
    shard_model(model, DualMesh(MeshConfig(), jax.devices(), model=cfg.model))
    state = nnx.state(model)
    versions = {v: jax.tree.map(lambda x, v=v: x + v if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
                for v in range(4)}
    learner = LearnerExchange(tmp_path / "x", start_index=0, engine_states=[{}], timeout_s=60,
                              weight_transfer="device")
    learner.start()
    out = tmp_path / "pulled"
    out.mkdir()
    engine = subprocess.Popen([sys.executable, "-m", "tests.weight_pull_process", str(tmp_path / "x"), str(out),
                               *TINY, f"run_dir={tmp_path}"], env=_engine_env(2), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        learner.publish(versions[0], 0)             # waits for the engine's layout
        deadline = time.monotonic() + 60
        while not (out / "0.npz").exists() and engine.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        for v in (1, 2, 3):
            learner.publish(versions[v], v)
        (out / "go").write_text("")
        stdout, err = engine.communicate(timeout=60)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.communicate()
        learner.stop()
    assert engine.returncode == 0, err[-3000:]
    assert stdout.strip() == "[0, 3]"
    for v in (0, 3):
        pulled, meta = unpack(out / f"{v}.npz")
        assert meta["version"] == v
        for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(versions[v])[0], pulled):
            assert np.array_equal(np.asarray(want).view(np.uint8), np.asarray(got).view(np.uint8)), path
    assert sorted(learner.weights._held) == [2, 3] and next(learner.weights._ids) == 3    # 2 pulls scheduled
    assert not list((learner.dir / "pulls" / "0").iterdir())
    named = json.loads((learner.dir / "engines" / "0.json").read_text())["params"]
    assert len(named) == len(jax.tree.leaves(state))


def test_an_engine_assembles_its_own_layout_from_the_learners_pieces(tmp_path):
    """The learner's blocks and the engine's need not match: the engine (all 8 devices, a 4 x 2 grid) builds
    each of its blocks from the learner's pieces, bit for bit in its own shardings, where a learner block
    holds several engine blocks ('w': rows over 2 devices), where an engine block is made of parts of 8
    learner blocks ('v': rows over 8, the engine splitting columns) or of 2 whole ones side by side ('u':
    rows over 8, the engine's over 4), and where the engine replicates ('b', bfloat16, replicated on the
    learner's 2 devices: one piece sent). Engine parameters the learner lacks
    or has in another shape are one-line errors on both sides."""
    mesh2, mesh8 = Mesh(np.array(jax.devices()[:2]), ("a",)), Mesh(np.array(jax.devices()), ("a",))
    engine_mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    rows = np.arange(64, dtype=np.float32).reshape(16, 4)
    values = {"w": rows, "v": rows + 1, "u": rows + 2, "b": np.arange(8, dtype=np.float32).astype(jnp.bfloat16)}
    state = {"w": jax.device_put(values["w"], NamedSharding(mesh2, PartitionSpec("a"))),
             "v": jax.device_put(values["v"], NamedSharding(mesh8, PartitionSpec("a"))),
             "u": jax.device_put(values["u"], NamedSharding(mesh8, PartitionSpec("a"))),
             "b": jax.device_put(values["b"], NamedSharding(mesh2, PartitionSpec()))}
    specs = {"w": PartitionSpec("x", "y"), "v": PartitionSpec(None, "y"), "u": PartitionSpec("x"), "b": PartitionSpec()}
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(engine_mesh, specs[k]))
            for k, v in values.items()}
    client = DeviceWeightClient(tmp_path, like, alive=lambda: True, timeout_s=30)
    server = DeviceWeightServer(tmp_path)
    try:
        server.offer(state, 0)
        pulled = client.pull(0)
        for name, want in values.items():
            assert pulled[name].sharding == like[name].sharding, name
            assert np.array_equal(np.asarray(pulled[name]).view(np.uint8), np.asarray(want).view(np.uint8)), name
        wrong = {**like, "w": jax.ShapeDtypeStruct((16, 2), jnp.float32, sharding=like["w"].sharding)}
        client = DeviceWeightClient(tmp_path, wrong, alive=lambda: True, timeout_s=30, engine=1)
        with pytest.raises(ExchangeError, match=r"^parameter 'w' is float32\[16, 4\] in the learner, "
                                                r"float32\[16, 2\] in engine 1$"):
            client.pull(0)
        with pytest.raises(ExchangeError, match="parameter 'w' is float32"):
            server.offer(state, 1)          # the serving thread's failure, at the learner's next offer
    finally:
        server.close()


def test_a_pulled_version_survives_the_learners_next_steps(tmp_path, monkeypatch):
    """The engine asked for version 0 and the learner scheduled it; before the pull runs, the learner's
    next step donates its parameters and it offers versions 1 and 2, so 0 leaves the versions it holds:
    the pull still gets version 0 bit for bit, a replicated parameter too (jax reuses a replicated array's
    shards on a subset of its devices even with may_alias=False: the copy must be real). Afterwards the
    learner holds its newest 2, and version 0 is gone. (Learner and engine in this process, with different
    layouts: 2 x 4 devices against the first 2.)"""
    engine_mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    learner_mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    values = {"w": np.arange(32, dtype=np.float32).reshape(8, 4), "b": np.arange(4, dtype=np.float32)}
    like = {"w": jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(engine_mesh, PartitionSpec("x"))),
            "b": jax.device_put(np.zeros(4, np.float32), NamedSharding(engine_mesh, PartitionSpec()))}
    learner_step = jax.jit(lambda state: jax.tree.map(lambda x: x + 1, state), donate_argnums=0)
    state = {"w": jax.device_put(values["w"], NamedSharding(learner_mesh, PartitionSpec("b", "a"))),
             "b": jax.device_put(values["b"], NamedSharding(learner_mesh, PartitionSpec()))}

    (tmp_path / "weights").mkdir()
    client = DeviceWeightClient(tmp_path, like, alive=lambda: True, timeout_s=30)
    server = DeviceWeightServer(tmp_path)
    try:
        with jax.set_mesh(learner_mesh):          # as in the RL loop (`with dual:`): eager ops meet the context mesh
            server.offer(state, 0)
        pull_now = client._within_timeout

        def after_two_steps(fn, what):
            nonlocal state
            for version in (1, 2):
                state = learner_step(state)
                with jax.set_mesh(learner_mesh):
                    server.offer(state, version)
            gc.collect()
            return pull_now(fn, what)

        monkeypatch.setattr(client, "_within_timeout", after_two_steps)
        pulled = client.pull(0)
        for name, want in values.items():
            assert pulled[name].sharding == like[name].sharding and np.array_equal(np.asarray(pulled[name]), want), name
        assert sorted(server._held) == [1, 2]
        assert client.pull(0) is None and client.versions() == [1, 2]     # gone: the engine asks for the newest
        monkeypatch.undo()
        assert np.array_equal(np.asarray(client.pull(2)["b"]), values["b"] + 2)
    finally:
        server.close()


@pytest.mark.slow
def test_weight_transfer_benchmark_runs_both_ways(tmp_path):
    """tools/bench_weight_transfer.py at a tiny size: the device transport from one learner process (the
    anchor), and both transports from a learner of 2 processes, deliver every version (the engine process
    checks each), and the JSON has the side-by-side timings."""
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(REPO / "tools" / "bench_weight_transfer.py"), "--mb", "2",
                           "--versions", "3", "--processes", "2", "--json", str(out)], env=_engine_env(8), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "against the single-process device transport" in done.stdout
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"device, 1 process", "device, 2 processes", "file, 2 processes"}
    for row in rows.values():
        assert row["publish_s"] > 0 and row["delivered_s"] >= row["publish_s"]
    assert rows["file, 2 processes"]["bytes_per_process"] == rows["device, 2 processes"]["bytes_per_process"] == 2**20


def test_a_multi_task_engine_launch_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """`rl-engine` runs as one process: an srun step of several tasks (or COMPOSER_JAX_NUM_PROCESSES > 1) is
    refused, naming the variable, before any run directory is made; a batch script's SLURM_NTASKS (no
    step) is the whole job's and does not count (the config's own error comes instead)."""
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    status = cli.main(["rl-engine", *TINY, f"run_dir={tmp_path / 'run'}", *REMOTE])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1 and "SLURM_NTASKS (an srun step) is 4" in err, err
    assert not (tmp_path / "run").exists()
    monkeypatch.delenv("SLURM_STEP_ID")
    status = cli.main(["rl-engine", *TINY, f"run_dir={tmp_path / 'run'}", *REMOTE, "rollout.batch_size=10"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "rollout.batch_size" in err, err


@pytest.mark.parametrize("overrides, message", [
    (["rollout.transport=thread"], "config key 'rollout.transport': a learner of 2 processes trains on the batches of "
                                   "`composer-jax rl-engine`"),
    ([*REMOTE, "eval.every=5"], "config key 'eval.every': the held-out evaluation runs an engine inside the learner"),
    ([*REMOTE, "eval.every=0", "rollout.batch_size=4"], "config key 'rollout.batch_size': 4 trajectories do not split into "
                                                        "whole groups of rl.group_size=4 over 2 processes"),
    ([*REMOTE, "eval.every=0", "env.kind=coding", "env.repo={tmp}"], "config key 'env.tasks_dir': 2 learner processes would each make the coding "
                                                   "tasks"),
])
def test_a_learner_group_refuses_what_it_cannot_run_in_one_line(tmp_path, capsys, monkeypatch, overrides, message):
    """`composer-jax rl` as one task of an srun step of 2: a setting a learner of several processes cannot
    run with is one line naming the key, before the group forms (no process waits for a peer)."""
    for key, value in {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_STEP_ID": "0",
                       "SLURM_STEP_NODELIST": "localhost"}.items():
        monkeypatch.setenv(key, value)
    status = cli.main(["rl", *TINY, f"run_dir={tmp_path / 'run'}", *[o.format(tmp=tmp_path) for o in overrides],
                       "--init-timeout", "1"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()

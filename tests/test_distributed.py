"""Process groups (parallel/distributed.py): where a group comes from (SLURM, Kubernetes, flags), two
local processes x 4 CPU devices (gloo collectives) against one process with 8 devices, checkpoints
across process counts, and a dead or failed peer ending the others with one line, not a hang."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from composer_jax.cpu_devices import without_device_count
from composer_jax.parallel.distributed import (EXIT_PEER_LOST, DistributedError, ProcessGroup, find_group,
                                               first_slurm_host)
from tests.multiprocess_steps import restore_params, run_steps
from tests.rl_parity import parity_tasks
from tests.test_rl_loop import TINY
from tests.test_train import write_code_tree

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 900   # a bound, not an expectation: compiling on 2 busy cores is slow


@pytest.mark.parametrize("nodelist, first", [
    ("node001", "node001"), ("node001,host2", "node001"), ("node[001-015],host2", "node001"),
    ("gpu[007,009-012]-ib,cpu1", "gpu007-ib"), ("a[3]", "a3"), (" x-1 ", "x-1")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_group_from_slurm():
    env = {"SLURM_JOB_ID": "4097", "SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_JOB_NODELIST": "n[10-13]",
           "SLURM_STEP_NODELIST": "n[11-13,20]"}
    assert find_group(env) == ProcessGroup("n11:61441", 4, 2, "SLURM")   # step nodes first; port 61440 + 4097 % 4096
    assert find_group(env, coordinator_port=999) == ProcessGroup("n11:999", 4, 2, "SLURM")
    assert find_group(env, coordinator="head:1") == ProcessGroup("head:1", 4, 2, "SLURM")
    assert find_group({**env, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None   # one task: no group


def test_group_from_kubernetes_jobset():
    env = {"JOB_COMPLETION_INDEX": "3", "COMPOSER_JAX_NUM_PROCESSES": "8", "JOBSET_NAME": "train",
           "REPLICATED_JOB_NAME": "workers"}
    assert find_group(env) == ProcessGroup("train-workers-0-0.train:12355", 8, 3, "Kubernetes")
    plain = {"JOB_COMPLETION_INDEX": "0", "COMPOSER_JAX_NUM_PROCESSES": "2", "COMPOSER_JAX_COORDINATOR": "svc-0.svc:7"}
    assert find_group(plain) == ProcessGroup("svc-0.svc:7", 2, 0, "Kubernetes")


def test_group_from_flags_and_single_process():
    assert find_group({}) is None
    assert find_group({}, coordinator="h:5", num_processes=2, process_id=1) == ProcessGroup("h:5", 2, 1, "flags")
    assert find_group({}, coordinator="h", num_processes=2, process_id=0).coordinator == "h:12355"
    assert find_group({}, coordinator="[::1]:9", num_processes=2, process_id=0).coordinator == "[::1]:9"


@pytest.mark.parametrize("env, flags, message", [
    ({"JOB_COMPLETION_INDEX": "1"}, {}, "needs the process count: set COMPOSER_JAX_NUM_PROCESSES"),
    ({"JOB_COMPLETION_INDEX": "1", "COMPOSER_JAX_NUM_PROCESSES": "2"}, {}, "no coordinator: pass --coordinator"),
    ({}, {"coordinator": "h:1", "num_processes": 2}, "no process id: pass --process-id"),
    ({}, {"coordinator": "h:1", "num_processes": 2, "process_id": 2}, "--process-id must be in [0, 2), got 2"),
    ({}, {"coordinator": "h:1:x", "num_processes": 2, "process_id": 0}, "--coordinator must be HOST:PORT"),
    ({}, {"coordinator": "h:1"}, "without --num-processes > 1"),
    ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "two"}, {}, "SLURM_NTASKS must be an integer, got 'two'"),
])
def test_group_errors_name_the_culprit(env, flags, message):
    with pytest.raises(DistributedError) as e:
        find_group(env, **flags)
    assert message in str(e.value) and "\n" not in str(e.value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PJRT_NPROC", "NPROC"))}
    # Each process sets its own device count; the suite's compile settings (tests/conftest.py) carry over.
    return {**env, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": without_device_count(os.environ.get("XLA_FLAGS", ""))}


def _launch(argv_of, n: int = 2) -> list[subprocess.Popen]:
    """Start `n` processes: argv_of(process_id) -> argv; stdout and stderr captured."""
    return [subprocess.Popen(argv_of(i), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for i in range(n)]


def _stacks_then_kill(procs) -> str:
    """Kill `procs`, first asking each for its threads' Python stacks (SIGUSR1: tests/rl_engine_process.py
    registers faulthandler on it; other processes just end); the tails of their stderr."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)
    time.sleep(2)
    tails = []
    for k, p in enumerate(procs):
        p.kill()
        tails.append(f"--- process {k} stderr:\n{(p.communicate()[1] or '')[-4000:]}")
    return "\n".join(tails)


def _finish(procs, timeout: float) -> list[tuple[int, str]]:
    """(exit status, stderr without gloo's connection chatter) of each process (its stdout: `stdout_text`);
    all are ended by the deadline (one still running then fails the test with every process's stderr)."""
    deadline, results = time.monotonic() + timeout, []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"process {procs.index(p)} did not end within {timeout} s\n{_stacks_then_kill(procs)}")
        p.stdout_text = "\n".join(line for line in (out or "").splitlines() if "[Gloo]" not in line)
        results.append((p.returncode, "\n".join(line for line in err.splitlines() if "[Gloo]" not in line)))
    return results


def _worst_relative(ours: dict, ref: dict, prefix: str) -> tuple[float, str]:
    keys = [k for k in ref if k.startswith(prefix)]
    assert keys and all(k in ours for k in keys), prefix
    def relative(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))

    return max((relative(ours[k], ref[k]), k) for k in keys)


@pytest.mark.slow
def test_two_processes_match_one_and_share_checkpoints(tmp_path):
    """2 processes x 4 devices (replica=2 across them, fsdp=4 within; ep=8 across both with the
    all-to-all dispatch) take a pretraining step and an RL step equal to 1 process x 8 devices; the
    checkpoint each saved restores in the other process count, value for value."""
    single = run_steps(tmp_path, None)      # here: 8 fake devices (tests/conftest.py); saves ckpt_1proc
    port = _free_port()
    procs = _launch(lambda i: [sys.executable, "-m", "tests.multiprocess_steps", str(i), "2", str(port),
                               str(tmp_path)])
    for i, (status, err) in enumerate(_finish(procs, LAUNCH_TIMEOUT_S)):
        assert status == 0, f"process {i}:\n{err[-3000:]}"
    group = dict(np.load(tmp_path / "results_2proc.npz"))
    for name in ("pretrain/metrics", "pretrain/mu", "rl/metrics", "rl/mu", "saved"):
        rel, key = _worst_relative(group, single, name)
        print(f"{name}: worst relative difference {rel:.1e} ({key})")
        assert rel <= 1e-5, (key, rel)
    # Saved by 1 process, restored by 2; saved by 2, restored by 1: the very same values.
    restored_by_one = restore_params(tmp_path, tmp_path / "ckpt_2proc")
    for key, value in restored_by_one.items():
        saved = key.replace("restored/", "saved/", 1)
        np.testing.assert_array_equal(group[key], single[saved], err_msg=key)
        np.testing.assert_array_equal(value, group[saved], err_msg=key)


def _pretrain_argv(tmp_path: Path, port: int, peer_timeout: float, extra=()):
    overrides = ["model.vocab_size=256", "data.tokenizer=byte", "train.steps=100000", "train.batch_size=8",
                 "train.seq_len=32", "train.log_every=1",
                 "train.progress=false", "data.eval_fraction=0", "checkpoint.every=100000", "mesh.replica=2",
                 "mesh.fsdp=4", "train.cpu_devices=4", "model.num_layers=2", "model.mtp.num_layers=0",
                 f"data.path={write_code_tree(tmp_path / 'code')}", f"run_dir={tmp_path / 'run'}", *extra]
    return lambda i: [sys.executable, "-m", "composer_jax.cli", "pretrain", *overrides, "--coordinator",
                      f"localhost:{port}", "--num-processes", "2", "--process-id", str(i), "--peer-timeout",
                      str(peer_timeout)]


def _logged_steps(metrics: Path) -> list[int]:
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return [json.loads(line)["step"] for line in lines[:-1]]  # the last line may still be being written


def _await_steps(procs, metrics: Path, last_step: int) -> None:
    """Wait until the group has logged `last_step` (or fail if a process ended first)."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not any(s >= last_step for s in _logged_steps(metrics)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            pytest.fail(f"the group never logged step {last_step}:\n" + procs[0].communicate()[1][-3000:])
        time.sleep(0.5)


@pytest.mark.slow
def test_group_stops_together_resumes_and_outlives_a_dead_peer(tmp_path):
    """`composer-jax pretrain` as 2 processes. SIGTERM to process 1 alone stops both after the same step,
    with one checkpoint of it, exit status 143 each; relaunched, the group resumes from it; then process 1
    is killed (SIGKILL) and process 0, in the step's collectives (which may hang or fail), exits with one
    line naming process 1 within the peer timeout (JAX's own heartbeat would abort later, with a C++
    stack trace). Only process 0 wrote the run's config and metrics, each step once."""
    peer_timeout, run = 12, tmp_path / "run"   # beats every 2 s; the wait after the kill is idle time
    metrics = run / "metrics.jsonl"
    procs = _launch(_pretrain_argv(tmp_path, _free_port(), peer_timeout))
    _await_steps(procs, metrics, 2)
    procs[1].send_signal(signal.SIGTERM)
    (status0, err0), (status1, err1) = _finish(procs, LAUNCH_TIMEOUT_S)
    assert status0 == status1 == 143, (err0[-2000:], err1[-2000:])
    last = err0.strip().splitlines()[-1]
    stopped = re.match(r"pretrain: interrupted by a signal to another process at step (\d+); checkpoint (\S+) saved", last)
    assert stopped, last
    step = int(stopped[1])
    assert Path(stopped[2]) == run / "checkpoints" / str(step)
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [step]
    assert (run / "config.yaml").is_file() and (run / "skipped_records.process1.log").is_file()

    procs = _launch(_pretrain_argv(tmp_path, _free_port(), peer_timeout))   # resumes from `step`
    _await_steps(procs, metrics, step + 2)
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    (status, err), _ = _finish(procs, peer_timeout + 120)
    elapsed = time.monotonic() - killed_at
    last = err.strip().splitlines()[-1]
    assert status == EXIT_PEER_LOST, err[-3000:]
    assert last.startswith("composer-jax pretrain: error: process 1 of 2 stopped responding (no heartbeat for "), last
    assert elapsed < peer_timeout + 30, elapsed   # before JAX's backstop (+30 s)
    logged = _logged_steps(metrics)
    assert logged == list(range(1, len(logged) + 1))   # each step once (process 0 only), cut back on resume


@pytest.mark.slow
def test_failed_peer_ends_the_other_with_its_reason(tmp_path):
    """Process 1 fails to start (its data path does not exist); it says why and exits at once, and process
    0, waiting for it, exits with process 1's reason instead of waiting out a timeout."""
    argv = _pretrain_argv(tmp_path, _free_port(), 600)
    procs = _launch(lambda i: argv(i) + (["data.path=/no/such/dir"] if i == 1 else []))
    (status0, err0), (status1, err1) = _finish(procs, LAUNCH_TIMEOUT_S)
    assert status1 == 2 and err1.strip().splitlines()[-1] == \
        "composer-jax pretrain: error: data path /no/such/dir does not exist", err1[-3000:]
    assert status0 == EXIT_PEER_LOST, err0[-3000:]
    assert err0.strip().splitlines()[-1] == ("composer-jax pretrain: error: process 1 of 2 failed: DataError: data "
                                             "path /no/such/dir does not exist"), err0[-3000:]


def test_coordinator_death_ends_the_others_at_once(tmp_path):
    """Process 0 (the coordination service) dies: JAX itself ends the others at once (its own fatal
    message and stack trace: its client offers Python no usable hook, docs/multihost.md), long before any peer
    timeout, instead of leaving them hanging in the collective."""
    peer_timeout = 300   # neither the watchdog nor JAX's heartbeat (+30 s) can be what ends process 1
    port = _free_port()
    procs = _launch(lambda i: [sys.executable, "-m", "tests.collective_loop", str(i), str(port), str(peer_timeout),
                               "0"])
    started = time.monotonic()
    (status0, _), (status1, err1) = _finish(procs, LAUNCH_TIMEOUT_S)
    assert status0 == 9
    assert status1 != 0 and "This most likely indicates that another task died" in err1, err1[-3000:]
    assert time.monotonic() - started < peer_timeout - 100, "not at once"   # start-up included


def test_checkpoint_barriers_in_a_thread_do_not_cross_the_steps_collectives(tmp_path):
    """orbax's multi-process barriers in a background thread (an async save's commit) beside the main
    thread's collectives (the training steps): both finish in each process. As JAX collectives (orbax's
    default) the two threads' collectives cross in a different order on each process and the group hangs
    (or gloo aborts on mismatched sizes); `initialize` routes the barriers through the coordination service."""
    port = _free_port()
    procs = _launch(lambda i: [sys.executable, "-m", "tests.checkpoint_barrier_race", str(i), str(port)])
    for i, (status, err) in enumerate(_finish(procs, 300)):      # seconds when it works; a hang never ends
        assert status == 0 and procs[i].stdout_text.strip().endswith("ok"), f"process {i}:\n{err[-3000:]}"


@pytest.mark.slow
def test_a_group_that_never_forms_ends_with_one_line(tmp_path):
    """Process 1 starts, process 0 never does: after --init-timeout, one line and status 75 (JAX would
    abort later with a stack trace)."""
    argv = _pretrain_argv(tmp_path, _free_port(), 60)(1) + ["--init-timeout", "5"]
    (status, err), = _finish(_launch(lambda i: argv, n=1), LAUNCH_TIMEOUT_S)
    assert status == EXIT_PEER_LOST, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("composer-jax pretrain: error: process 1 of 2 waited 5 s "
                                                   "(--init-timeout) for the group at localhost:"), err[-3000:]


RL_OVERRIDES = [*TINY, "rollout.transport=directory", "rl.max_staleness=0", "rl.steps=3", "rl.kl_coef=0.05",
                "eval.every=0", "checkpoint.every=1", "checkpoint.keep=4", "rollout.engine_timeout_s=300",
                "rollout.max_new_tokens=12", "rl.max_tokens=12"]


def _rl_engines(run_dir: Path, overrides) -> list[subprocess.Popen]:
    """The rollout engines (tests/rl_engine_process.py: parity tasks) for the learner run in `run_dir`, 2
    devices each; engine k writes each weight version V it takes to run_dir/engine<k>-V.npz."""
    env = {**_env(), "XLA_FLAGS": f"{_env()['XLA_FLAGS']} --xla_force_host_platform_device_count=2".strip()}
    return [subprocess.Popen([sys.executable, "-m", "tests.rl_engine_process", "--engine", str(k), "--dump",
                              str(run_dir / f"engine{k}"), *overrides, f"run_dir={run_dir}", "cpu_devices=2"],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for k in range(2)]


def _rl_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_rl_learner_of_two_processes_matches_one(tmp_path):
    """`composer-jax rl` as 2 processes x 4 devices (init_from a run, streamed by each process into its shards;
    the reference policy; RL steps on the dual grid) feeding 2 rollout engine processes, engine 0 INT4 and
    engine 1 on the learner's float weights, device to device: each learner process serves its own shards of
    every version (the routed experts quantized to INT4 on them too) and each engine pulls its pieces from
    both and assembles its own layout. Trains as one learner process with 8 devices does (the parity tasks
    of tests/rl_parity.py: rewards and flagged turns from a near-random policy): the same batches (staleness
    0: each batch sampled with the weights of the step before), the same losses step for step; process 0
    alone reports and writes the metrics. The checkpoint both saved restores in one process; at every version
    each engine took, the float engine held the checkpoint's weights of that step bit for bit, the INT4
    engine the reference quantizer's words and scales of them."""
    from flax import nnx

    from composer_jax.source_weights import open_model
    from composer_jax.model.moe import routed_expert_paths
    from composer_jax.model.quant import quantize_experts
    from composer_jax.rl.engines import offered_weights
    from composer_jax.rl.exchange.transport_device import flat_parameters
    from composer_jax.rl.loop import RLTrainer
    from composer_jax.rl.run_config import load_rl_config

    from tests.random_models import save_random_run
    from tests.test_rl_loop import BYTE_TINY

    overrides = [*RL_OVERRIDES, "rollout.engines=2", "rollout.weights=[int4, learner]", "rollout.weight_transfer=device",
                 f"init_from={save_random_run(tmp_path / 'source', BYTE_TINY)}"]
    one = tmp_path / "one"
    engines = _rl_engines(one, overrides)
    try:
        RLTrainer(load_rl_config("rl-tiny", [*overrides, f"run_dir={one}"]), parity_tasks()).run()
    except Exception as e:      # where the engines stood (a hang seen once: engine 0 never wrote batch 0)
        raise AssertionError(f"{e}\n{_stacks_then_kill(engines)}") from e
    for k, (status, err) in enumerate(_finish(engines, LAUNCH_TIMEOUT_S)):
        assert status == 0, f"engine {k}:\n{err[-3000:]}"

    two, port = tmp_path / "two", _free_port()
    engines = _rl_engines(two, overrides)
    learners = _launch(lambda i: [sys.executable, "-m", "tests.rl_learner_process", *overrides, f"run_dir={two}",
                                  "cpu_devices=4", "--coordinator", f"localhost:{port}", "--num-processes", "2",
                                  "--process-id", str(i)])
    results = _finish([*learners, *engines], LAUNCH_TIMEOUT_S)
    for name, (status, err) in zip(("process 0", "process 1", "engine 0", "engine 1"), results):
        assert status == 0, f"{name}:\n{err[-3000:]}"
    # (gloo's chatter may split lines of stdout)
    assert re.search(r"^rl: steps 0 -> 3 ", learners[0].stdout_text, re.M) and "rl:" not in learners[1].stdout_text
    assert all(json.loads(e.stdout_text.strip().splitlines()[-1])["batches"] >= 1 for e in engines)

    ours, ref = _rl_records(two), _rl_records(one)
    assert [r["step"] for r in ours] == [r["step"] for r in ref] == [1, 2, 3]
    compared = [k for k in ref[0] if k.startswith(("loss", "kl_", "grad_norm", "entropy", "reward", "tokens"))]
    assert {"loss", "loss_sd", "kl_k1", "grad_norm"} <= set(compared), compared
    assert all(r["tokens"] > 0 and r["loss_sd"] > 0 for r in ref) and any(r["trained_draws"] for r in ref), ref
    assert ref[-1]["kl_k1"] != 0, "the policy never moved from the reference"
    for a, b in zip(ours, ref):
        assert a["batch_draws"] == b["batch_draws"] and a["trained_draws"] == b["trained_draws"], a["step"]
        assert a["staleness_max"] == 0, a["step"]
        for key in compared:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key, a[key], b[key])
    # The checkpoint the 2 processes saved restores in this one process (8 devices), offering both engines' names.
    restored = RLTrainer(load_rl_config("rl-tiny", [*overrides, f"run_dir={two}"]), parity_tasks())
    try:
        assert restored.life.resumed_from == 3
        offered = set(offered_weights(restored.cfg, restored.learner))     # float and INT4 experts
    finally:
        restored.checkpoints.close()
    # Every version V each engine took, against the checkpoint of step V (version 0: the run it started from),
    # opened in one process as `composer-jax eval` opens a run: the float engine held its weights bit for bit,
    # the INT4 engine the reference quantizer's words and scales of them.
    taken = {k: sorted(int(p.stem.split("-")[1]) for p in two.glob(f"engine{k}-*.npz")) for k in range(2)}
    assert taken[0][:2] == [0, 2] and taken[1][:1] == [1], taken     # engine k samples batches k, k + 2, ...
    for version in sorted(set(taken[0]) | set(taken[1])):
        at_version = tmp_path / "source" if version == 0 else tmp_path / f"two-at-{version}"
        if version:
            shutil.copytree(two, at_version, ignore=lambda _, names: [n for n in names if n.isdigit() and int(n) > version])
        opened = open_model(at_version)
        assert version == 0 or opened.description == f"training run {at_version}, step {version}"
        for k in (k for k in range(2) if version in taken[k]):
            want = nnx.state(opened.model)
            if k == 0:
                want = quantize_experts(nnx.to_flat_state(want), routed_expert_paths(opened.model))
            want = flat_parameters(want)
            with np.load(two / f"engine{k}-{version}.npz") as held:
                assert set(held) == set(want) and set(held) <= offered, k
                assert any(name.endswith(".packed") for name in held) == (k == 0), k
                for name in held:
                    got, ref = held[name], np.asarray(want[name])     # (bfloat16 scales: raw 2-byte items)
                    assert got.shape == ref.shape and got.tobytes() == ref.tobytes(), f"engine {k}, {version}: {name}"


def test_a_weight_version_costs_each_learner_process_its_own_shards_not_the_model(tmp_path):
    """2 processes x 4 devices publish versions of 64 MiB of parameters sharded over all 8 devices
    (tests/transfer_memory_process.py), where gathering the model (what the file transport did before) grows
    each process's resident memory by the model's 64 MiB:
    - device transport, an engine process (2 devices) pulling each version from both: a float version grows
      each process by at most twice its own 32 MiB of shards plus 16 MiB (its copy, held until newer versions
      replace it, and XLA:CPU's transfer server's copy of what it sends while the engine pulls); an INT4
      version (quantized on each process's shards) by at most twice its own 4.5 MiB of words and scales plus
      16 MiB. The engine checks both versions bit for bit.
    - file transport: at most the own 32 MiB plus 16 MiB while it writes them; the version reads back whole."""
    from composer_jax.rl.exchange.transport_files import FileWeightClient

    port = _free_port()
    procs = _launch(lambda i: [sys.executable, "-m", "tests.transfer_memory_process", str(i), str(port),
                               str(tmp_path)])
    engine = subprocess.Popen([sys.executable, "-m", "tests.transfer_memory_process", "engine", "0", str(tmp_path)],
                              cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = _finish([*procs, engine], LAUNCH_TIMEOUT_S)
    for name, (status, err) in zip(("process 0", "process 1", "engine"), results):
        assert status == 0, f"{name}:\n{err[-3000:]}"
    mib = 2 ** 20
    for p in procs:
        m = json.loads(p.stdout_text.strip().splitlines()[-1])
        assert m["own_bytes"] == m["model_bytes"] // 2 == 32 * mib, m
        assert m["gather_peak"] >= 0.9 * m["model_bytes"], m        # the sampler sees a whole-model copy
        assert m["offer_peak"] <= m["own_bytes"] + 16 * mib, m
        assert m["device_peak"] <= 2 * m["own_bytes"] + 16 * mib, m
        assert m["int4_peak"] <= 2 * m["own_bytes"] * 9 // 64 + 16 * mib, m
        print(json.dumps(m))
    like = {f"layer{k}": np.zeros((1024, 2048), np.float32) for k in range(8)}
    back = FileWeightClient(tmp_path / "files", like).pull(1)
    assert all(np.all(back[f"layer{k}"] == k) for k in range(8))

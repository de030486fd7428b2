"""Exact resumption: a `composer-jax pretrain` run killed with SIGKILL after a checkpoint and started
again reproduces the per-step losses of the uninterrupted run bitwise (CPU)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.test_train import write_code_tree

STEPS = 16


def _records(path, start=0):
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes()[start:].decode().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by the kill
    return out


def _complete_checkpoints(directory):
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.exists() else []


@pytest.mark.slow
def test_sigkill_then_restart_reproduces_losses_bitwise(tmp_path):
    tree = write_code_tree(tmp_path / "code")
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "composer_jax.cli", "pretrain", "pretrain-tiny", f"data.path={tree}",
               f"run_dir={run_dir}", f"train.steps={STEPS}", "train.batch_size=8", "train.seq_len=32",
               "train.log_every=1", "train.progress=false", "data.eval_fraction=0", "checkpoint.every=4"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    metrics = run_dir / "metrics.jsonl"

    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 400
        while time.time() < deadline and first.poll() is None:
            done = [r["step"] for r in _records(metrics) if "loss" in r]
            ckpts = _complete_checkpoints(run_dir / "checkpoints")
            if ckpts and done and max(done) >= ckpts[-1] + 2:
                break
            time.sleep(0.05)
        assert first.poll() is None, f"the first run ended before it could be killed: {first.stderr.read()[-2000:]}"
        first.send_signal(signal.SIGKILL)
        first.wait(60)
    finally:
        if first.poll() is None:
            first.kill()
    uninterrupted = {r["step"]: r["loss"] for r in _records(metrics) if "loss" in r}
    resume_from = _complete_checkpoints(run_dir / "checkpoints")[-1]
    killed_at = max(uninterrupted)
    assert killed_at >= resume_from + 2

    written = metrics.stat().st_size
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"steps {resume_from} -> {STEPS}" in second.stdout
    resumed = {}
    for r in _records(metrics, start=written):
        if "loss" in r:
            resumed[r["step"]] = r["loss"]
    assert sorted(resumed) == list(range(resume_from + 1, STEPS + 1))
    for step in range(resume_from + 1, killed_at + 1):
        assert resumed[step] == uninterrupted[step], (step, resumed[step], uninterrupted[step])

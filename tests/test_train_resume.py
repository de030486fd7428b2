"""Interrupted `composer-jax pretrain` runs resume exactly: SIGTERM saves a checkpoint at the current step
and exits 143 with one line saying how to resume; SIGKILL loses the steps after the last checkpoint; the
restarts reproduce the per-step losses of an uninterrupted run bitwise (CPU), and metrics.jsonl and
TensorBoard end up holding every step exactly once."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.test_train import write_code_tree

STEPS, EVERY = 12, 4
TIMEOUT_S = 400  # per launch, on a loaded 2-core machine


def _records(path):
    out = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a kill
    return out


def _losses(run_dir) -> dict[int, list[float]]:
    """{step: [loss of every train line logged for it]} (a clean log has one per step)."""
    out = {}
    for r in _records(run_dir / "metrics.jsonl"):
        if "loss" in r:
            out.setdefault(r["step"], []).append(r["loss"])
    return out


def _complete_checkpoints(run_dir):
    directory = run_dir / "checkpoints"  # orbax commits a step by renaming its temporary directory to the step
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.exists() else []


def _tensorboard_scalars(run_dir, tag):
    """[(step, value)] of `tag` in every event file of RUN_DIR/tb, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    out = []
    for path in sorted((run_dir / "tb").glob("*tfevents*")):
        for event in LegacyEventFileLoader(str(path)).Load():  # the raw events, as written
            out += [(event.step, v.simple_value) for v in event.summary.value if v.tag == tag]
    return out


def _wait_for(process, condition, what):
    deadline = time.time() + TIMEOUT_S
    while time.time() < deadline and process.poll() is None:
        if condition():
            return
        time.sleep(0.05)
    out = process.stderr.read()[-3000:] if process.poll() is not None else ""
    raise AssertionError(f"the run ended or timed out before {what}: {out}")


@pytest.mark.slow
def test_sigterm_and_sigkill_then_restart_match_an_uninterrupted_run(tmp_path):
    tree = write_code_tree(tmp_path / "code")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # launches after the first reuse its compilations

    def args(run_dir, *extra):
        return ["pretrain", "pretrain-tiny", "model.vocab_size=256", "data.tokenizer=byte", f"data.path={tree}",
                f"run_dir={run_dir}", f"train.steps={STEPS}",
                "train.batch_size=8", "train.seq_len=32", "train.log_every=1", "train.progress=false",
                "data.eval_fraction=0", f"checkpoint.every={EVERY}", *extra]

    def start(argv):
        return subprocess.Popen([sys.executable, "-m", "composer_jax.cli", *argv], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    # The reference: an uninterrupted run.
    reference = subprocess.run([sys.executable, "-m", "composer_jax.cli", *args(tmp_path / "reference")], env=env,
                               capture_output=True, text=True, timeout=TIMEOUT_S)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = _losses(tmp_path / "reference")
    assert sorted(expected) == list(range(1, STEPS + 1))

    run_dir = tmp_path / "run"
    # 1. SIGTERM once two steps are logged (with the progress bar on): a checkpoint of the step it was on,
    #    one line, status 143.
    argv = args(run_dir, "train.progress=true")
    first = start(argv)
    try:
        _wait_for(first, lambda: len(_losses(run_dir)) >= 2, "two steps were logged")
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=TIMEOUT_S)
    finally:
        first.kill()
    stopped_at = max(_losses(run_dir))
    assert first.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err
    checkpoint = run_dir / "checkpoints" / str(stopped_at)
    assert err.strip().splitlines()[-1] == (f"pretrain: interrupted by SIGTERM at step {stopped_at}; checkpoint "
                                            f"{checkpoint} saved; resume with: composer-jax {' '.join(argv)}")
    assert "SIGTERM received: finishing the current step, then saving a checkpoint" in err
    assert "compiling the train step" in err  # the progress bar says so while the first step compiles
    assert _complete_checkpoints(run_dir)[-1] == stopped_at < STEPS
    assert sorted(_losses(run_dir)) == list(range(1, stopped_at + 1))

    # 2. Restart; SIGKILL it once a step after a new periodic checkpoint is logged (that step is lost).
    second = start(args(run_dir))
    try:
        def past_a_new_checkpoint():
            saved = [s for s in _complete_checkpoints(run_dir) if s > stopped_at]
            return bool(saved) and max(_losses(run_dir)) > saved[-1]

        _wait_for(second, past_a_new_checkpoint, "a step after a new checkpoint was logged")
        second.send_signal(signal.SIGKILL)
        second.wait(60)
    finally:
        second.kill()
    resume_from = _complete_checkpoints(run_dir)[-1]
    lost = [s for s in _losses(run_dir) if s > resume_from]
    assert lost and resume_from < STEPS

    # 3. Restart to the end: the lost steps' log lines are dropped and the steps redone.
    third = subprocess.run([sys.executable, "-m", "composer_jax.cli", *args(run_dir)], env=env, capture_output=True,
                           text=True, timeout=TIMEOUT_S)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"steps {resume_from} -> {STEPS}" in third.stdout
    assert f"resuming from checkpoint {run_dir / 'checkpoints' / str(resume_from)} (step {resume_from} of {STEPS})" \
        in third.stderr
    assert f"dropped {len(lost)} metrics records logged after step {resume_from}" in third.stderr

    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(len(v) == 1 for v in losses.values()), losses
    assert losses == expected  # bitwise: the same floats as the uninterrupted run
    scalars = _tensorboard_scalars(run_dir, "loss")
    assert sorted(step for step, _ in scalars) == list(range(1, STEPS + 1))
    np.testing.assert_array_equal([v for _, v in sorted(scalars)],
                                  np.float32([expected[s][0] for s in range(1, STEPS + 1)]))

"""The run lifecycle's pieces: stop signals (first one: stop at the step boundary, status 128 + N; second:
exit at once), the stop / save / resume loop pretraining and RL share, the learning-rate schedule when a resumed run changes train.steps, logs cut back to the
checkpoint on resume (metrics.jsonl and TensorBoard), the skip log, plots, and run paths."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from composer_jax.config import ConfigError
from composer_jax.train.config import load_run_config
from composer_jax.train.lifecycle import Lifecycle, StopSignals, interrupted_line, schedule_on_resume
from composer_jax.train.metrics import MetricsWriter, Progress, read_metrics
from composer_jax.train.optimizer import wsd_schedule

REPO = Path(__file__).resolve().parent.parent

# A loop of "steps" under StopSignals; on a stop it prints `saving`, takes SAVE_S to "save", writes the
# file `saved` and exits with the stop's status.
LOOP = textwrap.dedent("""
    import sys, time
    from composer_jax.train.lifecycle import StopSignals
    save_s, marker = float(sys.argv[1]), sys.argv[2]
    with StopSignals() as stop:
        print("running", flush=True)
        while not stop.requested:
            time.sleep(0.01)
        print("saving", flush=True)
        time.sleep(save_s)
        open(marker, "w").write("saved")
    sys.exit(stop.exit_status)
""")


def _loop(tmp_path, save_s):
    process = subprocess.Popen([sys.executable, "-c", LOOP, str(save_s), str(tmp_path / "saved")], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    assert process.stdout.readline() == "running\n"
    return process


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_at_the_step_boundary_saves_and_exits_128_plus_n(tmp_path, signum):
    process = _loop(tmp_path, save_s=0.5)
    process.send_signal(signum)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signum  # 143 for SIGTERM, 130 for SIGINT
    assert out == "saving\n" and (tmp_path / "saved").read_text() == "saved"
    again = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert err == (f"{signal.Signals(signum).name} received: finishing the current step, then saving a checkpoint "
                   f"({again} again exits at once, without saving)\n")


def test_a_second_ctrl_c_exits_at_once(tmp_path):
    """During a 60 s "save" (the main thread inside a C call), a second SIGINT ends the process at once."""
    process = _loop(tmp_path, save_s=60)
    process.send_signal(signal.SIGINT)
    assert process.stdout.readline() == "saving\n"
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    process.wait(timeout=30)
    assert time.monotonic() - started < 30 and process.returncode == -signal.SIGINT  # killed by the signal
    assert not (tmp_path / "saved").exists() and "Traceback" not in process.stderr.read()


def test_stop_signals_restore_the_handlers_and_do_nothing_off_the_main_thread():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._handle
    assert signal.getsignal(signal.SIGTERM) is before
    seen = []

    def worker():
        with StopSignals() as off_main:
            seen.append((signal.getsignal(signal.SIGTERM), off_main.requested))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [(before, None)]


class FakeCheckpoints:
    """What Lifecycle uses of RunCheckpoints: the latest step, and waiting for a save."""

    def __init__(self, latest):
        self.latest, self.directory, self.waited = latest, Path("/ckpt"), 0

    def latest_step(self):
        return self.latest

    def wait(self):
        self.waited += 1


def _steps(life, start, stop_after=None):
    """The loop both runs drive: steps to `life.last`, a SIGTERM arriving during step `stop_after`."""
    step = start
    with life.running(start, notice=lambda text: None):
        while step < life.last and not life.stop_requested():
            step += 1
            if step == stop_after:
                os.kill(os.getpid(), signal.SIGTERM)
            life.stepped(step)
        life.finish(step)
    return step


def test_the_lifecycle_saves_every_n_steps_the_last_and_the_step_a_signal_stopped_after():
    saved = []
    life = Lifecycle(FakeCheckpoints(None), saved.append, every=3, last=7)
    assert life.keep_through(0) == -1 and _steps(life, 0) == 7
    assert saved == [3, 6, 7] and life.interruption(7) == {} and life.checkpoints.waited == 1

    saved.clear()
    life = Lifecycle(FakeCheckpoints(3), saved.append, every=3, last=7)   # resumed at step 3, stopped in step 5
    assert life.resumed_from == 3 and life.keep_through(3) == 3
    assert _steps(life, 3, stop_after=5) == 5 and saved == [5]
    assert life.interruption(5) == {"interrupted": "SIGTERM", "exit_status": 143, "checkpoint": "/ckpt/5"}

    saved.clear()
    life = Lifecycle(FakeCheckpoints(None), saved.append, every=3, last=7)   # stopped in step 6: saved already
    assert _steps(life, 0, stop_after=6) == 6 and saved == [3, 6]
    assert life.interruption(6)["checkpoint"] == "/ckpt/6"


def test_interrupted_line():
    assert interrupted_line("pretrain", "SIGTERM", 7, "/r/checkpoints/7", ["pretrain", "run_dir=/my runs/x"]) == (
        "pretrain: interrupted by SIGTERM at step 7; checkpoint /r/checkpoints/7 saved; resume with: "
        "composer-jax pretrain 'run_dir=/my runs/x'")
    assert interrupted_line("sft", "SIGINT", 0, None, ["sft"]) == (
        "sft: interrupted by SIGINT at step 0; no checkpoint yet (nothing trained to save); resume with: "
        "composer-jax sft")


# ----------------------------------------------------------------------------------------------------
# Changing train.steps on resume


def _run_cfg(steps, **optimizer):
    opt = dict(lr=1.0, warmup_steps=2, decay_fraction=0.5, min_lr_ratio=0.1)
    return load_run_config("pretrain-tiny", [f"train.steps={steps}", "run_dir=/tmp/x"]
                           + [f"optimizer.{k}={v}" for k, v in {**opt, **optimizer}.items()])


def _lrs(cfg, steps):
    """The rate the optimizer uses at each optimizer count in `steps` (count k = the (k+1)-th step)."""
    schedule = wsd_schedule(cfg.optimizer, cfg.train.steps)
    return [round(float(schedule(k)), 6) for k in steps]


def test_a_finished_run_extended_without_a_choice_is_refused():
    saved = dataclasses.asdict(_run_cfg(10))
    with pytest.raises(ConfigError) as err:
        schedule_on_resume(_run_cfg(20), saved, 10)
    # the 10-step schedule: warmup 2, stable to 5, linear decay 1 -> 0.1 over counts 5..10; count 9: 0.28
    assert str(err.value) == (
        "config key 'optimizer.on_extend': the checkpoint at step 10 follows a schedule of 10 steps (last lr 0.28) "
        "and train.steps=20 changes it: pass optimizer.on_extend=continue to keep the decayed rate, or "
        "optimizer.on_extend=restart to warm up and decay again over steps 11-20")


def test_extension_continue_keeps_the_decayed_rate_and_restart_runs_the_schedule_again():
    saved = dataclasses.asdict(_run_cfg(10))
    # Hand-computed WSD (lr 1, warmup 2, decay over the last half to 0.1), the counts after step 10:
    cont, note = schedule_on_resume(_run_cfg(20, on_extend="continue"), saved, 10)
    assert _lrs(cont, range(10, 20)) == [0.1] * 10
    assert note == "train.steps 10 -> 20 from step 10: continuing the schedule (optimizer.on_extend=continue); " \
                   "next lr 0.1"
    restart, note = schedule_on_resume(_run_cfg(20, on_extend="restart"), saved, 10)
    assert _lrs(restart, range(10, 21)) == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.82, 0.64, 0.46, 0.28, 0.1]
    assert "restarting the schedule" in note
    # Silently re-planned over 20 steps (the old behaviour) the rate would jump back to the stable 1.0:
    assert _lrs(_run_cfg(20), [10]) == [1.0]
    # Resuming the extended run (same train.steps) keeps the extension's schedule, without asking.
    again, note = schedule_on_resume(_run_cfg(20), dataclasses.asdict(restart), 15)
    assert note is None and _lrs(again, range(10, 21)) == _lrs(restart, range(10, 21))
    # An interrupted run resumed as it was planned is left alone.
    same, note = schedule_on_resume(_run_cfg(10), saved, 4)
    assert note is None and _lrs(same, range(10)) == _lrs(_run_cfg(10), range(10))


# ----------------------------------------------------------------------------------------------------
# Logs on resume


def _tensorboard(run_dir):
    """{tag: [(step, value, wall time)]} of RUN_DIR/tb, read raw with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    out = {}
    for path in sorted((run_dir / "tb").glob("*tfevents*")):
        for event in LegacyEventFileLoader(str(path)).Load():
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value, event.wall_time))
    return out


def test_tensorboard_logging_does_not_import_torch(tmp_path):
    """A run's TensorBoard writer leaves torch unimported (tensorboardX's writer imports it when installed: 1.4 s
    of every run's start) and importable afterwards; the scalar still reaches the event file."""
    script = textwrap.dedent(f"""
        import sys
        from composer_jax.train.metrics import MetricsWriter
        writer = MetricsWriter({str(tmp_path)!r})
        writer.write({{"step": 1, "loss": 2.5}})
        writer.close()
        assert "torch" not in sys.modules, "torch was imported"
        import torch
        print(torch.ones(1).item())
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["1.0"], result.stderr[-2000:]
    assert [(s, v) for s, v, _ in _tensorboard(tmp_path)["loss"]] == [(1, 2.5)]


def test_resumed_logs_hold_each_step_once(tmp_path):
    """A run logged steps 0..6 and was killed mid-line after its checkpoint at 4: the resumed writer keeps
    steps <= 4 (train and eval lines) in metrics.jsonl, rebuilds TensorBoard from them, and the redone
    steps 5, 6 appear once in both."""
    writer = MetricsWriter(tmp_path)
    writer.write({"step": 0, "eval_loss": 9.0})
    for step in range(1, 7):
        writer.write({"step": step, "loss": 10.0 - step})
    writer.write({"step": 4, "eval_loss": 5.5})
    writer.close()
    (event_file,) = (tmp_path / "tb").iterdir()  # as an earlier second would have named it
    event_file.rename(event_file.with_name("events.out.tfevents.1000000000.earlier"))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # cut by the kill
    first_times = {r["step"]: r["time"] for r in read_metrics(tmp_path) if "loss" in r}

    resumed = MetricsWriter(tmp_path, keep_through=4)
    assert resumed.dropped == 2  # steps 5 and 6 (the cut line was never a record)
    for step in (5, 6):
        resumed.write({"step": step, "loss": 20.0 - step})
    resumed.close()

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "eval_loss" in r) for r in lines] == [(0, True), (1, False), (2, False), (3, False),
                                                              (4, False), (4, True), (5, False), (6, False)]
    assert [r["loss"] for r in lines if "loss" in r] == [9.0, 8.0, 7.0, 6.0, 15.0, 14.0]
    tb = _tensorboard(tmp_path)
    assert [(s, v) for s, v, _ in tb["loss"]] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 15.0), (6, 14.0)]
    assert [(s, v) for s, v, _ in tb["eval_loss"]] == [(0, 9.0), (4, 5.5)]
    assert "time" not in tb
    for step, _, wall in tb["loss"][:4]:  # rebuilt events keep their original wall times
        assert wall == pytest.approx(first_times[step])

    fresh = MetricsWriter(tmp_path, keep_through=-1)  # no checkpoint: an earlier attempt is dropped whole
    fresh.close()
    assert fresh.dropped == 8 and (tmp_path / "metrics.jsonl").read_text() == "" and _tensorboard(tmp_path) == {}


# ----------------------------------------------------------------------------------------------------
# Progress, skips, plots


def test_progress_says_compiling(tmp_path):
    import io

    out = io.StringIO()
    progress = Progress(10, 0, True, file=out)
    progress.status("compiling the train step")
    assert "compiling the train step" in out.getvalue().splitlines()[-1].split("\r")[-1]
    progress.status("")
    progress.update(1, 5.0, 100.0, None)
    progress.close()
    assert "compiling" not in out.getvalue().split("\r")[-1]


def test_skips_are_counted_and_listed_in_a_file_not_on_the_console(tmp_path, capsys, caplog):
    from composer_jax.data.sources import SkipLog, TextTreeSource

    root = tmp_path / "tree"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "ok.py").write_text("x = 1\n")
    (root / "pkg" / "blob.py").write_bytes(b"\0\1\2")
    (root / "empty.py").write_text("  \n")
    skips = SkipLog()
    source = TextTreeSource(str(root), "**/*.py", (), 10**6, skips)
    assert [source[i] for i in range(len(source))].count(None) == 2
    skips.keep_truncated("conv.jsonl:3 (600 tokens > seq_len 512)")
    skips.write_to(tmp_path / "skips.log", f"data paths relative to {root}")
    skips.skip("bad_json", "data.jsonl:7 (Expecting value)")
    skips.close()
    assert (tmp_path / "skips.log").read_text().splitlines() == [
        f"# data paths relative to {root}", "skipped (empty): empty.py", "skipped (binary): pkg/blob.py",
        "truncated: conv.jsonl:3 (600 tokens > seq_len 512)", "skipped (bad_json): data.jsonl:7 (Expecting value)"]
    assert skips.summary() == "skipped records: bad_json 1, binary 1, empty 1; truncated 1" and skips.total == 3
    captured = capsys.readouterr()
    assert captured.out == captured.err == "" and not caplog.records


def test_plots_draw_one_point_per_logged_value_and_the_mtp_kl_on_its_own_axis():
    from composer_jax.train.plot import make_figures

    records = []
    for step in range(1, 21):
        rec = {"step": step, "loss": 5.0 - 0.1 * step, "mtp1_ce": 5.2 - 0.1 * step, "mtp1_kl": 0.02 + 1e-4 * step}
        if step % 5 == 0:  # throughput is measured (and logged) every 5 steps
            rec.update(tokens_per_s=1000.0 + step, mfu=0.1)
        records.append(rec)
    figures = make_figures(records, "run")
    (throughput,) = figures["throughput"].axes[0].get_lines()
    assert list(throughput.get_xdata()) == [5, 10, 15, 20]
    left, right = figures["mtp"].axes
    assert [line.get_label() for line in left.get_lines()] == ["MTP depth 1 CE"]
    (kl,) = right.get_lines()
    assert kl.get_label() == "MTP depth 1 KL to main" and right.get_ylabel() == "KL to main head (nats / token)"
    low, high = right.get_ylim()
    assert high - low < 0.01  # scaled to the KL itself, not to the cross-entropy's range
    import matplotlib.pyplot as plt

    plt.close("all")

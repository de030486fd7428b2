"""How a run stops and how it starts again (the pieces pretraining, SFT and RL share).

Stopping: SIGINT (Ctrl-C) and SIGTERM (the preemption signal of SLURM and Kubernetes) become a request
to stop at the next step boundary, where the loop saves a checkpoint and returns; a second signal ends
the process at once.

Exit status of a run stopped this way: 128 + the signal number, as shells report a process killed by
that signal (130 for SIGINT, 143 for SIGTERM), so schedulers and scripts can tell "interrupted and
saved" from success (0) and from errors (1, 2).

Python runs signal handlers on the main thread between bytecodes, so the first signal is noticed when
the current step (or compilation) returns; the handler therefore also sets the signals back to their
default action, which the kernel carries out at once even while the main thread is inside XLA: a
second Ctrl-C ends the process immediately, without saving (orbax's atomic saves leave the previous
checkpoint as the latest).

Starting again: the logs are cut back to the checkpoint (`metrics.MetricsWriter(keep_through=...)`), and
a different `train.steps` than the checkpointed run planned is an explicit choice about the learning-rate
schedule (`schedule_on_resume`).

`Lifecycle` is the one loop of stop, save and resume both `train.loop` and `rl.loop` run: it restores
the latest checkpoint, saves every `checkpoint.every` steps and at the last, turns a signal into a stop
that every process of a group agrees on, saves the step it stopped after, and says so in the summary.
"""

from __future__ import annotations

import dataclasses
import shlex
import signal
import sys
import threading
from typing import Any, Callable

from composer_jax.config import ConfigError
from composer_jax.train.config import RunConfig

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_status(signum: int) -> int:
    """The shell's status for a process ended by `signum`: 128 + its number."""
    return 128 + int(signum)


class StopSignals:
    """Context manager: while active (on the main thread), SIGINT / SIGTERM set `requested` instead of
    ending the process; `notice(text)` says so (default: a line on stderr). Restores the previous
    handlers on exit. Elsewhere than on the main thread it installs nothing (signals keep their
    handlers) and `requested` stays None."""

    def __init__(self, notice: Callable[[str], None] | None = None, signals=STOP_SIGNALS):
        self.signals = tuple(signals)
        self.notice = notice or (lambda text: print(text, file=sys.stderr, flush=True))
        self.requested: signal.Signals | None = None
        self._previous: dict[int, object] = {}

    @property
    def name(self) -> str | None:
        return None if self.requested is None else self.requested.name

    @property
    def exit_status(self) -> int | None:
        return None if self.requested is None else exit_status(self.requested)

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum)
        for s in self.signals:  # the next one is carried out by the kernel, even mid-computation
            signal.signal(s, signal.SIG_DFL)
        again = "Ctrl-C" if signum == signal.SIGINT else self.requested.name
        self.notice(f"{self.requested.name} received: finishing the current step, then saving a checkpoint "
                    f"({again} again exits at once, without saving)")

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def interruption(stop: StopSignals, checkpoint: str | None) -> dict:
    """A stopped run's summary entries: `interrupted` (the signal's name), `exit_status`, `checkpoint`. In a
    process group a process may stop with no signal of its own (another process got it): SIGTERM's status."""
    signum = stop.requested or signal.SIGTERM
    return {"interrupted": stop.name or "a signal to another process", "exit_status": exit_status(signum),
            "checkpoint": checkpoint}


class Lifecycle:
    """A run's stop, save and resume around its step loop:

        life = Lifecycle(checkpoints, save, every=cfg.checkpoint.every, last=steps)
        state, data = life.resume(abstract)          # when life.resumed_from is not None
        with life.running(start, progress.note):
            while step < last and not life.stop_requested():
                ...; step += 1; life.stepped(step)   # saves every `every` steps and at `last`
            life.finish(step)                        # saves the step a signal stopped after; waits for the save
        summary.update(life.interruption(step))

    `save(step)`: writes the run's checkpoint of `step` (its state and data state)."""

    def __init__(self, checkpoints, save: Callable[[int], None], every: int, last: int):
        self.checkpoints, self._save, self.every, self.last = checkpoints, save, every, last
        self.resumed_from: int | None = checkpoints.latest_step()
        self.saved, self.start, self.stopping, self._signals = self.resumed_from, None, False, None

    def resume(self, abstract) -> tuple[Any, dict]:
        """(state, data state) of the latest checkpoint, on `abstract`'s shardings, once its model is
        checked against `abstract`'s (a ConfigError naming run_dir when they differ)."""
        self.checkpoints.check_model(abstract, "run_dir")
        return self.checkpoints.restore(abstract)

    def keep_through(self, start: int) -> int:
        """The last step whose metrics lines a run starting at `start` keeps (-1: a fresh run keeps none)."""
        return -1 if self.resumed_from is None else start

    def running(self, start: int, notice: Callable[[str], None] | None = None) -> StopSignals:
        """The loop's context, from step `start`: signals become stop requests (`notice` says so)."""
        self.start, self._signals = start, StopSignals(notice)
        return self._signals

    def stop_requested(self, agree: bool = True) -> bool:
        """Whether to stop now: a signal was received (alone), or by any process of a group, which agree
        only where every process calls this with `agree` (a collective), so all stop after the same step."""
        import jax   # imported only here: this module is the CLI's too

        from composer_jax.parallel.distributed import any_process

        requested = self._signals.requested is not None
        self.stopping = requested if jax.process_count() == 1 else agree and any_process(requested)
        return self.stopping

    def stepped(self, step: int) -> None:
        """After step `step`: its checkpoint, every `every` steps and at the last."""
        if step % self.every == 0 or step == self.last:
            self._save(step)
            self.saved = step

    def finish(self, step: int) -> None:
        """At the loop's end: a stopped run saves the step it stopped after (when it trained one since
        its start); then waits until the last save is committed (while a signal still only asks to stop)."""
        if self.stopping and step > self.start and self.saved != step:
            self._save(step)
            self.saved = step
        self.checkpoints.wait()

    def interruption(self, step: int) -> dict:
        """The summary entries of a run a signal stopped before its last step (`interruption`), else none."""
        if not (self.stopping and step < self.last):
            return {}
        checkpoint = None if self.saved is None else str(self.checkpoints.directory / str(self.saved))
        return interruption(self._signals, checkpoint)


def interrupted_line(command: str, signal_name: str, step: int, checkpoint: str | None, argv) -> str:
    """The one line a stopped run prints: the signal, the step, the checkpoint to resume from (None: there
    is none yet) and the command that resumes."""
    kept = f"checkpoint {checkpoint} saved" if checkpoint else "no checkpoint yet (nothing trained to save)"
    return f"{command}: interrupted by {signal_name} at step {step}; {kept}; resume with: " \
           f"{shlex.join(['composer-jax', *argv])}"


def schedule_on_resume(cfg: RunConfig, saved: dict, step: int) -> tuple[RunConfig, str | None]:
    """`cfg` with the learning-rate schedule that continues a run checkpointed at `step` whose resolved
    config was `saved`, and a line saying what changed (None if nothing did).

    The same train.steps keeps the saved run's schedule (also one an earlier extension set). A different
    one, with steps left to run, needs `optimizer.on_extend`: "continue" keeps the old schedule (the rate
    stays decayed after its end), "restart" runs warmup-stable-decay again over steps step+1..train.steps;
    "refuse" (the default) is a ConfigError that says so."""
    from composer_jax.train.optimizer import wsd_schedule  # jax: imported only when needed


    saved_steps = saved["train"]["steps"]
    old = dataclasses.replace(cfg.optimizer, schedule_start=saved["optimizer"].get("schedule_start", 0),
                              schedule_end=saved["optimizer"].get("schedule_end", 0) or saved_steps)
    steps, choice = cfg.train.steps, cfg.optimizer.on_extend
    changed = steps != saved_steps and steps > step
    if changed and choice == "refuse":
        last_lr = float(wsd_schedule(old, saved_steps)(step - 1))
        raise ConfigError("optimizer.on_extend", f"the checkpoint at step {step} follows a schedule of {saved_steps} "
                                                 f"steps (last lr {last_lr:.3g}) and train.steps={steps} changes "
                                                 "it: pass optimizer.on_extend=continue to keep the decayed rate, or "
                                                 "optimizer.on_extend=restart to warm up and decay again over "
                                                 + (f"steps {step + 1}-{steps}" if steps > step + 1 else f"step {steps}"))
    if changed and choice == "restart":
        new = dataclasses.replace(cfg.optimizer, schedule_start=step, schedule_end=steps)
    else:
        new = old
    resumed = dataclasses.replace(cfg, optimizer=new)
    if not changed:
        return resumed, None
    next_lr = float(wsd_schedule(new, steps)(step))
    how = "restarting the schedule" if choice == "restart" else "continuing the schedule"
    return resumed, (f"train.steps {saved_steps} -> {steps} from step {step}: {how} (optimizer.on_extend={choice}); "
                     f"next lr {next_lr:.3g}")

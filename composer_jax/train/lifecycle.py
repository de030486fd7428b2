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
"""

from __future__ import annotations

import dataclasses
import shlex
import signal
import sys
import threading
from typing import Callable

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

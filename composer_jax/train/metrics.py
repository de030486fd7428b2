"""Run metrics: `RUN_DIR/metrics.jsonl` (one JSON object per line), TensorBoard event files, the progress
bar, and the MFU estimate.

Every train-step line has `step`, `time` and the step's metrics (`loss`, `ce`, `lr`, ...); the line of
each step where throughput is measured (every `log_every` steps) also has `tokens_per_s` and `mfu`.
Eval lines have `step` and `eval_loss` (plus `eval_mtp{k}_ce`). A resumed run first cuts the logs back
to its checkpoint's step (`MetricsWriter(keep_through=...)`), so each step is logged once.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

# Dense peak FLOP/s per device (bf16, no sparsity) by `device_kind` substring, from vendor datasheets.
PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12, "L4": 121e12,
    "TPU v6": 918e12, "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v4": 275e12,
}


def summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch: its writer module imports torch whenever it is
    installed (1.4 s of every run's start) only to accept torch tensors, and runs log Python floats. A torch
    already imported is left as it is."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None   # `import torch` raises ImportError, which tensorboardX expects
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def device_peak_flops(device) -> float | None:
    """Datasheet peak of a known accelerator, else None."""
    kind = getattr(device, "device_kind", "")
    for name, flops in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return flops
    return None


def measure_host_matmul_flops(size: int = 1024, repeats: int = 5) -> float:
    """The host CPU's float32 matmul throughput (FLOP/s) on one device: the MFU denominator on CPU."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((size, size), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        a = f(a) * (1.0 / size)  # keep values bounded
    a.block_until_ready()
    return 2 * size ** 3 * repeats / (time.perf_counter() - start)


def parse_lines(path: Path) -> list[dict]:
    """The records of a JSON-lines log (metrics.jsonl, rollouts.jsonl), skipping blank lines and a line cut
    short by a kill."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _latest_per_step(records: list[dict]) -> list[dict]:
    """The last record written per (step, train or eval), sorted by step, train line first."""
    latest = {}
    for rec in records:
        latest[(rec.get("step"), "eval_loss" in rec)] = rec
    return [latest[k] for k in sorted(latest, key=lambda k: (k[0] is None, k[0] or 0, k[1]))]


class MetricsWriter:
    """Writes each record as a JSON line of RUN_DIR/metrics.jsonl and as scalars of TensorBoard event
    files in RUN_DIR/tb.

    A run that continues from a checkpoint at step N passes `keep_through=N`: the records logged after
    N by the run that was stopped (and any duplicates) are dropped before anything is written, so both
    hold each step once. metrics.jsonl is the record of truth: it is rewritten with the kept lines, and
    the TensorBoard files are rebuilt from them (each scalar at its original wall time). A fresh start
    passes -1 and keeps nothing. `dropped`: how many records were dropped. Without a `run_dir` (the
    processes other than 0 of a group) it writes nothing.
    """

    def __init__(self, run_dir: str | Path | None, keep_through: int = -1, tensorboard: bool = True):
        self.dropped, self._jsonl, self._tb = 0, None, None
        if run_dir is None:
            return
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        logged = parse_lines(path) if path.exists() else []
        kept = [r for r in _latest_per_step(logged) if isinstance(r.get("step"), int) and r["step"] <= keep_through]
        self.dropped = len(logged) - len(kept)
        if self.dropped or (path.exists() and not path.read_bytes().endswith(b"\n")):
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(path)
        self._jsonl = open(path, "a", buffering=1)
        if tensorboard:
            tb_dir = self.run_dir / "tb"
            for old in tb_dir.glob("*tfevents*") if tb_dir.is_dir() else ():
                old.unlink()
            self._tb = summary_writer_class()(str(tb_dir), flush_secs=10)
            for rec in kept:
                self._scalars(rec)

    def _scalars(self, record: dict) -> None:
        for k, v in record.items():
            if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool):
                self._tb.add_scalar(k, v, record["step"], walltime=record.get("time"))

    def write(self, record: dict) -> None:
        """record: {"step": int, name: float, ...}; stamped with the wall time (`time`, Unix seconds);
        non-finite floats are written as null in JSON."""
        if self._jsonl is None:
            return
        record = {**record, "time": time.time()}
        clean = {k: (v if not (isinstance(v, float) and not math.isfinite(v)) else None) for k, v in record.items()}
        self._jsonl.write(json.dumps(clean) + "\n")
        if self._tb is not None:
            self._scalars(record)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The metrics.jsonl records, the last written per (step, kind) kept, sorted by step."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a training run directory?")
    return _latest_per_step(parse_lines(path))


class Progress:
    """A tqdm bar over steps showing loss, tokens/s, estimated MFU and (tqdm's) ETA; `status` labels the
    bar while nothing moves (e.g. "compiling" before the first step). Disabled: `write` prints.
    `note` writes a line for the user on stderr (where the bar is). Muted (the processes other than 0
    of a group): nothing at all."""

    def __init__(self, total: int, initial: int, enabled: bool, file=None, muted: bool = False):
        self._bar, self._muted = None, muted
        enabled = enabled and not muted
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=0.5,
                             file=file)

    def status(self, text: str) -> None:
        """Label the bar (shown at once); "" clears the label."""
        if self._bar is not None:
            self._bar.set_description_str(text, refresh=True)

    def update(self, steps: int, loss: float, tokens_per_s: float, mfu: float | None) -> None:
        if self._bar is None:
            return
        post = {"loss": f"{loss:.4f}", "tok/s": f"{tokens_per_s:,.0f}"}
        if mfu is not None:
            post["mfu"] = f"{100 * mfu:.2f}%"
        self._bar.set_postfix(post, refresh=False)
        self._bar.update(steps)

    def write(self, text: str, file=None) -> None:
        """A line above the bar, on `file` (default stdout)."""
        if self._muted:
            return
        if self._bar is not None:
            self._bar.write(text, file=file)
        else:
            print(text, file=file, flush=True)

    def note(self, text: str) -> None:
        self.write(text, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run_peak_flops(devices, per_device: float = 0.0) -> float:
    """The MFU denominator of a run on `devices`: `per_device` (the config's) or the datasheet peak
    times the device count; on CPU fake devices, which share the host's cores, the measured host."""
    if per_device:
        return per_device * len(devices)
    peak = device_peak_flops(devices[0])
    return peak * len(devices) if peak is not None else measure_host_matmul_flops()


class Throughput:
    """Tokens/s and MFU over the steps run since the last measurement. The first step of a run (which
    compiles) is timed on its own and reported as `first_step_s`; evaluations and checkpoints between
    measurements are excluded by `restart`."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak_flops: float):
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak_flops
        self.first_step_s: float | None = None
        self._start, self._steps = time.perf_counter(), 0

    def first_step(self) -> None:
        """Call once the first step's outputs are ready."""
        self.first_step_s = time.perf_counter() - self._start
        self.restart()

    def count(self) -> None:
        self._steps += 1

    def restart(self) -> None:
        self._start, self._steps = time.perf_counter(), 0

    def measure(self) -> tuple[float, float | None]:
        """(tokens/s, MFU or None) since the last measurement; restarts the clock."""
        elapsed = time.perf_counter() - self._start
        tps = (self.tokens_per_step * self._steps / elapsed if self._steps
               else self.tokens_per_step / (self.first_step_s or elapsed))
        self.restart()
        return tps, (tps * self.flops_per_token / self.peak if self.peak else None)

"""The training loop shared by pretraining, context extension and SFT.

`train(cfg)` lays the run out on the dual grid (`make_mesh`, `train.state.StateLayout`), builds the
data (`train.batches.Batches`), restores the latest checkpoint of `RUN_DIR/checkpoints` if there is
one (`train.checkpoints.RunCheckpoints`: params, optimizer state, step, router biases and the
data-iterator state, so the run continues exactly where it stopped), otherwise starts fresh or from
`train.init_from`'s params (context extension, SFT), then runs jitted, donated steps. Host
synchronisation happens only every `log_every` steps (metrics) and at evals and checkpoints. SIGINT or
SIGTERM stops the loop after the current step with a checkpoint of it (`train.lifecycle`). Everything
a run writes lives in RUN_DIR: `config.yaml` (resolved), `metrics.jsonl`, `tb/` (TensorBoard),
`skipped_records.log` and `checkpoints/`.

In a process group (parallel/distributed.py) every process runs this loop on its own share of the
data; the dual grid spans all processes' devices, process by process, so its leading axes (`replica`,
`ereplica`) cross hosts. Checkpoints are written by all processes together (orbax); config.yaml,
metrics, TensorBoard and the progress bar by process 0 only; each other process keeps its own
`skipped_records.process<i>.log`. A signal stops a group after the same step in every process: they
agree at the next log point (`train.log_every`), so each saves the same checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

import jax
import yaml

from composer_jax.config import ConfigError
from composer_jax.data.sources import resolve_root
from composer_jax.data.tokenizer import padded_token_bytes
from composer_jax.model_dirs import run_chat_setup, source_for, write_chat
from composer_jax.source_weights import load_state
from composer_jax.model.accounting import model_info
from composer_jax.parallel import DualMesh
from composer_jax.parallel.distributed import process_major_devices
from composer_jax.parallel.mesh import BATCH_AXES
from composer_jax.train import metrics as metrics_lib
from composer_jax.train import step as step_lib
from composer_jax.train.batches import Batches
from composer_jax.train.checkpoints import RunCheckpoints
from composer_jax.train.config import RunConfig, to_dict
from composer_jax.train.lifecycle import Lifecycle, schedule_on_resume
from composer_jax.train.state import StateLayout, TrainState

log = logging.getLogger(__name__)

SKIP_FILE = "skipped_records.log"  # every record the data pipeline skipped or truncated, in full


def make_mesh(cfg: RunConfig, devices=None) -> DualMesh:
    """The dual grid over `train.num_devices` devices (0 = all; all of them in a process group, ordered
    process by process), checked against the batch and model. `devices`: all of a GPU topology's
    instead, for a deviceless compile (plan/gpu_compile.py)."""
    topology = devices is not None
    devices = process_major_devices() if devices is None else list(devices)
    n = len(devices) if topology else cfg.train.num_devices or len(devices)
    if n > len(devices):
        raise ConfigError("train.num_devices", f"{n} devices requested, {len(devices)} available")
    if jax.process_count() > 1 and n != len(devices):
        raise ConfigError("train.num_devices", f"a group of {jax.process_count()} processes trains on all "
                                               f"{len(devices)} devices: set 0, not {n}")
    dual = DualMesh(cfg.mesh, devices[:n], model=cfg.model)
    data_parallel = math.prod(dual.sizes[a] for a in BATCH_AXES)
    micro = cfg.train.batch_size // cfg.train.grad_accum
    if micro % data_parallel:
        raise ConfigError("train.batch_size", f"the micro-batch of {micro} rows (batch_size {cfg.train.batch_size} "
                                              f"/ grad_accum {cfg.train.grad_accum}) does not split over the "
                                              f"{data_parallel} data-parallel shards of {dual}")
    if cfg.train.seq_len % (2 * dual.cp) and dual.cp > 1:
        raise ConfigError("train.seq_len", f"{cfg.train.seq_len} must be divisible by 2 * mesh.cp = {2 * dual.cp}")
    return dual


class Trainer:
    """One run: layout, data, state, compiled steps, checkpoints and metrics. `run()` trains to the end
    or until SIGINT / SIGTERM (then it saves a checkpoint and says so in its summary).

    Building it writes nothing to disk (a start that fails leaves no trace); `run()` creates RUN_DIR."""

    def __init__(self, cfg: RunConfig):
        self.run_dir = Path(cfg.run_dir)
        self.checkpoints = RunCheckpoints(self.run_dir / "checkpoints", cfg.checkpoint)
        try:
            self.life = Lifecycle(self.checkpoints, self.save, cfg.checkpoint.every, cfg.train.steps)
            self.source = None
            resumed = self.life.resumed_from
            if resumed is not None:
                cfg, change = schedule_on_resume(cfg, self.checkpoints.config(resumed), resumed)
                if change:
                    log.info(change)
            elif cfg.train.init_from:
                self.source = source_for(cfg.train.init_from, "train.init_from")
            self.cfg = cfg
            self.chat, tokenizer, fmt = run_chat_setup(
                self.run_dir if resumed is not None else None, self.source, cfg.data.tokenizer,
                cfg.data.chat_format, dataclasses.asdict(cfg.agent), cfg.model.vocab_size,
                ("data.tokenizer", "data.chat_format"))
            self.dual = make_mesh(cfg)
            self.batches = Batches(cfg, self.dual, tokenizer, fmt)
            self.layout = layout = StateLayout(cfg, self.dual)
            self.step_fn = jax.jit(step_lib.make_train_step(cfg, layout.graphdef, layout.rest, layout.opt),
                                   donate_argnums=0)
            self.eval_fn = jax.jit(step_lib.make_eval_step(cfg, layout.graphdef, layout.rest,
                                                           padded_token_bytes(tokenizer, cfg.model.vocab_size)))
            self.state = self._initial_state()
        except BaseException:
            self.checkpoints.close()
            raise

    def _initial_state(self) -> TrainState:
        resumed = self.life.resumed_from
        if resumed is not None:
            state, data_state = self.life.resume(self.layout.abstract)
            self.batches.restore(data_state)
            log.info("resuming from checkpoint %s (step %d of %d)", self.checkpoints.directory / str(resumed),
                     resumed, self.cfg.train.steps)
            return state
        if self.cfg.train.init_from:
            return self._load_init_params()
        return self.layout.fresh()

    def _load_init_params(self) -> TrainState:
        """Params and router biases from `train.init_from` (streamed into their shards); fresh optimizer and step."""
        abstract = self.layout.abstract
        params, biases = load_state(self.source, self.cfg.model, abstract.params, abstract.biases,
                                    seed=self.cfg.train.seed)
        log.info("initialised params from %s", self.source.description)
        return self.layout.from_params(params, biases)

    def evaluate(self) -> dict:
        """Held-out losses: eval_loss (main next-token CE, nats a token), eval_bpb (the same CE in bits a byte
        of the targets' text: comparable across tokenizers) and eval_mtp{k}_ce, over the eval batches."""
        sums = [self.eval_fn(self.state, b) for b in self.batches.eval_batches()]
        total = jax.device_get(jax.tree.map(lambda *x: sum(x), *sums))
        out = {"eval_loss": float(total["ce"] / max(total["targets"], 1.0)),
               "eval_bpb": float(total["ce"] / (math.log(2) * max(total["bytes"], 1.0)))}
        for k in range(1, self.cfg.model.mtp.num_layers + 1):
            out[f"eval_mtp{k}_ce"] = float(total[f"mtp{k}_ce"] / max(total[f"mtp{k}_targets"], 1.0))
        return out

    def save(self, step: int) -> None:
        self.checkpoints.save(step, self.state, self.batches.state(), to_dict(self.cfg))

    def _open_run_dir(self, start: int) -> metrics_lib.MetricsWriter:
        """Create RUN_DIR: the resolved config, the skip list, and the logs cut back to `start` (process 0;
        the others write only their skip lists and log nothing)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.batches.skips.write_to(self.skip_file, f"run from step {start}; data paths relative to "
                                                    f"{resolve_root(self.cfg.data.path)}")
        if jax.process_index() != 0:
            return metrics_lib.MetricsWriter(None)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(self.cfg), sort_keys=False))
        write_chat(self.run_dir, self.chat, self.batches.tokenizer)   # the run opens as a model source
        writer = metrics_lib.MetricsWriter(self.run_dir, keep_through=self.life.keep_through(start))
        if writer.dropped:
            resumed = self.life.resumed_from is not None
            where = f"after step {start}" if resumed else "by an earlier attempt (no checkpoint)"
            log.info("dropped %d metrics records logged %s", writer.dropped, where)
        return writer

    @property
    def skip_file(self) -> Path:
        """This process's list of skipped records (process 0: SKIP_FILE)."""
        index = jax.process_index()
        return self.run_dir / (SKIP_FILE if index == 0 else SKIP_FILE.replace(".log", f".process{index}.log"))

    def run(self) -> dict:
        """Train from the current step to `train.steps`, or until SIGINT / SIGTERM. Returns a summary
        (losses, timings; `interrupted`, `exit_status` and `checkpoint` when a signal stopped it)."""
        cfg, tc = self.cfg, self.cfg.train
        start = int(jax.device_get(self.state.step))
        writer = self._open_run_dir(start)
        throughput = metrics_lib.Throughput(tc.batch_size * tc.seq_len, model_info(cfg.model, tc.seq_len).flops.total,
                                            metrics_lib.run_peak_flops(list(self.dual.dense.devices.flat),
                                                                       tc.peak_flops))
        progress = metrics_lib.Progress(tc.steps, start, tc.progress, muted=jax.process_index() != 0)
        has_eval = self.batches.eval_data is not None
        summary = {"start_step": start, "steps": tc.steps, "skip_file": str(self.skip_file)}
        t_begin = time.perf_counter()
        pending, step, life = [], start, self.life

        def log_pending():
            host = jax.device_get([m for _, m in pending])
            tps, mfu = throughput.measure()
            for i, ((s, _), values) in enumerate(zip(pending, host)):
                record = {"step": s, **{k: float(v) for k, v in values.items()},
                          "skipped_records": self.batches.skips.total}
                if i == len(pending) - 1:  # throughput is measured over the group: one value, on its last step
                    record.update(tokens_per_s=tps, mfu=mfu)
                writer.write(record)
            progress.update(len(pending), float(host[-1]["loss"]), tps, mfu)
            summary["last_loss"] = float(host[-1]["loss"])
            pending.clear()

        def evaluate(at: int):
            ev = self.evaluate()
            writer.write({"step": at, **ev})
            summary["first_eval_loss" if at == 0 else "last_eval_loss"] = ev["eval_loss"]
            progress.write(f"step {at}: held-out loss {ev['eval_loss']:.4f} ({ev['eval_bpb']:.3f} bits per byte)")

        try:
            with life.running(start, progress.note), self.dual:
                if has_eval and start == 0:
                    progress.status("held-out eval (compiling)")
                    evaluate(0)
                progress.status("compiling the train step")
                throughput.restart()
                # In a group the processes agree on stopping at log points only.
                stopping = life.stop_requested(agree=False)
                while step < tc.steps and not stopping:
                    step += 1
                    self.state, m = self.step_fn(self.state, self.batches.next())
                    pending.append((step, m))
                    if step == start + 1:  # compilation: throughput is measured from the end of the first step
                        jax.block_until_ready(m)
                        throughput.first_step()
                        progress.status("")
                        summary["first_step_s"] = throughput.first_step_s
                    else:
                        throughput.count()
                    life.stepped(step)
                    logged = step % tc.log_every == 0 or step == tc.steps
                    if logged:
                        log_pending()
                    stopping = life.stop_requested(agree=logged)
                    if has_eval and (step % tc.eval_every == 0 or step == tc.steps) and not stopping:
                        evaluate(step)
                        throughput.restart()
                if stopping and pending:  # log the steps taken since the last log (finish saves the last one)
                    log_pending()
                life.finish(step)
            summary.update(wall_s=time.perf_counter() - t_begin, skipped_steps=int(jax.device_get(self.state.skipped)),
                           skipped_records=self.batches.skips.summary(), end_step=step, **life.interruption(step))
        finally:
            progress.close()
            writer.close()
            self.batches.skips.close()
            self.checkpoints.close()  # waits for the last save to be committed
        return summary


def train(cfg: RunConfig) -> dict:
    """Build a Trainer for `cfg` and run it to the end (resuming if RUN_DIR holds checkpoints)."""
    return Trainer(cfg).run()


def replace_run(cfg: RunConfig, **changes) -> RunConfig:
    """dataclasses.replace for nested sections: replace_run(cfg, train=dict(steps=5))."""
    updates = {k: dataclasses.replace(getattr(cfg, k), **v) if isinstance(v, dict) else v for k, v in changes.items()}
    return dataclasses.replace(cfg, **updates)

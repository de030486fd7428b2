"""`composer-jax rl`: the asynchronous agent RL loop.

    RLTrainer(cfg).run()

The learner (`rl.learner.Learner`: the fused, jitted RL step `rl.step.RLStep` on the dual grid) trains
batch i at policy version i while the rollout side (`rl.engines.Rollouts`: the producer thread
`rl.rollout.RolloutProducer` driving the inference engine through `agents.engine_agent.EngineAgent`,
or the engine processes) already samples the next ones with the
newest weights it has; no trained batch is older than `rl.max_staleness` versions (a batch that would
be is dropped and counted). After each step the learner copies its parameters device to device into
the engine's layout (`Engine.place_weights`) and publishes them; the engine installs them between
batches without recompiling. By default the engine shares the learner's devices; `rollout.devices=K`
puts it on its own K devices and the learner's dual grid on the rest; `rollout.transport=directory`
runs it in a process of its own (`composer-jax rl-engine`, `rl.exchange.engine_process`): the learner then
writes each version's parameters to the exchange directory and reads the batches from there
(`rl.exchange.learner_end.LearnerExchange`, the producer's calls).

Everything a run writes lives in RUN_DIR: `config.yaml`, `metrics.jsonl` + `tb/` (one line per step:
policy version, staleness, rewards and their components, pass rate, loss terms, KL, entropy,
tool-error rate, flagged turns, response length, tokens/s of rollout and learner, their overlap,
the engine's occupancy, the learner's wait for batches, dropped groups, the prompts trained on:
`rl.records`; `eval_pass@1` every `eval.every` steps: `rl.evaluator`), `monitor.jsonl`
(episodes the reward-hacking monitor flagged), `rollouts.jsonl` (the best, the worst and a random episode
of every `rl.log_rollouts_every`-th step, decoded: `rl.rollout_log`), `eval/step-N/` (held-out attempts) and `checkpoints/`
(learner state, policy version = step, the task sampler's state with its random generator). Killing
the run and starting the same command again continues from the last checkpoint: the sampler draws
again from where that checkpoint's batch left it, so no consumed prompt is trained on twice (the stop,
save and resume are pretraining's too: `train.lifecycle.Lifecycle`).
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import yaml

from composer_jax.config import to_dict
from composer_jax.envs import cut_examples, write_examples
from composer_jax.model_dirs import write_chat
from composer_jax.rl.engines import Rollouts, split_devices
from composer_jax.rl.evaluator import HeldOutEvaluator
from composer_jax.rl.learner import Learner
from composer_jax.rl.records import RunRecords
from composer_jax.rl.rollout import ProducedBatch
from composer_jax.rl.rollout_log import RolloutLog
from composer_jax.rl.run_config import RLRunConfig, resolve_run
from composer_jax.rl.task_sets import TaskSets, grow_pool, task_sets
from composer_jax.train import metrics as metrics_lib
from composer_jax.train.checkpoints import RunCheckpoints
from composer_jax.train.lifecycle import Lifecycle


class RLTrainer:
    """One RL run: tasks, the learner, the rollout side, the held-out evaluator, checkpoints and metrics.
    Building it writes nothing to disk but coding tasks made from `env.repo` (RUN_DIR/tasks); `run()`
    writes the rest. `tasks`: the task sets (default: those `cfg.env` describes)."""

    def __init__(self, cfg: RLRunConfig, tasks: TaskSets | None = None):
        setup = resolve_run(cfg)       # init_from, the tokenizer and chat format, env settings from the source
        self.cfg, self.run_dir, self.chat, self.tokenizer = setup.cfg, Path(cfg.run_dir), setup.chat, setup.tokenizer
        cfg = self.cfg
        self.tasks = tasks if tasks is not None else task_sets(cfg.env, cfg.seed, cfg.run_dir)
        self.pool = grow_pool(cfg.env, self.tasks, cfg.seed, cfg.run_dir)   # its tasks so far join the set
        self.checkpoints = RunCheckpoints(self.run_dir / "checkpoints", cfg.checkpoint)
        try:
            self.life = Lifecycle(self.checkpoints, self._save, cfg.checkpoint.every, cfg.rl.steps)
            cfg.check_processes(jax.process_count())
            learner_devices, engine_devices = split_devices(cfg)
            self.learner = Learner(cfg, setup.source, learner_devices)
            saved = None if self.life.resumed_from is None else self.learner.resume(self.life)
            self.rollouts = Rollouts(cfg, self.tasks, self.pool, self.tokenizer, self.learner, engine_devices, saved)
            self.evaluator = HeldOutEvaluator(cfg, self.tasks, self.run_dir, self.tokenizer, self.rollouts.agent)
        except BaseException:
            self.checkpoints.close()
            raise

    def _save(self, step: int) -> None:
        self.checkpoints.save(step, self.learner.state, self.rollouts.checkpoint_data(), to_dict(self.cfg))

    def _open_run_dir(self, start: int, lead: bool) -> metrics_lib.MetricsWriter:
        """RUN_DIR's config, chat settings (the run opens as a model source) and logs cut back to `start`
        (the rollout log too: `self.rollout_log`); in a process group process 0 alone writes (`lead`)."""
        keep_through = self.life.keep_through(start)     # each step's lines once
        if lead:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(self.cfg), sort_keys=False))
            write_chat(self.run_dir, self.chat, self.tokenizer)
            cut_examples(self.run_dir / "monitor.jsonl", keep_through)
        self.rollout_log = RolloutLog(self.run_dir if lead else None, keep_through)
        return metrics_lib.MetricsWriter(self.run_dir if lead else None, keep_through=keep_through)

    def run(self) -> dict:
        """Train from the current policy version to rl.steps, or until SIGINT / SIGTERM (then save and
        say so in the summary: `interrupted`, `exit_status`, `checkpoint`)."""
        cfg, start = self.cfg, self.learner.version
        lead = jax.process_index() == 0     # in a process group, process 0 alone writes and shows progress
        writer = self._open_run_dir(start, lead)
        progress = metrics_lib.Progress(cfg.rl.steps, start, cfg.progress, muted=not lead)
        if self.pool is not None:
            self.pool.log = progress.write
        records = RunRecords(start, cfg.rl.steps)
        progress.status("compiling the engine and the RL step" if not self.rollouts.remote else
                        f"compiling the RL step; batches from `composer-jax rl-engine` via {cfg.rollout.exchange_dir}")
        try:
            self.rollouts.start(start, self.learner)    # inside: a failure here still stops the engine
            with self.life.running(start, progress.note), self.learner.dual:
                step = start
                # In a group every process stops after the same step (a signal may reach only some).
                while step < cfg.rl.steps and not self.life.stop_requested():
                    waited = time.time()
                    produced = self.rollouts.next_batch()
                    stale = records.arrived(produced, step, cfg.rl.max_staleness, (waited, time.time()))
                    if stale is None:   # never trained on
                        continue
                    step += 1
                    record = records.record(step, produced, stale, *self._train(produced, step))
                    self._log(step, record, produced, writer, progress, lead)
                    self.life.stepped(step)
                self.life.finish(step)
            return {**records.summary(step), **self.life.interruption(step)}
        finally:
            self._close(progress, writer)

    def _train(self, produced: ProducedBatch, version: int) -> tuple[dict, tuple[float, float]]:
        """Train on `produced` and publish the weights of `version`: the step's host metrics and the
        time.time() interval the learner took."""
        began = time.time()
        metrics = self.learner.train(produced.batch)
        self.rollouts.publish(self.learner, version)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        return metrics, (began, time.time())

    def _log(self, step: int, record: dict, produced: ProducedBatch, writer, progress, lead: bool) -> None:
        """The step's monitor reports, its picked episodes (when the rollout side logged its batch's), its
        held-out evaluation when due, its metrics line and progress."""
        if lead:
            write_examples(self.run_dir / "monitor.jsonl", [r for _, r in produced.reports], step=step,
                           episode_ids=[k for k, _ in produced.reports])
        self.rollout_log.write(step, produced.samples)
        if self.evaluator.due(step):
            record.update(self.evaluator(step, self.learner))
            progress.write(f"step {step}: held-out pass@1 {record['eval_pass@1']:.3f}")
        writer.write(record)
        progress.update(1, record["loss"], record["learner_tokens_per_s"], None)
        progress.status(f"reward {record.get('reward_mean', 0.0):.3f}, learner waits "
                        f"{100 * record['learner_wait_fraction']:.0f}%")

    def _close(self, progress, writer) -> None:
        self.rollouts.stop()
        if self.pool is not None:
            self.pool.close()
        if self.rollouts.agent is not None:
            self.rollouts.agent.close()
        self.evaluator.close()
        progress.close()
        writer.close()
        self.checkpoints.close()


def train_rl(cfg: RLRunConfig) -> dict:
    """Build an RLTrainer for `cfg` and run it (resuming if RUN_DIR holds checkpoints)."""
    return RLTrainer(cfg).run()

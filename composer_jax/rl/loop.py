"""`composer-jax rl`: the asynchronous agent RL loop.

    RLTrainer(cfg).run()

The learner (the fused, jitted RL step `rl.step.RLStep` on the dual grid) trains batch i at policy
version i while the rollout producer (`rl.rollout.RolloutProducer`, a background thread driving the
inference engine through `agents.engine_agent.EngineAgent`) already samples the next ones with the
newest weights it has; no trained batch is older than `rl.max_staleness` versions (a batch that would
be is dropped and counted). After each step the learner copies its parameters device to device into
the engine's layout (`Engine.place_weights`) and publishes them; the engine installs them between
batches without recompiling. By default the engine shares the learner's devices; `rollout.devices=K`
puts it on its own K devices and the learner's dual grid on the rest; `rollout.transport=directory`
runs it in a process of its own (`composer-jax rl-engine`, `rl.remote_engine`): the learner then
writes each version's parameters to the exchange directory and reads the batches from there
(`rl.exchange.LearnerExchange`, the producer's calls).

Everything a run writes lives in RUN_DIR: `config.yaml`, `metrics.jsonl` + `tb/` (one line per step:
policy version, staleness, rewards and their components, pass rate, loss terms, KL, entropy,
tool-error rate, flagged turns, response length, tokens/s of rollout and learner, their overlap,
dropped groups, the prompts trained on; `eval_pass@1` every `eval.every` steps), `monitor.jsonl`
(episodes the reward-hacking monitor flagged), `eval/step-N/` (held-out attempts) and `checkpoints/`
(learner state, policy version = step, the task sampler's state with its random generator). Killing
the run and starting the same command again continues from the last checkpoint: the sampler draws
again from where that checkpoint's batch left it, so no consumed prompt is trained on twice.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jax
import numpy as np
import yaml
from flax import nnx

from composer_jax.config import ConfigError, MeshConfig, to_dict
from composer_jax.envs import cut_examples, write_examples
from composer_jax.eval import EvalConfig, evaluate
from composer_jax.agents.engine_agent import EngineAgent
from composer_jax.model import CausalLM
from composer_jax.model_dirs import write_chat
from composer_jax.parallel import DualMesh, shard_model
from composer_jax.parallel.distributed import any_process, process_major_devices
from composer_jax.rl.exchange import LearnerExchange, engine_settings
from composer_jax.rl.ingest import data_shards, process_rows
from composer_jax.rl.reference import ReferencePolicy
from composer_jax.rl.rollout import ProducedBatch, RolloutProducer, engine_agent, engine_sampling
from composer_jax.rl.run_config import RLRunConfig, resolve_run
from composer_jax.rl.step import RLStep
from composer_jax.rl.task_sets import TaskSets, grow_pool, task_sets
from composer_jax.source_weights import load_model
from composer_jax.train import metrics as metrics_lib
from composer_jax.train.checkpoints import RunCheckpoints
from composer_jax.train.lifecycle import StopSignals, interruption

log = logging.getLogger(__name__)


def engine_states(data: dict, engines: int) -> list[dict]:
    """Each engine's {"sampler", "groups"} from a checkpoint's data (one engine: the dict itself)."""
    states = data["engines"] if "engines" in data else [data]
    if len(states) != engines:
        raise ConfigError("rollout.engines", f"the checkpoint holds the task sampling of {len(states)} engine(s), not "
                                             f"{engines}: resume with rollout.engines={len(states)}")
    return states


def split_devices(cfg: RLRunConfig) -> tuple[list, list | None]:
    """(learner devices, engine devices or None when the engine shares the learner's); in a process group
    every process's devices, process by process (the data axes span hosts)."""
    devices = process_major_devices()
    k = cfg.rollout.devices
    if not k:
        return devices, None
    if k >= len(devices):
        raise ConfigError("rollout.devices", f"{k} engine devices of {len(devices)} leave none for the learner")
    return devices[:-k], devices[-k:]


class Overlap:
    """Time during which rollout production and learning both ran, from `origin` on (the end of the
    first learner step, which compiles: the steady state). Each interval is clipped to the origin and
    intersected with the other side's intervals known when it arrives, so every pair counts once."""

    def __init__(self):
        self.sides: dict[str, list[tuple[float, float]]] = {"rollout": [], "learner": []}
        self.both, self.origin = 0.0, None

    def _clip(self, interval: tuple[float, float]) -> tuple[float, float]:
        start = interval[0] if self.origin is None else max(interval[0], self.origin)
        return start, max(start, interval[1])

    def add(self, side: str, interval: tuple[float, float]) -> None:
        a, b = self._clip(interval)
        other = self.sides["learner" if side == "rollout" else "rollout"]
        self.both += sum(max(0.0, min(b, d) - max(a, c)) for c, d in other)
        self.sides[side].append((a, b))

    def start(self, origin: float) -> None:
        """Count from `origin` on (what was recorded before is clipped to it)."""
        known, self.origin = self.sides, origin
        self.sides, self.both = {"rollout": [], "learner": []}, 0.0
        for side, intervals in known.items():
            for interval in intervals:
                self.add(side, interval)

    def fractions(self, now: float) -> dict[str, float]:
        """Of the wall time since the origin: both busy, rollout busy, learner busy."""
        wall = max(now - (self.origin if self.origin is not None else now), 1e-9)
        busy = {side: sum(b - a for a, b in intervals) / wall for side, intervals in self.sides.items()}
        return {"overlap_fraction": self.both / wall, "rollout_busy_fraction": busy["rollout"],
                "learner_busy_fraction": busy["learner"]}


def _staleness(produced: ProducedBatch, version: int) -> np.ndarray:
    """Per trained row: the policy version now minus the oldest version among its tokens."""
    oldest = produced.row_versions[0]
    return version - oldest[oldest >= 0]


class RLTrainer:
    """One RL run: tasks, learner, engine, producer, checkpoints and metrics. Building it writes nothing
    to disk but coding tasks made from `env.repo` (RUN_DIR/tasks); `run()` writes the rest. `tasks`: the task sets (default: those `cfg.env` describes)."""

    def __init__(self, cfg: RLRunConfig, tasks: TaskSets | None = None):
        setup = resolve_run(cfg)       # init_from, the tokenizer and chat format, env settings from the source
        self.cfg, self.run_dir, self.source, self.chat = setup.cfg, Path(cfg.run_dir), setup.source, setup.chat
        self.tokenizer = setup.tokenizer
        cfg = self.cfg
        self.tasks = tasks if tasks is not None else task_sets(cfg.env, cfg.seed, cfg.run_dir)
        self.pool = grow_pool(cfg.env, self.tasks, cfg.seed, cfg.run_dir)   # its tasks so far join the set
        self.checkpoints = RunCheckpoints(self.run_dir / "checkpoints", cfg.checkpoint)
        try:
            self._build()
        except BaseException:
            self.checkpoints.close()
            raise

    def _build(self) -> None:
        cfg = self.cfg
        self.resumed_from = self.checkpoints.latest_step()
        cfg.check_processes(jax.process_count())
        learner_devices, engine_devices = split_devices(cfg)
        self.dual = DualMesh(cfg.mesh, learner_devices, model=cfg.model)
        shards = data_shards(self.dual)
        if cfg.rollout.batch_size % shards or (cfg.rl.micro_batch or cfg.rollout.batch_size) % shards:
            raise ConfigError("rollout.batch_size", f"{cfg.rollout.batch_size} rows (micro-batches of "
                                                    f"{cfg.rl.micro_batch or cfg.rollout.batch_size}) do not split "
                                                    f"over the learner's {shards} data-parallel shards")
        with self.dual:
            model = self._initial_model()
            self.reference = ReferencePolicy(model, cfg.rl.loss_chunk) if cfg.rl.kl_coef > 0 else None
            self.rl_step = RLStep(model, cfg.rl)
            self.state = self.rl_step.init_state(model)
            data = None
            if self.resumed_from is not None:
                abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                        self.state)
                self.checkpoints.check_model(abstract, "run_dir")
                self.state, data = self.checkpoints.restore(abstract)
        # Each engine's sampler and group state (one engine: the in-process producer's, `self.sampler`).
        saved = [None] * cfg.rollout.engines if data is None else engine_states(data, cfg.rollout.engines)
        sampling = [engine_sampling(cfg, self.tasks.train, k, state) for k, state in enumerate(saved)]
        self.sampler, self.groups = sampling[0]
        self.engine_states = [{"sampler": sampler.state_dict(), "groups": groups.state_dict()}
                              for sampler, groups in sampling]
        self.remote = cfg.rollout.transport == "directory"
        # With the directory transport the engine runs elsewhere; an engine for the held-out evaluation is
        # built here when one runs.
        self.agent = None if self.remote else self._engine_agent(model, engine_devices)

    def _initial_model(self) -> CausalLM:
        """The policy RL starts from, on the learner's grid: init_from's weights (streamed into their shards;
        again on a resumed run, as the KL reference and the fixed teacher), else a fresh model."""
        cfg = self.cfg
        if self.source is not None:
            return load_model(self.source, cfg.model, self.dual, seed=cfg.seed)
        return shard_model(CausalLM(cfg.model, rngs=nnx.Rngs(cfg.seed)), self.dual)

    def _engine_agent(self, source: CausalLM, engine_devices: list | None = None) -> EngineAgent:
        """The in-process engine: on the learner's devices (over `source`, the learner's model), or on
        its own (a fresh model placed there); it starts with a copy of the learner's current weights."""
        if engine_devices is not None:      # the engine's own grid; its weights come from the learner below
            source = CausalLM(self.cfg.model, rngs=nnx.Rngs(self.cfg.seed))
            shard_model(source, DualMesh(MeshConfig(), engine_devices, model=self.cfg.model))
        agent = engine_agent(self.cfg, self.tokenizer, source)
        # A copy of the learner's current weights (restored, or the source's): its arrays are donated by the steps.
        agent.update_weights(agent.engine.place_weights(self._policy()), self.version)
        return agent

    @property
    def version(self) -> int:
        return int(jax.device_get(self.state.step))

    def _policy(self) -> CausalLM:
        return nnx.merge(self.rl_step.graphdef, self.state.params, self.state.biases, self.rl_step.rest)

    def _evaluate(self, step: int) -> dict:
        held_out = self.tasks.held_out
        if self.remote:
            if self.agent is None:
                self.agent = self._engine_agent(self._policy())
            else:
                self.agent.update_weights(self.agent.engine.place_weights(self._policy()), self.version)
        summary = evaluate(self.agent, held_out, self.run_dir / "eval" / f"step-{step}",
                           EvalConfig(samples=1, workers=min(len(held_out), self.cfg.rollout.max_slots),
                                      max_turns=self.cfg.env.max_turns, seed=self.cfg.seed),
                           make_env=self.tasks.make_env)
        return {"eval_pass@1": summary.scores["pass@1"].value, "eval_version": float(self.agent.version)}

    def _rollouts(self, start: int) -> RolloutProducer | LearnerExchange:
        """Where batches come from: the producer thread, or the engine process through the exchange directory
        (the engines start from these sampler and group states)."""
        if self.remote:
            r = self.cfg.rollout
            return LearnerExchange(r.exchange_dir, start_index=start, engine_states=list(self.engine_states),
                                   timeout_s=r.engine_timeout_s,
                                   settings=engine_settings(self.cfg), weight_transfer=r.weight_transfer)
        return RolloutProducer(self.agent, self.tasks.train, self.tasks.make_env, self.sampler, self.groups, self.cfg,
                               start_index=start, workspace=self.tasks.workspace, pool=self.pool)

    def _save(self, step: int) -> None:
        states = self.engine_states
        self.checkpoints.save(step, self.state, states[0] if len(states) == 1 else {"engines": states},
                              to_dict(self.cfg))

    def run(self) -> dict:
        """Train from the current policy version to rl.steps, or until SIGINT / SIGTERM (then save and
        say so in the summary: `interrupted`, `exit_status`, `checkpoint`)."""
        cfg = self.cfg
        start = step = self.version
        lead = jax.process_index() == 0     # in a process group, process 0 alone writes and shows progress
        keep_through = -1 if self.resumed_from is None else start    # each step's lines once
        if lead:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            write_chat(self.run_dir, self.chat, self.tokenizer)   # the run opens as a model source
            cut_examples(self.run_dir / "monitor.jsonl", keep_through)
        writer = metrics_lib.MetricsWriter(self.run_dir if lead else None, keep_through=keep_through)
        progress = metrics_lib.Progress(cfg.rl.steps, start, cfg.progress, muted=not lead)
        producer = self._rollouts(start)
        if self.pool is not None:
            self.pool.log = progress.write
        overlap, rewards, dropped_stale = Overlap(), [], 0
        summary = {"start_step": start, "steps": cfg.rl.steps}
        saved, trained = self.resumed_from, False
        t_begin = time.perf_counter()
        progress.status("compiling the engine and the RL step" if not self.remote else
                        f"compiling the RL step; batches from `composer-jax rl-engine` via {cfg.rollout.exchange_dir}")
        producer.start()
        try:
            if self.remote:     # inside: a failure here still stops the engine (`finally`)
                producer.publish(nnx.state(self._policy()), start)
            with StopSignals(progress.note) as stop, self.dual:
                # In a group every process stops after the same step (a signal may reach only some).
                stopped = False
                while step < cfg.rl.steps and not (stopped := any_process(stop.requested is not None)):
                    produced = producer.next_batch()
                    # Where its engine's sampler stands (a checkpoint resumes each engine from there).
                    self.engine_states[produced.index % cfg.rollout.engines] = {
                        "sampler": produced.sampler_state, "groups": produced.group_counts}
                    overlap.add("rollout", produced.busy)
                    stale = _staleness(produced, step)
                    if stale.size and stale.max() > cfg.rl.max_staleness:   # never trained on
                        dropped_stale += 1
                        continue
                    began = time.time()
                    batch = jax.tree.map(process_rows, produced.batch)     # this process's groups
                    batch = batch if self.reference is None else self.reference.annotate(batch)
                    self.state, step_metrics = self.rl_step(self.state, batch)
                    # A copy before the next step donates the arrays: on the host (directory) or in the engine's layout.
                    producer.publish(nnx.state(self._policy()) if self.remote else
                                     jax.block_until_ready(self.agent.engine.place_weights(self._policy())), step + 1)
                    step_metrics = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
                    ended = time.time()
                    overlap.add("learner", (began, ended))
                    if step == start:
                        overlap.start(ended)
                    step += 1
                    step_metrics["batch_reward_mean"] = step_metrics.pop("reward_mean")   # padding rows included
                    record = {"step": step, "policy_version": step, **produced.metrics, **step_metrics,
                              "staleness_mean": float(stale.mean()) if stale.size else 0.0,
                              "staleness_max": float(stale.max()) if stale.size else 0.0,
                              "batch_version_min": float(produced.row_versions[0][produced.row_versions[0] >= 0].min(
                                  initial=step - 1)),
                              "learner_s": ended - began,
                              "learner_tokens_per_s": step_metrics["tokens"] / max(ended - began, 1e-9),
                              **overlap.fractions(ended),
                              "dropped_stale_batches": float(dropped_stale),
                              "batch_draws": produced.draws,
                              "trained_draws": [p.draw for p in produced.trained],
                              "trained_tasks": [p.task_id for p in produced.trained],
                              "feedback_only_draws": produced.feedback_only}
                    if lead:
                        write_examples(self.run_dir / "monitor.jsonl", [r for _, r in produced.reports], step=step,
                                       episode_ids=[k for k, _ in produced.reports])
                    if cfg.eval.every and self.tasks.held_out and (step % cfg.eval.every == 0 or step == cfg.rl.steps):
                        record.update(self._evaluate(step))
                        progress.write(f"step {step}: held-out pass@1 {record['eval_pass@1']:.3f}")
                    writer.write(record)
                    rewards.append(record.get("reward_mean", 0.0))
                    progress.update(1, record["loss"], record["learner_tokens_per_s"], None)
                    progress.status(f"reward {record.get('reward_mean', 0.0):.3f}")
                    trained = True
                    if step % cfg.checkpoint.every == 0 or step == cfg.rl.steps:
                        self._save(step)
                        saved = step
                if stopped and trained and saved != step:
                    self._save(step)
                    saved = step
                self.checkpoints.wait()
            wall = time.perf_counter() - t_begin
            fifth = max(1, len(rewards) // 5)
            summary.update(end_step=step, wall_s=wall, dropped_stale_batches=dropped_stale,
                           overlap_fraction=overlap.fractions(time.time())["overlap_fraction"])
            if rewards:
                summary.update(first_fifth_reward=float(np.mean(rewards[:fifth])),
                               last_fifth_reward=float(np.mean(rewards[-fifth:])))
            if stopped and step < cfg.rl.steps:
                checkpoint = None if saved is None else str(self.checkpoints.directory / str(saved))
                summary.update(interruption(stop, checkpoint))
        finally:
            producer.stop()
            if self.pool is not None:
                self.pool.close()
            if self.agent is not None:
                self.agent.close()
            progress.close()
            writer.close()
            self.checkpoints.close()
        return summary


def train_rl(cfg: RLRunConfig) -> dict:
    """Build an RLTrainer for `cfg` and run it (resuming if RUN_DIR holds checkpoints)."""
    return RLTrainer(cfg).run()

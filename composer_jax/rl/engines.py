"""The rollout side of the RL run: the engines' task sampling state (what a checkpoint keeps), the
in-process engine, and where batches come from: the producer thread (`rl.rollout.RolloutProducer`)
or, with `rollout.transport=directory`, the engine processes through the exchange directory
(`rl.exchange.LearnerExchange`).

    rollouts = Rollouts(cfg, tasks, pool, tokenizer, learner, engine_devices, saved)
    rollouts.start(version, learner)     # the producer or the exchange, from this policy version
    produced = rollouts.next_batch()     # a ProducedBatch; its engine's sampling state is kept
    rollouts.publish(learner, version)   # the learner's new weights, for the next batches
"""

from __future__ import annotations

import jax
from flax import nnx

from composer_jax.agents.engine_agent import EngineAgent
from composer_jax.config import ConfigError
from composer_jax.infer.generate import engine_grids
from composer_jax.model import CausalLM
from composer_jax.model.moe import routed_expert_paths
from composer_jax.model.quant import quantize_experts
from composer_jax.parallel import shard_model
from composer_jax.parallel.distributed import process_major_devices
from composer_jax.rl.exchange.learner_end import LearnerExchange
from composer_jax.rl.exchange.settings import engine_settings
from composer_jax.rl.exchange.transport_device import flat_parameters
from composer_jax.rl.rollout import ProducedBatch, RolloutProducer, engine_agent, engine_sampling
from composer_jax.rl.run_config import RLRunConfig
from composer_jax.rl.task_sets import TaskSets


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


def policy_engine(cfg: RLRunConfig, tokenizer, learner, engine_devices: list | None = None) -> EngineAgent:
    """An in-process engine over the learner's policy: on the learner's devices, or on its own (a fresh
    model placed there; also on the learner's devices when it runs another model, `cfg.engine_model()`: INT4
    experts); it starts with a copy of the learner's current weights and version."""
    source, model = learner.policy(), cfg.engine_model()
    if engine_devices is not None or model != cfg.model:   # its weights come from the learner below
        devices = engine_devices if engine_devices is not None else list(learner.dual.dense.devices.flat)
        source = CausalLM(model, rngs=nnx.Rngs(cfg.seed))
        shard_model(source, engine_grids(model, devices))
    agent = engine_agent(cfg, tokenizer, source)
    # A copy of the learner's current weights (restored, or the source's): its arrays are donated by the steps.
    agent.update_weights(agent.engine.place_weights(learner.policy()), learner.version)
    return agent


def offered_weights(cfg: RLRunConfig, learner) -> nnx.State | dict:
    """The learner's weights as engine processes take them: for INT4 engines (`cfg.engine_model(k)`) the
    routed experts quantized here, on the learner's own shards, so a version moves and lands as INT4 (4.5
    bits a routed weight), not as the float weights an engine would quantize after holding them all. With
    engines of both kinds, both: {parameter name: array} with the float experts and their INT4 words and
    scales (other names), each engine taking its own."""
    policy = learner.policy()
    int4 = {cfg.engine_model(k).moe.expert_quant == "int4" for k in range(cfg.rollout.engines)}
    state = nnx.state(policy)
    if int4 == {False}:
        return state
    quantized = quantize_experts(nnx.to_flat_state(state), routed_expert_paths(policy))
    return quantized if int4 == {True} else {**flat_parameters(state), **flat_parameters(quantized)}


class Rollouts:
    """Where the run's batches come from, and the sampling state of each engine. `saved`: a checkpoint's
    data (None: every engine samples from the start). With the directory transport the engines run
    elsewhere and `agent` is None; else `agent` is the in-process engine (on `engine_devices`, or the
    learner's)."""

    def __init__(self, cfg: RLRunConfig, tasks: TaskSets, pool, tokenizer, learner,
                 engine_devices: list | None, saved: dict | None):
        self.cfg, self.tasks, self.pool = cfg, tasks, pool
        engines = cfg.rollout.engines
        sampling = [engine_sampling(cfg, tasks.train, k, state) for k, state in
                    enumerate([None] * engines if saved is None else engine_states(saved, engines))]
        self.sampler, self.groups = sampling[0]     # the in-process producer's
        self.states = [{"sampler": sampler.state_dict(), "groups": groups.state_dict()} for sampler, groups in sampling]
        self.remote = cfg.rollout.transport == "directory"
        self.agent = None if self.remote else policy_engine(cfg, tokenizer, learner, engine_devices)
        self.source: RolloutProducer | LearnerExchange | None = None

    def start(self, version: int, learner) -> None:
        """Start producing batches for policy versions `version` on (the engines start from the kept
        sampling states); an engine process gets the learner's current weights first."""
        if self.remote:
            r = self.cfg.rollout
            self.source = LearnerExchange(r.exchange_dir, start_index=version, engine_states=list(self.states),
                                          timeout_s=r.engine_timeout_s, settings=engine_settings(self.cfg),
                                          weight_transfer=r.weight_transfer)
        else:
            self.source = RolloutProducer(self.agent, self.tasks.train, self.tasks.make_env, self.sampler,
                                          self.groups, self.cfg, start_index=version,
                                          workspace=self.tasks.workspace, pool=self.pool)
        self.source.start()
        if self.remote:
            self.source.publish(offered_weights(self.cfg, learner), version)

    def next_batch(self) -> ProducedBatch:
        """The next batch, its engine's sampling state kept (a checkpoint resumes each engine from there)."""
        produced = self.source.next_batch()
        self.states[produced.index % self.cfg.rollout.engines] = {"sampler": produced.sampler_state,
                                                                   "groups": produced.group_counts}
        return produced

    def publish(self, learner, version: int) -> None:
        """The learner's weights of `version`: a copy, before the next step donates the arrays (on the host
        for the exchange, in the engine's layout for the producer)."""
        self.source.publish(offered_weights(self.cfg, learner) if self.remote else
                            jax.block_until_ready(self.agent.engine.place_weights(learner.policy())), version)

    def checkpoint_data(self) -> dict:
        """What a checkpoint keeps of the rollout side: the engines' sampling states."""
        return self.states[0] if len(self.states) == 1 else {"engines": self.states}

    def stop(self) -> None:
        """Stop the producer (its episodes end) or the exchange (the engine processes are told)."""
        if self.source is not None:
            self.source.stop()

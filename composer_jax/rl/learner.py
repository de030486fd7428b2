"""The RL learner: the policy's training state on its dual grid, the fused RL step (`rl.step.RLStep`),
the KL reference, and what a checkpoint restores.

    learner = Learner(cfg, source, devices)
    engine_data = learner.resume(life)             # a resumed run: the state and the engines' sampling
    metrics = learner.train(produced.batch)        # one step: policy version + 1 (its metrics on the devices)
    learner.policy()                               # the current policy, a CausalLM over the state's arrays
"""

from __future__ import annotations

import jax
from flax import nnx

from composer_jax.config import ConfigError
from composer_jax.model import CausalLM
from composer_jax.parallel import DualMesh, shard_model
from composer_jax.rl.ingest import data_shards, process_rows
from composer_jax.rl.reference import ReferencePolicy
from composer_jax.rl.run_config import RLRunConfig
from composer_jax.rl.step import RLStep
from composer_jax.source_weights import load_model


class Learner:
    """The policy under training on `devices` (its dual grid, `dual`): from `source`'s weights (a model
    source, streamed into their shards; also the KL reference and the fixed teacher), else a fresh model."""

    def __init__(self, cfg: RLRunConfig, source, devices: list):
        self.cfg = cfg
        self.dual = DualMesh(cfg.mesh, devices, model=cfg.model)
        shards, rows = data_shards(self.dual), cfg.rollout.batch_size
        if rows % shards or (cfg.rl.micro_batch or rows) % shards:
            raise ConfigError("rollout.batch_size", f"{rows} rows (micro-batches of {cfg.rl.micro_batch or rows}) "
                                                    f"do not split over the learner's {shards} data-parallel shards")
        with self.dual:
            model = self._initial_model(source)
            self.reference = ReferencePolicy(model, cfg.rl.loss_chunk) if cfg.rl.kl_coef > 0 else None
            self.rl_step = RLStep(model, cfg.rl)
            self.state = self.rl_step.init_state(model)

    def _initial_model(self, source) -> CausalLM:
        if source is not None:
            return load_model(source, self.cfg.model, self.dual, seed=self.cfg.seed)
        return shard_model(CausalLM(self.cfg.model, rngs=nnx.Rngs(self.cfg.seed)), self.dual)

    def resume(self, life) -> dict:
        """Restore the latest checkpoint of `life` (train.lifecycle.Lifecycle); returns its data (the
        engines' sampling state)."""
        with self.dual:
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)
            self.state, data = life.resume(abstract)
        return data

    @property
    def version(self) -> int:
        """The policy version: the steps trained."""
        return int(jax.device_get(self.state.step))

    def policy(self) -> CausalLM:
        """The current policy over the state's arrays (the next step donates them: copy what must outlive it)."""
        return nnx.merge(self.rl_step.graphdef, self.state.params, self.state.biases, self.rl_step.rest)

    def train(self, batch) -> dict:
        """One RL step on `batch` (a RolloutBatch of every process's groups; this process's go in),
        annotated by the KL reference when there is one. Returns the step's metrics on the devices (still
        computing: fetch them once the new weights are published)."""
        batch = jax.tree.map(process_rows, batch)
        batch = batch if self.reference is None else self.reference.annotate(batch)
        self.state, metrics = self.rl_step(self.state, batch)
        return metrics

"""The training loop shared by pretraining, context extension and SFT.

`train(cfg)` builds the data pipelines (train split, repeating; held-out split, one pass), the
optimizer and the train state, restores the latest checkpoint of `RUN_DIR/checkpoints` if there is one
(params, optimizer state, step, router biases and the data-iterator state: the run continues exactly
where it stopped), otherwise starts fresh or from `train.init_from`'s params (context extension, SFT),
then runs jitted, donated steps. Host synchronisation happens only every `log_every` steps (metrics)
and at evals and checkpoints. Everything a run writes lives in RUN_DIR: `config.yaml` (resolved),
`metrics.jsonl`, `tb/` (TensorBoard) and `checkpoints/`.

Parallelism is the dual grid of `composer_jax.parallel` (`mesh.*` in the run config): batches are
sharded over the dense mesh's data axes, params and router biases by the logical-axis rules, optimizer
state like its parameter. `state_shardings` is the one place that decides where state lives, and
checkpoints restore onto whatever it returns, so a run may resume on another mesh layout.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import yaml
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.checkpoint.manager import TrainCheckpointer, abstract_like
from composer_jax.config import ConfigError
from composer_jax.data.errors import DataError
from composer_jax.data.pipeline import build_dataset
from composer_jax.data.sources import SkipLog
from composer_jax.data.tokenizer import load_tokenizer
from composer_jax.model.accounting import model_info
from composer_jax.parallel import DualMesh, param_shardings
from composer_jax.parallel.mesh import BATCH_AXES
from composer_jax.parallel.partitioning import like_params
from composer_jax.train import metrics as metrics_lib
from composer_jax.train import step as step_lib
from composer_jax.train.config import RunConfig, to_dict
from composer_jax.train.grids import GROUPS, Grids
from composer_jax.train.optimizer import make_optimizer

log = logging.getLogger(__name__)

ARRAY_ITEMS, JSON_ITEMS = ("model", "train"), ("data", "config")


def make_mesh(cfg: RunConfig) -> DualMesh:
    """The dual grid over `train.num_devices` devices (0 = all), checked against the batch and model."""
    devices = jax.devices()
    n = cfg.train.num_devices or len(devices)
    if n > len(devices):
        raise ConfigError("train.num_devices", f"{n} devices requested, {len(devices)} available")
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


def _opt_shardings(abstract_opt, leaves_shardings: list, replicated):
    """Optimizer-state shardings of one mesh group: a leaf at [..., i] shaped like the group's param i
    takes its sharding (moments), anything else (counts) is replicated on the group's mesh."""
    def one(path, leaf):
        key = path[-1] if path else None
        i = getattr(key, "idx", None)
        if i is not None and i < len(leaves_shardings) and tuple(leaf.shape) == leaves_shardings[i][0]:
            return leaves_shardings[i][1]
        return replicated

    return jax.tree_util.tree_map_with_path(one, abstract_opt)


def state_shardings(abstract: step_lib.TrainState, dual: DualMesh, grids: Grids) -> step_lib.TrainState:
    """Where each state leaf lives: params and biases by the dual-grid rules, optimizer state like its
    parameter, counters replicated. Checkpoints restore onto whatever this returns."""
    params = param_shardings(abstract.params, dual)
    replicated = {"dense": NamedSharding(dual.dense, P()), "expert": NamedSharding(dual.expert, P())}
    if "all" in abstract.opt_state:  # a whole-State optimizer (Muon): moments match params by path
        opt = {"all": like_params(abstract.opt_state["all"], abstract.params, params, dual)}
    else:
        shapes, shards = grids.split(abstract.params), grids.split(params)
        opt = {g: _opt_shardings(abstract.opt_state[g], [(tuple(a.shape), b) for a, b in zip(shapes[g], shards[g])],
                                 replicated[g]) for g in GROUPS}
    return step_lib.TrainState(replicated["dense"], params, param_shardings(abstract.biases, dual), opt,
                               replicated["dense"])


def _split_items(state: step_lib.TrainState) -> dict:
    return {"model": {"params": state.params, "biases": state.biases},
            "train": {"step": state.step, "opt_state": state.opt_state, "skipped": state.skipped}}


def _join_items(items: dict) -> step_lib.TrainState:
    m, t = items["model"], items["train"]
    return step_lib.TrainState(t["step"], m["params"], m["biases"], t["opt_state"], t["skipped"])


SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_dense_layers", "intermediate_size", "mla",
                "param_dtype", "moe.n_routed_experts", "moe.moe_intermediate_size", "moe.n_shared_experts",
                "mtp.num_layers")


def _model_shape_fields(model_cfg: dict) -> dict:
    """The model-config values that decide parameter shapes (rope, dispatch... may change between phases)."""
    def get(key):
        node = model_cfg
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    return {k: get(k) for k in SHAPE_FIELDS}


class Trainer:
    """One run: pipelines, state, compiled steps, checkpoints and metrics. `run()` trains to the end."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        tc = cfg.train
        self.run_dir = Path(cfg.run_dir)
        self.dual = make_mesh(cfg)
        # Each process feeds its own rows, sharded over the data-parallel axes; the step gathers the
        # (small, int32) batch whole before the model places tokens on the dense grid itself.
        self.batch_sharding = NamedSharding(self.dual.dense, P(None, BATCH_AXES))
        self.eval_sharding = NamedSharding(self.dual.dense, P(BATCH_AXES))
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        if self.tokenizer.vocab_size > cfg.model.vocab_size:
            raise DataError(f"tokenizer {self.tokenizer.name} has {self.tokenizer.vocab_size} ids, more than the "
                            f"model's vocab_size={cfg.model.vocab_size}")
        self.skips = SkipLog()
        shard = dict(shard_index=jax.process_index(), shard_count=jax.process_count())
        self.train_data = build_dataset(cfg.data, self.tokenizer, split="train", seq_len=tc.seq_len,
                                        batch_size=tc.batch_size // jax.process_count(), repeat=True,
                                        skips=self.skips, **shard)
        self.eval_data = None
        if cfg.data.eval_fraction > 0:
            self.eval_data = build_dataset(cfg.data, self.tokenizer, split="eval", seq_len=tc.seq_len,
                                           batch_size=tc.batch_size // jax.process_count(), repeat=False,
                                           skips=SkipLog(log_first=0), **shard)
        self.opt = make_optimizer(cfg.optimizer, tc.steps)
        self.graphdef, abstract_params, _, self.rest = step_lib.abstract_model_parts(cfg)
        self.grids = Grids(param_shardings(abstract_params, self.dual), self.dual)
        # Two passes: params/bias shardings first, then the optimizer state built from placed params.
        unplaced = jax.eval_shape(lambda: step_lib.init_state(cfg, self.opt, self.grids))
        placement = state_shardings(unplaced, self.dual, self.grids)
        with self.dual:
            abstract = jax.eval_shape(lambda: step_lib.init_state(cfg, self.opt, self.grids, placement))
        self.shardings = state_shardings(abstract, self.dual, self.grids)
        self.abstract = abstract_like(abstract, self.shardings)
        self.ckpt = TrainCheckpointer(self.run_dir / "checkpoints", array_items=ARRAY_ITEMS, json_items=JSON_ITEMS,
                                      save_every=cfg.checkpoint.every, keep=cfg.checkpoint.keep,
                                      async_save=cfg.checkpoint.async_save)
        self.iterator = iter(self.train_data)
        self.step_fn = jax.jit(step_lib.make_train_step(cfg, self.graphdef, self.rest, self.opt, self.grids),
                               donate_argnums=0)
        self.eval_fn = jax.jit(step_lib.make_eval_step(cfg, self.graphdef, self.rest))
        self._eval_batches = None
        with self.dual:
            self.state = self._initial_state()

    # ------------------------------------------------------------------------------------------------
    # state

    def _initial_state(self) -> step_lib.TrainState:
        latest = self.ckpt.latest_step()
        if latest is not None:
            saved = self.ckpt.restore(latest, {}, json_items=("config",))["config"].get("model", {})
            if _model_shape_fields(saved) != _model_shape_fields(to_dict(self.cfg)["model"]):
                raise ConfigError("model", f"differs from the model of the checkpoints in {self.ckpt.directory}; "
                                           "use another run_dir")
            restored = self.ckpt.restore(latest, _split_items(self.abstract))
            self.iterator.set_state(restored["data"])
            log.info("resumed from %s step %d", self.ckpt.directory, latest)
            return _join_items(restored)
        if self.cfg.train.init_from:
            return self._load_init_params()

        def init():
            state = step_lib.init_state(self.cfg, self.opt, self.grids, self.shardings)
            return jax.tree.map(jax.sharding.reshard, state, self.shardings)

        return jax.jit(init)()

    def _load_init_params(self) -> step_lib.TrainState:
        """Params and router biases from `train.init_from`'s latest checkpoint; fresh optimizer and step."""
        source = Path(self.cfg.train.init_from) / "checkpoints"
        other = TrainCheckpointer(source, array_items=ARRAY_ITEMS, json_items=JSON_ITEMS)
        try:
            if other.latest_step() is None:
                raise ConfigError("train.init_from", f"no complete checkpoint in {source}")
            config = other.restore(None, {}, json_items=("config",))["config"]
            if _model_shape_fields(config["model"]) != _model_shape_fields(to_dict(self.cfg)["model"]):
                raise ConfigError("train.init_from", f"the model of {source} has other parameter shapes "
                                                     "than this run's model")
            model = other.restore(None, {"model": _split_items(self.abstract)["model"]}, json_items=())["model"]
        finally:
            other.close()
        log.info("initialised params from %s", source)

        def fresh(params, biases):
            zero = jnp.zeros((), jnp.int32)
            state = step_lib.TrainState(zero, params, biases, step_lib.init_opt_state(self.opt, params, self.grids),
                                        zero)
            return jax.tree.map(jax.sharding.reshard, state, self.shardings)

        return jax.jit(fresh)(model["params"], model["biases"])

    # ------------------------------------------------------------------------------------------------
    # data

    def _device_batch(self, batch: dict, sharding, shape) -> dict:
        return {k: jax.make_array_from_process_local_data(sharding, v.reshape(shape)) for k, v in batch.items()}

    def next_batch(self) -> dict:
        """The next train batch as int32[grad_accum, micro_batch, seq] arrays sharded over `data`."""
        accum, seq = self.cfg.train.grad_accum, self.cfg.train.seq_len
        return self._device_batch(next(self.iterator), self.batch_sharding, (accum, -1, seq))

    def eval_batches(self) -> list[dict]:
        """The first `eval_batches` held-out batches (the same ones every time), on device."""
        if self._eval_batches is None:
            batches = []
            for batch in self.eval_data:
                batches.append(self._device_batch(batch, self.eval_sharding, batch["tokens"].shape))
                if len(batches) == self.cfg.train.eval_batches:
                    break
            if not batches:
                raise DataError(f"the held-out split of {self.cfg.data.path} yields no full batch of "
                                f"{self.cfg.train.batch_size} x {self.cfg.train.seq_len} tokens; raise "
                                "data.eval_fraction or lower train.batch_size")
            self._eval_batches = batches
        return self._eval_batches

    # ------------------------------------------------------------------------------------------------
    # loop

    def evaluate(self) -> dict:
        """Held-out losses: eval_loss (main next-token CE) and eval_mtp{k}_ce, over the eval batches."""
        sums = [self.eval_fn(self.state, b) for b in self.eval_batches()]
        total = jax.device_get(jax.tree.map(lambda *x: sum(x), *sums))
        out = {"eval_loss": float(total["ce"] / max(total["targets"], 1.0))}
        for k in range(1, self.cfg.model.mtp.num_layers + 1):
            out[f"eval_mtp{k}_ce"] = float(total[f"mtp{k}_ce"] / max(total[f"mtp{k}_targets"], 1.0))
        return out

    def save(self, step: int) -> None:
        self.ckpt.save(step, _split_items(self.state), {"data": self.iterator.get_state(), "config": to_dict(self.cfg)},
                       force=True)

    def _peak_flops(self) -> float:
        n = self.dual.dense.size
        if self.cfg.train.peak_flops:
            return self.cfg.train.peak_flops * n
        peak = metrics_lib.device_peak_flops(self.dual.dense.devices.flat[0])
        if peak is not None:
            return peak * n
        return metrics_lib.measure_host_matmul_flops()  # fake CPU devices share the host's cores

    def run(self) -> dict:
        """Train from the current step to `train.steps`. Returns a summary (losses, timings)."""
        cfg, tc = self.cfg, self.cfg.train
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        writer = metrics_lib.MetricsWriter(self.run_dir)
        start = int(jax.device_get(self.state.step))
        tokens_per_step = tc.batch_size * tc.seq_len
        flops_per_token = model_info(cfg.model, tc.seq_len).flops.total
        peak = self._peak_flops()
        progress = metrics_lib.Progress(tc.steps, start, tc.progress)
        summary = {"start_step": start, "steps": tc.steps}
        t_begin = time.perf_counter()
        self.dual.__enter__()
        try:
            if self.eval_data is not None and start == 0:
                ev = self.evaluate()
                writer.write({"step": 0, **ev})
                summary["first_eval_loss"] = ev["eval_loss"]
                progress.write(f"step 0: held-out loss {ev['eval_loss']:.4f}")
            pending, t_last, timed, step = [], time.perf_counter(), 0, start
            for step in range(start + 1, tc.steps + 1):
                self.state, m = self.step_fn(self.state, self.next_batch())
                pending.append((step, m))
                if step == start + 1:  # compilation: measure throughput from the end of the first step
                    jax.block_until_ready(m)
                    summary["first_step_s"] = time.perf_counter() - t_last
                    t_last, timed = time.perf_counter(), -1
                timed += 1
                if step % cfg.checkpoint.every == 0 or step == tc.steps:
                    self.save(step)
                if step % tc.log_every == 0 or step == tc.steps:
                    host = jax.device_get([m for _, m in pending])
                    now = time.perf_counter()
                    # The first step (compilation included) is timed on its own; every other interval
                    # counts only the steps run since the last sync.
                    tps = (tokens_per_step * timed / (now - t_last) if timed
                           else tokens_per_step / summary["first_step_s"])
                    mfu = tps * flops_per_token / peak if peak else None
                    for (s, _), values in zip(pending, host):
                        writer.write({"step": s, **{k: float(v) for k, v in values.items()},
                                      "tokens_per_s": tps, "mfu": mfu, "skipped_records": self.skips.total})
                    progress.update(len(pending), float(host[-1]["loss"]), tps, mfu)
                    summary["last_loss"] = float(host[-1]["loss"])
                    pending, t_last, timed = [], now, 0
                if self.eval_data is not None and (step % tc.eval_every == 0 or step == tc.steps):
                    ev = self.evaluate()
                    writer.write({"step": step, **ev})
                    summary["last_eval_loss"] = ev["eval_loss"]
                    progress.write(f"step {step}: held-out loss {ev['eval_loss']:.4f}")
                    t_last, timed = time.perf_counter(), 0
            summary.update(wall_s=time.perf_counter() - t_begin, skipped_steps=int(jax.device_get(self.state.skipped)),
                           skipped_records=dict(self.skips.counts), end_step=step)
        finally:
            self.dual.__exit__(None, None, None)
            progress.close()
            writer.close()
            self.ckpt.close()
        return summary


def train(cfg: RunConfig) -> dict:
    """Build a Trainer for `cfg` and run it to the end (resuming if RUN_DIR holds checkpoints)."""
    return Trainer(cfg).run()


def replace_run(cfg: RunConfig, **changes) -> RunConfig:
    """dataclasses.replace for nested sections: replace_run(cfg, train=dict(steps=5))."""
    updates = {k: dataclasses.replace(getattr(cfg, k), **v) if isinstance(v, dict) else v for k, v in changes.items()}
    return dataclasses.replace(cfg, **updates)

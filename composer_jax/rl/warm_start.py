"""A short supervised warm start before RL: a randomly initialised byte-level model almost never writes
a well-formed answer, so its rewards are all 0 and every group is dropped. A few steps of the
pretraining / SFT step (`train.step.make_train_step`, loss on the assistant's tokens only) on
demonstrations (each task's solving message, `env.demonstration(task)`) give it a non-trivial pass
rate for RL to raise.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.config import ConfigError
from composer_jax.envs import TokenEpisode
from composer_jax.model import CausalLM
from composer_jax.parallel.mesh import BATCH_AXES
from composer_jax.rl.ingest import process_rows
from composer_jax.rl.run_config import RLRunConfig
from composer_jax.train.config import OptimizerConfig, RunConfig, TrainConfig
from composer_jax.train.metrics import Progress
from composer_jax.train.optimizer import make_optimizer
from composer_jax.train.state import TrainState, split_model
from composer_jax.train.step import make_train_step


def demonstrations(env, tokenizer, tasks: Sequence, seq_len: int, turn_tokens: int,
                   hint_share: float = 0.0) -> dict[str, np.ndarray]:
    """The pretraining step's features int32[N, seq_len] (tokens, segment_ids, positions, loss_mask):
    each task's prompt as the episode renders it, then its solving message and the end-of-turn marker
    (the loss mask covers these), right-padded to the longest (rounded up to 16, at most seq_len).
    With `hint_share` > 0 that share of the rows shows the solving message after the hint the
    teacher of targeted feedback would see for a mistake (`mistake_hints`): a model trained only on
    plain demonstrations has never seen a hint, and its hinted teacher predicts from out of its
    distribution. A message longer than one turn's budget (`turn_tokens`, rollout.max_new_tokens) is a
    ConfigError: the policy could never write it whole."""
    rows, plain = [], {}                                # (task id, context ids, answer ids)
    for task in tasks:
        prompt = TokenEpisode(env, tokenizer).start(task)
        answer = np.asarray(tokenizer.encode(env.demonstration(task) + env.fmt.end_of_turn), np.int32)
        if len(answer) > turn_tokens:
            raise ConfigError("rollout.max_new_tokens", f"{turn_tokens} tokens per turn cannot hold the warm "
                                                        f"start's demonstration for task {task.id} ({len(answer)} "
                                                        f"tokens with the end-of-turn marker)")
        rows.append((task.id, prompt, answer))
        plain[task.id] = (prompt, answer)
    hinted = round(len(tasks) * hint_share / (1 - hint_share)) if hint_share else 0
    for task, hint in mistake_hints(env, tokenizer, tasks, hinted):
        prompt, answer = plain[task.id]
        rows.append((task.id, np.concatenate([prompt, hint]), answer))
    tokens, segments, mask = (np.zeros((len(rows), seq_len), np.int32) for _ in range(3))
    for row, (task_id, prompt, answer) in enumerate(rows):
        n = len(prompt) + len(answer)
        if n > seq_len:
            raise ValueError(f"warm start: task {task_id} needs {n} tokens, more than a row's {seq_len} "
                             f"(rollout.max_len, plus rollout.feedback_window with warm_start.hint_share)")
        tokens[row, :n], segments[row, :n] = np.concatenate([prompt, answer]), 1
        mask[row, len(prompt):n] = 1
    positions = np.where(segments > 0, np.arange(seq_len, dtype=np.int32)[None], 0).astype(np.int32)
    width = min(seq_len, -(-int(segments.sum(1).max()) // 16) * 16)     # no step on columns of padding only
    return {k: v[:, :width] for k, v in
            {"tokens": tokens, "segment_ids": segments, "positions": positions, "loss_mask": mask}.items()}


def mistake_hints(env, tokenizer, tasks: Sequence, count: int) -> list[tuple[object, np.ndarray]]:
    """Up to `count` (task, teacher insert) pairs: the hint as targeted feedback's teacher sees it before
    a flagged turn (`TokenEpisode.hint_ids`), cycling over `tasks` and two mistakes made on purpose: a
    turn without a call or answer, and the demonstration cut in half (a malformed call). A mistake the
    environment does not flag gives none."""
    out = []
    for attempt in range(2 * max(count, len(tasks)) if count else 0):
        task = tasks[attempt % len(tasks)]
        demonstration = env.demonstration(task)
        cut = (attempt + attempt // len(tasks)) % 2           # each task gets both mistakes in turn
        mistake = demonstration[:len(demonstration) // 2] if cut else ""
        episode = TokenEpisode(env, tokenizer)
        episode.start(task)
        episode.step(np.asarray(tokenizer.encode(mistake + env.fmt.end_of_turn), np.int32))
        turn = episode.turns[-1]
        if turn.hint:
            out.append((task, episode.hint_ids(turn)))
            if len(out) == count:
                break
    return out


def warm_start(model: CausalLM, cfg: RLRunConfig, demos: dict[str, np.ndarray]) -> tuple[CausalLM, float]:
    """`cfg.warm_start.steps` supervised steps on random batches of `demonstrations(...)`, with a progress
    bar; returns (the trained model, the last step's cross-entropy). The arrays of `model` are donated:
    use the returned model."""
    ws = cfg.warm_start
    run = RunConfig(model=cfg.model, mesh=cfg.mesh,
                    train=TrainConfig(steps=ws.steps, batch_size=ws.batch_size, seq_len=demos['tokens'].shape[1],
                                      loss_chunk=cfg.rl.loss_chunk, seed=cfg.seed),
                    optimizer=OptimizerConfig(lr=ws.lr, warmup_steps=max(1, ws.steps // 10), weight_decay=0.0))
    graphdef, params, biases, rest = split_model(model)
    dual = model.mesh
    opt = make_optimizer(run.optimizer, ws.steps, params, dual.meshes)
    step = jax.jit(make_train_step(run, graphdef, rest, opt), donate_argnums=0)
    zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731  (two buffers: both are donated)
    state = TrainState(zero(), params, biases, opt.tx.init(params), zero())
    sharding = NamedSharding(dual.dense, P(None, BATCH_AXES))
    rng = np.random.default_rng(cfg.seed)
    ce = float("nan")
    progress = Progress(ws.steps, 0, cfg.progress, muted=jax.process_index() != 0)
    progress.status("warm start (compiling)")
    tokens_per_step = ws.batch_size * demos["tokens"].shape[1]
    rate = lambda done: tokens_per_step * done / max(time.perf_counter() - began, 1e-9)  # noqa: E731
    previous, began = None, 0.0
    with dual:
        for i in range(ws.steps):
            rows = rng.choice(len(demos["tokens"]), ws.batch_size, replace=len(demos["tokens"]) < ws.batch_size)
            batch = {k: jax.make_array_from_process_local_data(sharding, process_rows(v[rows][None], 1))
                     for k, v in demos.items()}     # every process draws the same rows and hands over its block
            state, metrics = step(state, batch)
            if i == 0:                              # compiled: tokens/s counts from here
                progress.status("warm start")
                began = time.perf_counter()
            else:                                   # the step before's loss: one step stays in flight
                ce = float(jax.device_get(previous["ce"]))
                progress.update(1, ce, rate(i - 1), None)
            previous = metrics
        if ws.steps:
            ce = float(jax.device_get(previous["ce"]))
            progress.update(1, ce, rate(ws.steps - 1), None)
    progress.close()
    return nnx.merge(graphdef, state.params, state.biases, rest), ce

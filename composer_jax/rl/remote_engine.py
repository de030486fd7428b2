"""`composer-jax rl-engine`: the rollout engine as a process of its own (rollout.transport=directory).

    serve(cfg)        # the same run config as the learner's `composer-jax rl`

It builds the inference engine on this process's devices (its own JAX runtime), waits for the
learner's session in the exchange directory (`rl.exchange`), starts from the sampler and group state
the learner put there (its checkpoint's on a resumed run, so no consumed prompt is drawn again),
installs the learner's weight versions as they appear (in place, no recompilation) and writes each
batch back: the producer's own loop (`RolloutProducer.run_batches`), with the same staleness gate
(batch i starts once version i - rl.max_staleness is in the directory). It exits when the learner
writes its stop marker; a new learner session (a restarted learner) is followed. A failure is written
for the learner to report, then raised; a heartbeat file tells the learner the engine is alive (one
killed without a word is noticed within `exchange.HEARTBEAT_GRACE_S`).
"""

from __future__ import annotations

import threading

import jax
from flax import nnx

from composer_jax.config import MeshConfig
from composer_jax.data.tokenizer import ByteTokenizer
from composer_jax.model import CausalLM
from composer_jax.parallel import DualMesh, shard_model
from composer_jax.rl.exchange import (POLL_S, EngineExchange, ExchangeError, Heartbeat, check_same_settings,
                                      engine_settings)
from composer_jax.rl.rollout import RolloutProducer, engine_agent, group_assembler
from composer_jax.rl.run_config import RLRunConfig
from composer_jax.rl.sampler import TaskSampler
from composer_jax.rl.task_sets import TaskSets, task_sets


def _watch(exchange: EngineExchange, producer: RolloutProducer, done: threading.Event) -> None:
    """Stop the producer (mid-batch too) once the learner's session ends."""
    while not done.wait(POLL_S):
        if exchange.ended():
            producer.stop()
            return


def _serve_session(cfg: RLRunConfig, agent, tasks: TaskSets, exchange: EngineExchange) -> int:
    """Batches for one learner session until it ends; returns how many were written."""
    session = exchange.session
    check_same_settings(session["settings"], engine_settings(cfg))
    first = exchange.wait_weights(session["start"] - cfg.rl.max_staleness)
    if first is None:
        return 0
    agent.update_weights(*first)          # always: the same version number of another session is other weights
    sampler = TaskSampler.from_state(session["sampler"], list(tasks.train), cfg.sampler)
    groups = group_assembler(cfg, sampler)
    groups.load_state(session["groups"])
    producer = RolloutProducer(agent, tasks.train, tasks.make_env, sampler, groups, cfg,
                               start_index=session["start"], workspace=tasks.workspace)
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(exchange, producer, done), name="session-watch", daemon=True)
    watcher.start()
    try:
        producer.run_batches(exchange.wait_weights, exchange.deliver)
    finally:
        done.set()
        watcher.join()
    return producer.index - session["start"]


def serve(cfg: RLRunConfig, tasks: TaskSets | None = None, log=print) -> dict:
    """Serve the learner's sessions until one stops (see the module docstring). `tasks`: the task sets
    (default: those cfg.env describes, built once the learner's session exists: a coding run's tasks are
    made by the learner). Returns {"batches", "versions": the weight versions loaded, a list per
    session, "sessions"}."""
    root, timeout = cfg.rollout.exchange_dir, cfg.rollout.engine_timeout_s
    if cfg.rollout.transport != "directory":
        raise ExchangeError("composer-jax rl-engine serves a learner run with rollout.transport=directory")
    with Heartbeat(root):       # from the start: the learner tells a slow engine from a dead one
        return _serve(cfg, tasks, log, root, timeout)


def _serve(cfg: RLRunConfig, tasks: TaskSets | None, log, root: str, timeout: float) -> dict:
    model = CausalLM(cfg.model, rngs=nnx.Rngs(cfg.seed))     # its weights come from the learner
    shard_model(model, DualMesh(MeshConfig(), jax.devices(), model=cfg.model))
    agent = engine_agent(cfg, ByteTokenizer(), model)
    summary = {"batches": 0, "versions": [], "sessions": 0}
    exchange = None
    try:
        session = EngineExchange.wait_session(root, timeout)
        tasks = tasks if tasks is not None else task_sets(cfg.env, cfg.seed, cfg.run_dir, cfg.warm_start.tasks)
        while True:
            exchange = EngineExchange(root, session, agent.engine.state, timeout, cfg.rollout.weight_transfer)
            log(f"rl-engine: session {session['session']} from batch {session['start']} on {len(jax.devices())} "
                f"{jax.devices()[0].platform} devices")
            summary["batches"] += _serve_session(cfg, agent, tasks, exchange)
            summary["versions"].append(exchange.versions)
            summary["sessions"] += 1
            if (exchange.dir / "stop").exists():
                return summary
            session = EngineExchange.wait_session(root, timeout, after=session["session"])
    except BaseException as e:
        if exchange is not None and not isinstance(e, KeyboardInterrupt):
            exchange.fail(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}")
        raise
    finally:
        agent.close()

"""`composer-jax rl-engine`: the rollout engine as a process of its own (rollout.transport=directory).

    serve(cfg, engine=0)        # the same run config as the learner's `composer-jax rl`

It builds the inference engine on this process's devices (its own JAX runtime), waits for the
learner's session in the exchange directory (its end of the exchange: `EngineExchange`), starts from the
sampler and group state the learner put there (its checkpoint's on a resumed run, so no consumed prompt
is drawn again), installs the learner's weight versions as they appear (in place, no recompilation) and
writes each batch back: the producer's own loop (`RolloutProducer.run_batches`), with the same staleness gate
(batch i starts once version i - rl.max_staleness is in the directory). It exits when the learner
writes its stop marker; a new learner session (a restarted learner) is followed. A failure is written
for the learner to report, then raised; a heartbeat file tells the learner the engine is alive (one
killed without a word is noticed within `heartbeat.HEARTBEAT_GRACE_S`).

Several engines (rollout.engines = n, `serve(cfg, engine=k)` for k = 0..n-1, one process each): engine
k samples every n-th training task from the k-th on, with its own sampler and group state (the session
and the learner's checkpoints hold one per engine), and writes batches k, k + n, ...; the learner
reads them in order, so with rl.max_staleness >= n - 1 the engines sample concurrently.
"""

from __future__ import annotations

import threading

import jax
from flax import nnx

from composer_jax.config import ConfigError
from composer_jax.infer.generate import engine_grids
from composer_jax.model import CausalLM
from composer_jax.parallel import record_layout
from composer_jax.rl.exchange.directory import POLL_S, ExchangeError
from composer_jax.rl.exchange.engine_end import EngineExchange
from composer_jax.rl.exchange.heartbeat import Heartbeat
from composer_jax.rl.exchange.settings import check_same_settings, engine_settings
from composer_jax.rl.rollout import RolloutProducer, engine_agent, engine_sampling
from composer_jax.rl.run_config import RLRunConfig, resolve_run
from composer_jax.rl.task_sets import TaskSets, task_sets


def _watch(exchange: EngineExchange, producer: RolloutProducer, done: threading.Event) -> None:
    """Stop the producer (mid-batch too) once the learner's session ends."""
    while not done.wait(POLL_S):
        if exchange.ended():
            producer.stop()
            return


def _serve_session(cfg: RLRunConfig, agent, tasks: TaskSets, exchange: EngineExchange, engine: int) -> int:
    """Batches for one learner session until it ends; returns how many were written. Engine `engine` of n
    writes the batches i >= the session's start with i % n == engine."""
    session, n = exchange.session, cfg.rollout.engines
    check_same_settings(session["settings"], engine_settings(cfg))
    start = session["start"] + (engine - session["start"]) % n
    first = exchange.wait_weights(start - cfg.rl.max_staleness)
    if first is None:
        return 0
    agent.update_weights(*first)          # always: the same version number of another session is other weights
    sampler, groups = engine_sampling(cfg, tasks.train, engine, session["engines"][engine])
    producer = RolloutProducer(agent, tasks.train, tasks.make_env, sampler, groups, cfg,
                               start_index=start, workspace=tasks.workspace, stride=n)
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(exchange, producer, done), name="session-watch", daemon=True)
    watcher.start()
    try:
        producer.run_batches(exchange.wait_weights, exchange.deliver)
    finally:
        done.set()
        watcher.join()
    return (producer.index - start) // n


def serve(cfg: RLRunConfig, tasks: TaskSets | None = None, log=print, engine: int = 0) -> dict:
    """Serve the learner's sessions as engine `engine` (of rollout.engines) until one stops (see the module
    docstring). `tasks`: the task sets (default: those cfg.env describes, built once the learner's session
    exists: a coding run's tasks are made by the learner). Returns {"batches", "versions": the weight
    versions loaded, a list per session, "sessions"}."""
    root, timeout = cfg.rollout.exchange_dir, cfg.rollout.engine_timeout_s
    if cfg.rollout.transport != "directory":
        raise ExchangeError("composer-jax rl-engine serves a learner run with rollout.transport=directory")
    if not 0 <= engine < cfg.rollout.engines:
        raise ConfigError("rollout.engines", f"is {cfg.rollout.engines}: no engine {engine} (--engine counts from 0)")
    with Heartbeat(root, engine=engine):    # from the start: the learner tells a slow engine from a dead one
        return _serve(cfg, tasks, log, root, timeout, engine)


def _serve(cfg: RLRunConfig, tasks: TaskSets | None, log, root: str, timeout: float, engine: int) -> dict:
    setup = resolve_run(cfg)            # the learner's tokenizer, format and env settings (the same source)
    cfg = setup.cfg
    # Abstract (no arrays): the weights come from the learner, so no float copy of the model is ever held
    model = nnx.eval_shape(lambda: CausalLM(cfg.engine_model(engine), rngs=nnx.Rngs(cfg.seed)))
    record_layout(model, engine_grids(model.cfg, jax.devices()))
    agent = engine_agent(cfg, setup.tokenizer, model)
    summary = {"batches": 0, "versions": [], "sessions": 0}
    exchange = None
    try:
        session = EngineExchange.wait_session(root, timeout)
        tasks = tasks if tasks is not None else task_sets(cfg.env, cfg.seed, cfg.run_dir)
        while True:
            exchange = EngineExchange(root, session, agent.engine.held_like, timeout, cfg.rollout.weight_transfer,
                                      release=agent.release_weights, engine=engine)
            of = f"engine {engine} of {cfg.rollout.engines}: " if cfg.rollout.engines > 1 else ""
            log(f"rl-engine: {of}session {session['session']} from batch {session['start']} on {len(jax.devices())} "
                f"{jax.devices()[0].platform} devices")
            summary["batches"] += _serve_session(cfg, agent, tasks, exchange, engine)
            summary["versions"].append(exchange.versions)
            summary["sessions"] += 1
            if (exchange.dir / "stop").exists():
                return summary
            session = EngineExchange.wait_session(root, timeout, after=session["session"])
    except BaseException as e:
        if exchange is not None and not isinstance(e, KeyboardInterrupt):
            who = f"engine {engine}: " if cfg.rollout.engines > 1 else ""
            exchange.fail(f"{who}{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}")
        raise
    finally:
        agent.close()

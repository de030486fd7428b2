"""Rollout production for the RL loop: a background thread turns the policy's current weights into
training batches while the learner trains on the previous ones.

    producer = RolloutProducer(agent, tasks, make_env, sampler, groups, cfg, start_index=0)
    producer.start()
    batch = producer.next_batch()          # ProducedBatch for policy version `batch.index`
    producer.publish(snapshot, version)    # the learner's new weights (already copied into the engine's layout)

Bounded staleness: batch i is trained when the learner is at policy version i. The producer starts
batch i only once version i - max_staleness is published, and installs the newest published weights
in the engine (`EngineAgent.update_weights`, in place, no recompilation) between batches, so every
token of batch i comes from a version in [i - max_staleness, i] (each records its own version). With
max_staleness = 0 it waits for the learner before every batch: a synchronous loop. That loop,
`run_batches`, is also the rollout engine process's (`rl.exchange.engine_process`), with weights from and
batches to the exchange directory instead of the learner's thread.

One batch: `prompts_per_step` prompts drawn from the task sampler, `group_size` episodes each (every
episode in its own thread, all turns decoding together in the engine's slots). An episode that fills
the engine's context ends there, unsolved (reward 0), and trains like any other. An episode that raises
(the environment crashed) or whose environment call runs past `rollout.timeout_s` (it hung) is lost:
the group assembler refills or drops its group (`rl.groups`), and the run goes on. Groups whose rewards
are all equal are dropped; the batch keeps its shape by padding rows that carry no generated token (no
gradient). Rows are ordered by draw and sample, so the same seeds give the same batch whatever the
timing. Each episode samples from its own seed (its draw and sample), independent of its slot.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from composer_jax.config import ConfigError
from composer_jax.envs import (Monitor, Report, TokenEpisode, get_format, monitor_counts, rollout_fields,
                               teacher_windows)
from composer_jax.envs.feedback import FLAG_KINDS, NO_ACTION
from composer_jax.agents.engine_agent import EngineAgent, EngineAgentConfig
from composer_jax.agents.episode import attempt_seed, play
from composer_jax.rl.batch import RolloutBatch
from composer_jax.rl.groups import COUNTS, Group, GroupAssembler, Sample
from composer_jax.rl.rollout_log import logs_batch, picked_lines
from composer_jax.rl.run_config import RLRunConfig
from composer_jax.rl.sampler import Prompt, TaskSampler
from composer_jax.rl.task_pool import TaskPool

POLL_S = 0.05


@dataclasses.dataclass
class Rollout:
    """One finished episode of a drawn prompt."""

    prompt: Prompt
    sample: int
    episode: TokenEpisode
    versions: list[int]         # the weights version of each generated token
    report: Report              # the reward-hacking monitor's findings
    reward: float               # the composed reward, after the monitor (zeroed when flagged and configured so)

    @property
    def key(self) -> str:
        return f"{self.prompt.draw}/{self.sample}"


def carries_feedback(sample: Sample) -> bool:
    """Whether a finished rollout has a flagged turn with a hint (a self-distillation target)."""
    return any(turn.hint for turn in sample.rollout.episode.turns)


def engine_sampling(cfg: RLRunConfig, task_ids, engine: int = 0,
                    state: dict | None = None) -> tuple[TaskSampler, GroupAssembler]:
    """Rollout engine `engine`'s task sampler and group assembler, fresh or from `state` ({"sampler",
    "groups"}: a checkpoint's). Of rollout.engines engines, each samples its own share of the training
    tasks (every engines-th, from its index on) with its own random stream (sampler.seed + engine), so
    no two engines draw the same prompt and each can resume on its own."""
    n, ids = cfg.rollout.engines, list(task_ids)
    share = ids[engine::n]
    if not share:
        raise ConfigError("rollout.engines", f"{n} engines for {len(ids)} training tasks: engine {engine} has none")
    sampler_cfg = dataclasses.replace(cfg.sampler, seed=cfg.sampler.seed + engine)
    sampler = (TaskSampler(share, sampler_cfg) if state is None
               else TaskSampler.from_state(state["sampler"], share, sampler_cfg))
    groups = group_assembler(cfg, sampler)
    if state is not None:
        groups.load_state(state["groups"])
    return sampler, groups


def group_assembler(cfg: RLRunConfig, sampler: TaskSampler) -> GroupAssembler:
    """The run's group assembler: groups with equal rewards are kept for their hinted turns when the
    step trains on them (self-distillation on, teacher slots in the batch)."""
    feedback = carries_feedback if cfg.teacher_slots else None
    return GroupAssembler(cfg.rl.group_size, sampler, on_lost=cfg.rollout.on_lost,
                          max_refills=cfg.rollout.max_refills, feedback=feedback)


@dataclasses.dataclass
class ProducedBatch:
    index: int                  # the policy version that trains on it (the step it is for)
    batch: RolloutBatch
    draws: list[int]            # the draw numbers of every prompt drawn for it (consumed, trained or dropped)
    trained: list[Prompt]       # the prompts of the trained groups, by draw
    feedback_only: list[int]    # the draws among them trained for their hinted turns alone (equal rewards)
    row_versions: np.ndarray    # int[2, B]: oldest and newest weights version among each row's tokens (-1: padding)
    metrics: dict               # rollout statistics of the batch (all finished episodes, trained or not)
    reports: list[tuple[str, Report]]   # (episode key, monitor report) of every finished episode
    sampler_state: dict         # the sampler once this batch's groups were recorded (what a checkpoint keeps)
    group_counts: dict
    busy: tuple[float, float]   # time.time() interval spent producing it (comparable across processes and hosts)
    # the episodes picked for RUN_DIR/rollouts.jsonl: its lines as JSON objects without their step
    # (rl.rollout_log); none when this batch's are not logged (rl.log_rollouts_every)
    samples: list[str] = dataclasses.field(default_factory=list)


def engine_context(cfg: RLRunConfig, tokenizer, fmt) -> int:
    """The engine's context per episode: a trajectory row (rollout.max_len tokens) less the tokens the
    episode appends after its last turn (the end-of-turn marker and the template's suffix)."""
    context = cfg.rollout.max_len - len(tokenizer.encode(fmt.end_of_turn + fmt.turn_suffix))
    if context < 2:
        raise ConfigError("rollout.max_len", f"{cfg.rollout.max_len} tokens leave no room for a turn")
    return context


def engine_agent(cfg: RLRunConfig, tokenizer, model) -> EngineAgent:
    """The rollout engine's agent over `model` (a CausalLM placed where the engine runs; it compiles
    for that layout) with the rollout settings."""
    r = cfg.rollout
    config = EngineAgentConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                               max_new_tokens=r.max_new_tokens, max_len=engine_context(cfg, tokenizer,
                                                                                      get_format(cfg.env.format)),
                               max_slots=r.max_slots, steps_per_call=r.steps_per_call, format=cfg.env.format,
                               speculative=r.speculative)
    return EngineAgent(model, tokenizer, "policy", config)


def padding_rows(rows: int, seq_len: int, first_group: int, group_size: int, slots: int, window: int) -> dict:
    """RolloutBatch fields of `rows` rows that train nothing: one prompt token, no generated token,
    reward 0, in groups numbered from `first_group`."""
    segments = np.zeros((rows, seq_len), np.int32)
    segments[:, 0] = 1
    fields = dict(tokens=np.zeros((rows, seq_len), np.int32), positions=np.zeros((rows, seq_len), np.int32),
                  segment_ids=segments, generated=np.zeros((rows, seq_len), bool),
                  behaviour_logprobs=np.zeros((rows, seq_len), np.float32), rewards=np.zeros(rows, np.float32),
                  group_ids=(first_group + np.arange(rows) // group_size).astype(np.int32))
    if slots:
        fields.update(teacher_tokens=np.zeros((rows, slots, window), np.int32),
                      teacher_map=np.full((rows, slots, window), -1, np.int32))
    return fields


def assemble(groups: list[Group], cfg: RLRunConfig) -> tuple[RolloutBatch, np.ndarray]:
    """The step's batch from trainable groups (at most prompts_per_step, sorted by draw; rows by sample),
    padded to rollout.batch_size rows; and the rows' [oldest, newest] token versions int[2, B]."""
    r, g = cfg.rollout, cfg.rl.group_size
    rollouts = [s.rollout for group in groups for s in sorted(group.samples, key=lambda s: s.rollout.sample)]
    fields = rollout_fields([x.episode for x in rollouts], np.arange(len(rollouts)) // g, seq_len=r.max_len,
                            slots=cfg.teacher_slots, window=r.feedback_window)
    fields["rewards"] = np.array([x.reward for x in rollouts], np.float32)
    pad = padding_rows(r.batch_size - len(rollouts), r.max_len, len(groups), g, cfg.teacher_slots, r.feedback_window)
    fields = {k: np.concatenate([fields[k], pad[k]]) for k in pad}
    versions = np.full((2, r.batch_size), -1, np.int64)
    for row, x in enumerate(rollouts):
        if x.versions:
            versions[:, row] = min(x.versions), max(x.versions)
    return RolloutBatch(**fields), versions


def rollout_metrics(rollouts: list[Rollout], pass_threshold: float, wall_s: float, slots: int = 0,
                    window: int = 0) -> dict:
    """Means over the batch's finished episodes: rewards and their components, pass rate, tool calls
    carried out per episode and the share of calls that failed (invalid, or not carried out: envs.tools),
    test runs that reported failures per episode (successful calls, apart from the errors), the share of
    turns that used the tools wrongly (a call that did not parse or validate, or no call at all: a policy
    that stops calling has no failed calls, but every turn counts here), flagged turns and the share of
    turns flagged per kind (`flag_<kind>`), response length; rollout tokens per second. With teacher
    slots (`slots` of `window` tokens): the flagged turns that teach (`sd_windows`), those whose window
    cut the turn (`sd_windows_cut`) and those left without a window (`sd_turns_left_out`), per batch."""
    if not rollouts:
        return {"rollouts": 0.0, "rollout_s": wall_s}
    terms = [x.episode.reward_terms for x in rollouts]
    infos = [x.episode.info for x in rollouts]
    generated = [int(sum(x.episode.generated)) for x in rollouts]
    calls = sum(i["tool_calls"] + i.get("invalid_calls", 0) for i in infos)
    turns = [t for x in rollouts for t in x.episode.turns]
    no_call = sum(any(f.kind == NO_ACTION for f in t.flags) for t in turns)
    out = {"rollouts": float(len(rollouts)), "reward_mean": float(np.mean([x.reward for x in rollouts])),
           "pass_rate": float(np.mean([i["task_reward"] >= pass_threshold for i in infos])),
           "tool_calls_mean": float(np.mean([i.get("tool_calls", 0) for i in infos])),
           "tool_error_rate": sum(i["failed_calls"] for i in infos) / calls if calls else 0.0,
           "tool_turn_error_rate": (sum(i.get("malformed_turns", 0) for i in infos) + no_call) / max(len(turns), 1),
           "tests_failed_runs": float(np.mean([i.get("tests_failed_runs", 0) for i in infos])),
           "flagged_turns": float(sum(bool(t.flags) for t in turns)),
           "response_length_mean": float(np.mean(generated)), "rollout_s": wall_s,
           "rollout_tokens_per_s": sum(generated) / max(wall_s, 1e-9)}
    if slots:
        windows = [teacher_windows(x.episode, slots, window) for x in rollouts]
        out.update(sd_windows=float(sum(len(w) for w, _ in windows)),
                   sd_windows_cut=float(sum(end < turn.end for w, _ in windows for turn, _, end in w)),
                   sd_turns_left_out=float(sum(left for _, left in windows)))
    out.update({f"flag_{kind}": sum(any(f.kind == kind for f in t.flags) for t in turns) / max(len(turns), 1)
                for kind in FLAG_KINDS})
    out.update({f"reward_{name}": float(np.mean([t[name] for t in terms])) for name in terms[0] if name != "total"})
    return out


class TimedEnv:
    """An environment whose reset and step calls are timed: `in_env[key]` holds when the call running
    now began (what the producer's hang timeout measures: the environment's time, not the model's)."""

    def __init__(self, env, in_env: dict, key):
        self.env, self.in_env, self.key = env, in_env, key

    def __getattr__(self, name):
        return getattr(self.env, name)

    def _timed(self, call, *args):
        self.in_env[self.key] = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.in_env.pop(self.key, None)

    def reset(self, task):
        return self._timed(self.env.reset, task)

    def step(self, text):
        return self._timed(self.env.step, text)


class RolloutProducer:
    """See the module docstring. `agent`: an EngineAgent (or any agent with update_weights/version);
    `tasks`: id -> task; `make_env()`: a fresh environment per episode; `workspace`: where the
    environment's commands see the repository (for the monitor); `stride`: the step between this
    producer's batch indices (one of several engines: rollout.engines); `pool`: a growing task pool,
    polled before each batch (its new tasks join `tasks` and the sampler)."""

    def __init__(self, agent, tasks: dict[str, object], make_env: Callable[[], object], sampler: TaskSampler,
                 groups: GroupAssembler, cfg: RLRunConfig, *, start_index: int = 0, workspace: str = "/workspace",
                 stride: int = 1, pool: TaskPool | None = None):
        self.agent, self.tasks, self.make_env, self.sampler, self.groups = agent, tasks, make_env, sampler, groups
        self.cfg, self.workspace, self.stride, self.pool = cfg, workspace, stride, pool
        self.monitor = Monitor(cfg.monitor)
        self.index = start_index
        self._published: tuple[object, int] = (None, start_index)    # (weights, version)
        self._out: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="rollout-producer", daemon=True)

    # -- the learner's side ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def publish(self, weights, version: int) -> None:
        """New policy weights (placed for the engine: `Engine.place_weights`) at `version`."""
        with self._cond:
            self._published = (weights, version)
            self._cond.notify_all()

    def next_batch(self) -> ProducedBatch:
        """The next batch, in order (blocks); re-raises a failure of the producer thread."""
        while True:
            try:
                item = self._out.get(timeout=POLL_S * 10)
            except queue.Empty:
                if not self._thread.is_alive() and self._out.empty():
                    raise RuntimeError(f"the rollout producer stopped: {self._failure!r}") from self._failure
                continue
            if item is None:
                raise RuntimeError(f"the rollout producer failed: {self._failure}") from self._failure
            return item

    def stop(self, wait_s: float = 30.0) -> None:
        """Stop after the current batch (episodes still running are abandoned)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(wait_s)

    # -- the producer thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self.run_batches(self._wait_published, self._out.put)
        except BaseException as e:       # handed to the learner by next_batch
            self._failure = e
            self._out.put(None)

    def _wait_published(self, min_version: int) -> tuple[object, int] | None:
        """The newest published (weights, version) once its version is >= min_version; None if stopped."""
        with self._cond:
            while not self._stop.is_set() and self._published[1] < min_version:
                self._cond.wait()
            return None if self._stop.is_set() else self._published

    def run_batches(self, wait_weights: Callable[[int], tuple[object, int] | None],
                    deliver: Callable[[ProducedBatch], None]) -> None:
        """Produce batches from `self.index` on until stopped: batch i starts once `wait_weights(i -
        max_staleness)` returns the newest (weights, version) with version >= i - max_staleness (weights
        None: the engine already holds that version), which are installed first; `deliver` takes each
        batch. The thread's loop and the remote engine's (`rl.remote`) are this one."""
        while not self._stop.is_set():
            published = wait_weights(self.index - self.cfg.rl.max_staleness)
            if published is None:
                return
            weights, version = published
            if weights is not None and version != self.agent.version:
                self.agent.update_weights(weights, version)
            produced = self.produce(self.index)
            if produced is None:      # stopped mid-batch
                return
            deliver(produced)
            self.index += self.stride

    def _episode(self, prompt: Prompt, sample: int, index: int, in_env: dict) -> Rollout:
        env = TimedEnv(self.make_env(), in_env, (prompt.draw, sample))
        episode = TokenEpisode(env, self.agent.tokenizer, rewards=self.cfg.rewards, train_step=index,
                               teach=self.cfg.rl.sd_flags)
        key = f"{prompt.draw}/{sample}"
        versions: list = []
        try:
            play(self.agent, episode, self.tasks[prompt.task_id], key, sample,
                 attempt_seed(self.cfg.seed, f"{prompt.task_id}#{prompt.draw}", sample), versions)
        finally:
            self.agent.end_episode(key)
            if hasattr(env.env, "close"):
                env.env.close()
        report = self.monitor.check(episode.turns, workspace=self.workspace, packages=getattr(env.env, "packages", ()))
        reward = self.monitor.apply([episode.reward], [report])[0]
        return Rollout(prompt, sample, episode, [v for turn in versions for v in (turn or ())], report, reward)

    def _grow(self) -> None:
        """The pool's new tasks join the task set and the sampler. With every task retired, wait for the
        pool's next tasks (there is nothing else to train on) while it can still make some."""
        while not self._stop.is_set():
            new = self.pool.poll(self.sampler.stats)
            self.tasks.update((t.id, t) for t in new)
            self.sampler.add_tasks(t.id for t in new)
            if self.sampler.active() or not self.pool.growing:
                return
            time.sleep(POLL_S * 10)

    def _engine_counts(self) -> dict[str, int] | None:
        """The engine's running counts of decode steps, the slots they offered and those busy, and with
        speculative decoding the tokens drafted and accepted (the engine adds them up at each decode
        call's host sync, nothing more); None for an agent without an engine. A batch's shares are the
        differences over it (`rl.records`)."""
        engine = getattr(self.agent, "engine", None)
        if engine is None:
            return None
        steps = engine.stats["decode_steps"]
        counts = {"engine_decode_steps": steps, "engine_slot_steps": steps * engine.max_slots,
                  "engine_busy_slot_steps": engine.stats["decode_busy_slot_steps"]}
        if getattr(engine, "speculative", False):
            counts.update(engine_drafted=engine.stats["drafted"], engine_accepted=engine.stats["accepted"])
        return counts

    def produce(self, index: int) -> ProducedBatch | None:
        """One batch for policy version `index` (None if stopped meanwhile)."""
        if self.pool is not None:
            self._grow()
            if self._stop.is_set():
                return None
        start, began = time.perf_counter(), time.time()
        before, engine_before = dict(self.groups.counts), self._engine_counts()
        prompts = self.sampler.draw(self.cfg.prompts_per_step)
        groups = GroupPlay(self, prompts, index)
        if not groups.play(self._stop):
            return None
        trainable, finished = groups.trainable, groups.finished
        trainable.sort(key=lambda g: g.prompt.draw)
        batch, versions = assemble(trainable, self.cfg)
        finished.sort(key=lambda x: (x.prompt.draw, x.sample))
        wall = time.perf_counter() - start
        metrics = rollout_metrics(finished, self.cfg.sampler.pass_threshold, wall, self.cfg.teacher_slots,
                                  self.cfg.rollout.feedback_window)
        metrics.update({f"groups_{k}": float(self.groups.counts[k] - before[k]) for k in COUNTS}, **groups.failures)
        metrics["groups_padded"] = float(self.cfg.prompts_per_step - len(trainable))
        if engine_before is not None:
            metrics.update({k: float(v - engine_before[k]) for k, v in self._engine_counts().items()})
        metrics.update(monitor_counts([x.report for x in finished]))
        metrics.update(self.sampler.summary())
        if self.pool is not None:
            metrics.update(self.pool.metrics(self.sampler.stats, self.tasks))
        samples = (picked_lines(finished, [s.rollout.key for g in trainable for s in g.samples], (self.cfg.seed, index))
                   if logs_batch(self.cfg.rl.log_rollouts_every, index) else [])
        return ProducedBatch(index, batch, [p.draw for p in prompts], [g.prompt for g in trainable],
                             [g.prompt.draw for g in trainable if g.feedback_only], versions, metrics,
                             [(x.key, x.report) for x in finished], json.loads(json.dumps(self.sampler.state_dict())),
                             self.groups.state_dict(), (began, time.time()), samples)


class GroupPlay:
    """The episodes of one batch: `group_size` of each prompt, each in its own thread. A lost one (it
    raised, or its environment hung past `rollout.timeout_s`) is played again or its group dropped, as
    the group assembler says; each finished one joins its group, and a complete group is trainable."""

    def __init__(self, producer: RolloutProducer, prompts: list[Prompt], index: int):
        self.producer, self.index = producer, index
        self.results: queue.Queue = queue.Queue()
        self.running: dict[tuple[int, int], Prompt] = {}
        self.in_env: dict[tuple[int, int], float] = {}     # rollouts inside their environment: since when
        self.next_sample = {p.draw: producer.cfg.rl.group_size for p in prompts}
        self.finished: list[Rollout] = []
        self.trainable: list[Group] = []
        self.failures = {"rollouts_crashed": 0, "rollouts_hung": 0}
        self.first_error: list[str] = []
        for prompt in prompts:
            producer.groups.open(prompt)
            for sample in range(producer.cfg.rl.group_size):
                self.launch(prompt, sample)

    def launch(self, prompt: Prompt, sample: int) -> None:
        def run():
            try:
                result = self.producer._episode(prompt, sample, self.index, self.in_env)
                self.results.put(((prompt.draw, sample), result, None))
            except BaseException as e:   # noqa: BLE001  (any failure of an episode loses that rollout only)
                self.results.put(((prompt.draw, sample), None, e))

        self.running[(prompt.draw, sample)] = prompt
        threading.Thread(target=run, name=f"rollout-{prompt.draw}-{sample}", daemon=True).start()

    def lose(self, prompt: Prompt) -> None:
        if self.producer.groups.lost(prompt):
            self.launch(prompt, self.next_sample[prompt.draw])
            self.next_sample[prompt.draw] += 1

    def abandon_hung(self) -> None:
        """Give up the rollouts inside their environment for longer than the timeout (their slots go)."""
        now = time.perf_counter()
        for key, since in list(self.in_env.items()):
            if key in self.running and now - since > self.producer.cfg.rollout.timeout_s:
                prompt = self.running.pop(key)
                self.failures["rollouts_hung"] += 1
                self.producer.agent.end_episode(f"{key[0]}/{key[1]}")
                self.lose(prompt)

    def receive(self, key: tuple[int, int], rollout: Rollout | None, error: BaseException | None) -> None:
        if key not in self.running:       # finished after it was given up
            return
        prompt = self.running.pop(key)
        if error is not None:
            self.failures["rollouts_crashed"] += 1
            self.first_error.append(f"{type(error).__name__}: {error}")
            self.lose(prompt)
            return
        self.finished.append(rollout)
        group = self.producer.groups.add(prompt, Sample(rollout.reward, rollout.episode.info["task_reward"], rollout))
        if group is not None:
            self.trainable.append(group)

    def play(self, stop: threading.Event) -> bool:
        """Until every episode finished or was lost (False: `stop` was set meanwhile); an error when every
        rollout was lost."""
        while self.running:
            if stop.is_set():
                return False
            try:
                item = self.results.get(timeout=POLL_S)
            except queue.Empty:
                self.abandon_hung()
                continue
            self.receive(*item)
        if not self.finished:
            raise RuntimeError(f"every rollout of batch {self.index} was lost; the first: "
                               f"{self.first_error[0] if self.first_error else 'timed out'}")
        return True

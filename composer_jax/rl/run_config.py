"""`composer-jax rl` run configs: the model, the fused step (`rl`), rollout production, the environment
and its tasks, rewards, task sampling, the reward-hacking monitor, periodic evaluation
and checkpoints. Read like the pretraining run configs (`train.config.load_config_with_model`: a named
model is inlined, `a.b=value` overrides, errors name the dotted key)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal

from composer_jax.config import ConfigError, MeshConfig, ModelConfig, check_fits_model, shipped_path
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.envs.coding import CodingEnvConfig
from composer_jax.envs.monitor import MonitorConfig
from composer_jax.envs.rewards import RewardConfig
from composer_jax.envs.tools import TOOL_NAMES
from composer_jax.envs.toy import FAMILIES
from composer_jax.infer.config import Speculative
from composer_jax.model_dirs import Chat, ModelSource, run_chat, run_chat_setup, source_for, source_spec
from composer_jax.rl.config import RLConfig
from composer_jax.rl.sampler import SamplerConfig
from composer_jax.rl.task_pool import PoolConfig
from composer_jax.train.config import CheckpointConfig, load_config_with_model


class EngineWeights(str):
    """The `rollout.weights` setting: learner or int4 for every engine, or a list of them, one per engine
    (`[int4, learner]`: engine 0 INT4, engine 1 the learner's weights)."""

    @classmethod
    def from_config(cls, value, key: str) -> str | tuple[str, ...]:
        if not isinstance(value, (list, tuple)):
            return _engine_weights(value, key)
        return tuple(_engine_weights(v, f"{key}[{i}]") for i, v in enumerate(value))


def _engine_weights(value, key: str) -> str:
    if value not in ENGINE_WEIGHTS:
        raise ConfigError(key, f"expected learner or int4, or a list of them (one per engine), got {value!r}")
    return value


ENGINE_WEIGHTS = ("learner", "int4")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How rollouts are produced (the inference engine, driven from one thread; episodes in threads)."""

    batch_size: int = 16            # trajectories per step: batch_size / rl.group_size prompts
    # 0: the engine shares the learner's devices; K: the engine on the last K, the learner on the rest (CPU: K more fake devices)
    devices: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0: no limit
    max_new_tokens: int = 16        # per assistant turn
    max_len: int = 128              # tokens per trajectory (the engine's context and the step's row length)
    max_slots: int = 16             # episodes decoding at once
    steps_per_call: int = 8         # decode steps per engine call
    # MTP speculative decoding: off, on (needs model.mtp.num_layers > 0), auto (on where the model has MTP depths
    # and the decode bench measured it faster on the platform: infer/speculation.py)
    speculative: Speculative = "auto"
    timeout_s: float = 120.0        # an environment call (reset, step) running longer loses its rollout (it hung)
    on_lost: Literal["refill", "drop"] = "refill"   # a lost rollout: run one more for its group, or drop the group
    max_refills: int = 2            # refills per group before it is dropped
    # teacher slots per trajectory, each one flagged turn with its hint (0: one per turn an episode may play,
    # env.max_turns, so every flagged turn teaches; the toy env without its tool plays one)
    feedback_slots: int = 0
    feedback_window: int = 128      # tokens per teacher slot: the hint, then the flagged turn (cut to fit: counted)
    # thread: the engine runs in the learner's process; directory: in its own (`composer-jax rl-engine`, same
    # config), exchanging weight versions and batches through files in exchange_dir (rl/exchange/)
    transport: Literal["thread", "directory"] = "thread"
    exchange_dir: str = ""          # directory transport: a directory both processes see ("": RUN_DIR/exchange)
    engine_timeout_s: float = 600.0  # directory transport: the learner's wait for a batch, the engine's for weights
    # directory transport: weight versions as files in exchange_dir, or pulled device to device from the
    # learner's devices (jax.experimental.transfer; rl/exchange/transport_device.py)
    weight_transfer: Literal["file", "device"] = "file"
    # directory transport: `composer-jax rl-engine --engine K` processes, K = 0..engines-1; engine K samples
    # its own share of the training tasks and produces batches K, K + engines, ... (rl/exchange/engine_process.py)
    engines: int = 1
    # the engines' policy: the learner's weights as they are, or int4: the routed experts through K2.5's INT4
    # quantizer (model.moe.expert_quant's), held by the engines as INT4 (engine processes get them quantized by
    # the learner); the step's importance weights see the difference, and the metrics behaviour_logp_gap(_max)
    # its size. Quantization-aware RL (model.moe.expert_quant=int4) trains that policy. A list sets it per
    # engine (rollout.engines entries: [int4, learner])
    weights: EngineWeights = "learner"

    def __post_init__(self):
        for name in ("batch_size", "max_new_tokens", "max_slots", "steps_per_call", "feedback_window"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        for name in ("devices", "max_refills", "feedback_slots", "top_k"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if self.max_len < 8:
            raise ConfigError("max_len", f"must be >= 8, got {self.max_len}")
        for name in ("timeout_s", "engine_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        if self.transport == "directory" and self.devices:
            raise ConfigError("devices", f"must be 0 with transport=directory (the engine uses its own process's "
                                         f"devices), got {self.devices}")
        if self.weight_transfer == "device" and self.transport != "directory":
            raise ConfigError("weight_transfer", "device needs transport=directory (with transport=thread the "
                                                 "engine's weights are copied device to device already)")
        if self.engines < 1:
            raise ConfigError("engines", f"must be >= 1, got {self.engines}")
        if self.engines > 1 and self.transport != "directory":
            raise ConfigError("engines", f"{self.engines} engine processes need transport=directory")
        if isinstance(self.weights, tuple) and len(self.weights) != self.engines:
            raise ConfigError("weights", f"lists {len(self.weights)} engines' weights for rollout.engines={self.engines}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError("temperature", "temperature must be >= 0 and top_p in (0, 1]")
        object.__setattr__(self, "speculative", Speculative.from_config(self.speculative, "speculative"))


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """The environment and its training / held-out tasks."""

    kind: Literal["toy", "coding"] = "toy"
    # chat / tool-call format: plain, kimi; "": init_from's, else kimi when the tokenizer has Kimi's markers
    # as single tokens, else plain
    format: Literal["", "plain", "kimi"] = ""
    family: str = "add"             # toy: add, copy or reverse
    length: int = 3                 # toy: letters per word
    use_tool: bool = False          # toy: answer through a `submit` tool call
    tasks: int = 64                 # toy: training tasks
    eval_tasks: int = 16            # toy: held-out tasks (prompts not among the training ones)
    tasks_dir: str = ""             # coding: the training tasks (composer-jax tasks feature-deletion output)
    eval_dir: str = ""              # coding: held-out tasks ("": none)
    repo: str = ""                  # coding without tasks_dir: make tasks from this repository (feature deletion) in RUN_DIR/tasks
    max_tasks: int = 20             # coding with repo: tasks to make (the last eval_tasks of them are held out)
    # coding: repositories to make more tasks from while training, as the policy solves its tasks (rl/task_pool.py;
    # empty: the task set stays as it is)
    repos: tuple[str, ...] = ()
    pool: PoolConfig = PoolConfig()  # coding with repos: how the task pool grows
    max_turns: int = 4              # coding, and toy with use_tool (a retry after a bad call): assistant turns per episode
    # coding: the tools declared to the agent (must include submit); []: the ones init_from was trained
    # with, else all
    tools: tuple[str, ...] = ()
    max_output_chars: int = 0       # coding: a tool result is cut to this many characters (0: init_from's, else 4000)
    repeat_limit: int = 3           # coding: the same call with the same result this many times running is flagged
    # coding: the signals that flag turns (style, communication, effort, wrong_tool; each counted either way)
    signals: tuple[str, ...] = CodingEnvConfig.signals
    max_final_chars: int = CodingEnvConfig.max_final_chars   # coding: a longer final message is flagged
    lint_edits: bool = CodingEnvConfig.lint_edits            # coding: lint each turn's edits (the style signal)
    # coding: record the files each `run` command opens (strace), for the monitor to judge (docs/environments.md)
    record_file_access: bool = CodingEnvConfig.record_file_access

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConfigError("family", f"must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        for name in ("length", "tasks", "max_turns", "max_final_chars"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        for name in ("eval_tasks", "max_output_chars"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        for key, value in (("tools", self.tools or TOOL_NAMES), ("signals", self.signals)):
            try:
                CodingEnvConfig(**{key: value})
            except ValueError as e:
                raise ConfigError(key, str(e).split(": ", 1)[-1]) from None
        if self.repeat_limit < 2:
            raise ConfigError("repeat_limit", f"must be >= 2, got {self.repeat_limit}")
        if self.repos and self.kind != "coding":
            raise ConfigError("repos", f"a growing task pool makes coding tasks: needs kind=coding, got {self.kind!r}")
        if self.kind == "coding" and not (self.tasks_dir or self.repo):
            raise ConfigError("tasks_dir", "the coding environment needs a task directory (composer-jax tasks "
                                           "feature-deletion REPO OUT) or a repository to make tasks from (env.repo)")

    def coding(self) -> CodingEnvConfig:
        """The coding environment's settings (unset tools and output limit: the environment's defaults)."""
        default = CodingEnvConfig()
        return CodingEnvConfig(max_turns=self.max_turns, max_output_chars=self.max_output_chars or
                               default.max_output_chars, tools=self.tools or default.tools,
                               repeat_limit=self.repeat_limit, signals=self.signals,
                               max_final_chars=self.max_final_chars, lint_edits=self.lint_edits,
                               record_file_access=self.record_file_access)

    def agent(self, rollout: RolloutConfig) -> dict:
        """The agent settings a run records (model_dirs.AGENT_KEYS): what `eval` of the run uses."""
        sampling = {"temperature": rollout.temperature, "top_p": rollout.top_p, "top_k": rollout.top_k,
                    "max_new_tokens": rollout.max_new_tokens}
        if self.kind != "coding":
            return sampling
        coding = self.coding()
        return {"tools": list(coding.tools), "max_output_chars": coding.max_output_chars, "max_turns": self.max_turns,
                **sampling}


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    every: int = 0                  # pass@1 on the held-out tasks every N steps and at the end (0: never)

    def __post_init__(self):
        if self.every < 0:
            raise ConfigError("every", f"must be >= 0, got {self.every}")


@dataclasses.dataclass(frozen=True)
class RLRunConfig:
    SOURCE_KEY = "init_from"        # the model source a run starts from (train.config.load_config_with_model)

    model: ModelConfig
    mesh: MeshConfig = MeshConfig()
    rl: RLConfig = RLConfig()       # the fused step; rl.steps is the run's length, rl.max_staleness its lag bound
    rollout: RolloutConfig = RolloutConfig()
    env: EnvConfig = EnvConfig()
    rewards: RewardConfig = RewardConfig()
    sampler: SamplerConfig = SamplerConfig()
    monitor: MonitorConfig = MonitorConfig()
    eval: EvalSettings = EvalSettings()
    checkpoint: CheckpointConfig = CheckpointConfig()
    # the policy RL starts from: a Hugging Face, converted or run directory (an SFT run's latest checkpoint) or
    # a Hugging Face model id (org/name, as train.init_from); also the KL reference and the fixed
    # self-distillation teacher. "": a fresh model of `model`
    init_from: str = ""
    tokenizer: str = ""             # "byte", a tokenizer.json / tiktoken file; "": init_from's, else byte
    seed: int = 0                   # model initialisation and rollout sampling
    # fake host devices for CPU runs (set before JAX starts); an in-process engine's rollout.devices come on top
    cpu_devices: int = 8
    progress: bool = True           # the progress bar (stderr)
    run_dir: str = "runs/rl"

    def __post_init__(self):
        if self.rollout.batch_size % self.rl.group_size:
            raise ConfigError("rollout.batch_size", f"{self.rollout.batch_size} trajectories per step are not a whole "
                                                    f"number of groups of rl.group_size={self.rl.group_size}")
        check_fits_model("rollout.max_len", self.rollout.max_len, self.model)
        if self.rollout.speculative == "on" and not self.model.mtp.num_layers:
            raise ConfigError("rollout.speculative", "on drafts with the MTP depths, and the model has none "
                                                     "(model.mtp.num_layers=0): use auto or off")
        if self.teacher_slots:   # a teacher slot is a sequence of its own
            check_fits_model("rollout.feedback_window", self.rollout.feedback_window, self.model)
        if not self.run_dir:
            raise ConfigError("run_dir", "is empty")
        for engine in range(self.rollout.engines):   # rollout.weights=int4 on a model it cannot quantize: at load
            self.engine_model(engine)
        if self.env.repos and self.rollout.transport != "thread":
            raise ConfigError("env.repos", "a growing task pool feeds the learner's own rollout producer: needs "
                                           f"rollout.transport=thread, got {self.rollout.transport!r}")

    def engine_model(self, engine: int = 0) -> ModelConfig:
        """The model rollout engine `engine` runs: the learner's, with INT4 routed experts where its
        rollout.weights is int4."""
        weights = self.rollout.weights if isinstance(self.rollout.weights, str) else self.rollout.weights[engine]
        if weights == "learner" or self.model.moe.expert_quant == "int4":
            return self.model
        try:
            return dataclasses.replace(self.model, moe=dataclasses.replace(self.model.moe, expert_quant="int4"))
        except ConfigError as e:
            raise ConfigError("rollout.weights", f"int4 needs a model whose expert widths it can quantize: {e}") from None

    @property
    def teacher_slots(self) -> int:
        """Teacher slots per row of the step's batch (0: self-distillation is off)."""
        if not self.rl.sd_coef > 0:
            return 0
        return self.rollout.feedback_slots or (self.env.max_turns if self.env.kind == "coding" or self.env.use_tool
                                               else 1)

    @property
    def host_cpu_devices(self) -> int:
        """The fake CPU devices a process of this run asks for: the learner's, and those of its in-process
        engine when it has its own."""
        return self.cpu_devices + (self.rollout.devices if self.rollout.transport == "thread" else 0)

    @property
    def prompts_per_step(self) -> int:
        return self.rollout.batch_size // self.rl.group_size

    def check_processes(self, n: int) -> None:
        """ConfigError naming the key a learner of `n` processes (a process group) cannot run with: it
        trains on the batches of `composer-jax rl-engine` (rollout.transport=directory) with weights through
        the directory, each process on its own block of whole groups, with no engine of its own to evaluate."""
        if n == 1:
            return
        if self.rollout.transport != "directory":
            raise ConfigError("rollout.transport", f"a learner of {n} processes trains on the batches of "
                                                   "`composer-jax rl-engine`: set rollout.transport=directory and "
                                                   "start the engine")
        if self.eval.every:
            raise ConfigError("eval.every", f"the held-out evaluation runs an engine inside the learner, which a "
                                            f"learner of {n} processes cannot: set eval.every=0 and evaluate a "
                                            "checkpoint with `composer-jax eval`")
        if self.rollout.batch_size % (n * self.rl.group_size):
            raise ConfigError("rollout.batch_size", f"{self.rollout.batch_size} trajectories do not split into whole "
                                                    f"groups of rl.group_size={self.rl.group_size} over {n} processes")
        if self.env.kind == "coding" and not self.env.tasks_dir:
            raise ConfigError("env.tasks_dir", f"{n} learner processes would each make the coding tasks in RUN_DIR/"
                                               "tasks: make them once (`composer-jax tasks feature-deletion`) and set "
                                               "env.tasks_dir")


def load_rl_config(path_or_name: str | Path, overrides=()) -> RLRunConfig:
    """An RL run YAML (a path or a bundled name such as rl-tiny), overrides applied, validated; run and
    task paths made absolute."""
    cfg = load_config_with_model(RLRunConfig, path_or_name, overrides)
    absolute = lambda p: str(Path(p).expanduser().absolute()) if p else p  # noqa: E731
    env = dataclasses.replace(cfg.env, tasks_dir=absolute(cfg.env.tasks_dir), eval_dir=absolute(cfg.env.eval_dir),
                              repo=shipped_path(cfg.env.repo), repos=tuple(map(shipped_path, cfg.env.repos)))
    for i, repo in enumerate(env.repos):
        if not Path(repo).is_dir():
            raise ConfigError(f"env.repos[{i}]", f"{repo}: does not exist or is not a directory")
        if repo in env.repos[:i]:
            raise ConfigError(f"env.repos[{i}]", f"{repo}: listed twice")
    rollout = cfg.rollout
    if rollout.transport == "directory":
        exchange = absolute(rollout.exchange_dir) or str(Path(absolute(cfg.run_dir)) / "exchange")
        _check_writable(exchange, must_exist=bool(rollout.exchange_dir))
        rollout = dataclasses.replace(rollout, exchange_dir=exchange)
    return dataclasses.replace(cfg, run_dir=absolute(cfg.run_dir), env=env, rollout=rollout,
                               init_from=source_spec(cfg.init_from), tokenizer=shipped_path(cfg.tokenizer))


def _check_writable(directory: str, must_exist: bool) -> None:
    """The exchange directory (one given explicitly must exist: it is shared, a missing one is a wrong
    path or a missing mount) or, for one made under RUN_DIR, its nearest existing parent, is writable."""
    path = Path(directory)
    if must_exist and not path.is_dir():
        raise ConfigError("rollout.exchange_dir", f"{directory}: does not exist or is not a directory (it must be "
                                                  "shared by the learner and the engine)")
    while not path.exists():
        path = path.parent
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError("rollout.exchange_dir", f"{path}: not a writable directory")


@dataclasses.dataclass
class RLSetup:
    """What an RL run (the learner or an engine) resolves from its config and its source."""

    cfg: RLRunConfig                # env.format, env.tools and env.max_output_chars filled in (from the source)
    source: ModelSource | None      # init_from, opened (configs only)
    chat: Chat                      # the run's tokenizer, format and agent settings (RUN_DIR/chat.json)
    tokenizer: Tokenizer


def resolve_run(cfg: RLRunConfig) -> RLSetup:
    """The run's source, chat and tokenizer: a run directory that recorded its chat keeps it; unset env
    settings (format, tools, tool-output limit) come from the source's agent settings. Errors name the key:
    a source that is not a model, a tokenizer larger than the model's vocabulary, a format it cannot express."""
    source = source_for(cfg.init_from, "init_from") if cfg.init_from else None
    recorded = Path(cfg.run_dir) if run_chat(cfg.run_dir) is not None else None
    chat, tokenizer, _ = run_chat_setup(recorded, source, cfg.tokenizer, cfg.env.format, {}, cfg.model.vocab_size,
                                        ("tokenizer", "env.format"))
    agent = chat.agent
    env = dataclasses.replace(cfg.env, format=chat.format, tools=cfg.env.tools or tuple(agent.get("tools") or ()),
                              max_output_chars=cfg.env.max_output_chars or int(agent.get("max_output_chars") or 0))
    cfg = dataclasses.replace(cfg, env=env)
    return RLSetup(cfg, source, dataclasses.replace(chat, agent=env.agent(cfg.rollout)), tokenizer)

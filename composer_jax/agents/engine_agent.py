"""An agent that samples a model with the inference engine: many episodes decode together in its slots.

    agent = open_engine_agent("runs/x", overrides=["max_slots=16", "max_len=8192"])
    evaluate(agent, tasks, "out/", EvalConfig(workers=16)); agent.close()

One driver thread owns the `composer_jax.infer.Engine` (which is not thread-safe). Episodes run in
the evaluation's worker threads; each `turn()` queues a request and waits for its completion. Before
every engine step the driver takes everything queued (new requests, releases, weight updates), so
the turns of all waiting episodes decode in the same steps, and a turn that arrives while others
decode joins them at the next step (continuous batching).

An episode keeps its slot between turns (`keep=True`): the next turn prefills only the tokens the
environment added (`continue_from`), never the history again. Every turn draws from its own seed,
`(attempt seed + turn) mod 2**32`, and the engine's draw for a token depends only on that seed and the
token's position, so an episode's tokens do not depend on which other episodes share its steps: the
same seeds give the same transcripts with any number of workers.

Each turn returns its tokens with their behaviour log-probs (under the distribution they were drawn
from) and the version of the weights that produced each one: `update_weights(params, version)` (the
RL learner, between batches) swaps the engine's weights without recompiling.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from composer_jax import config as config_lib
from composer_jax.agents.errors import AgentError
from composer_jax.agents.protocol import AgentTurn, ContextFull, TurnRequest
from composer_jax.config import ConfigError, ModelConfig
from composer_jax.data.chat import format_for
from composer_jax.data.tokenizer import ByteTokenizer, Tokenizer
from composer_jax.envs.protocol import FORMATS, ToolFormat, get_format
from composer_jax.infer import Completion, Engine, GenerationError, SamplingParams
from composer_jax.infer.config import GenerateConfig

MAX_LEN_CAP = 32768   # the default context when the model allows more (the cache is max_slots x max_len)


@dataclasses.dataclass(frozen=True)
class EngineAgentConfig(GenerateConfig):
    """`composer-jax generate`'s settings (their checks included) with an agent's defaults and its
    tool-call format. Two of them do not apply to an agent and must keep their defaults: a turn
    draws from its attempt's seed (`seed`) and ends at the format's end of turn (`stop`)."""

    max_new_tokens: int = 1024      # per assistant turn
    max_slots: int = 8              # episodes decoding at once (more workers queue)
    max_len: int = 0                # context per episode (cache positions); 0: the model's, at most MAX_LEN_CAP
    format: str = ""                # tool-call format; "": kimi if the tokenizer has its special tokens, else plain

    def __post_init__(self):
        super().__post_init__()
        if not self.max_slots:
            raise ConfigError("max_slots", "must be > 0, got 0")
        for name, meaning in (("seed", "a turn draws from its attempt's seed (--seed)"),
                              ("stop", "a turn ends at the format's end of turn")):
            if getattr(self, name):
                raise ConfigError(name, f"does not apply to an agent ({meaning}), got {getattr(self, name)!r}")
        if self.format and self.format not in FORMATS:
            raise ConfigError("format", f"must be one of {', '.join(FORMATS)} or empty, got {self.format!r}")

    def sampling(self, seed: int) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k, seed % 2**32)


def tool_format(tokenizer: Tokenizer, choice: str = "") -> ToolFormat:
    """The format `choice` names, or kimi when every Kimi marker is one token of `tokenizer` (a real Kimi
    checkpoint), else plain `<tool_call>` text (`composer_jax.data.chat.format_for`); an AgentError when
    `choice` needs markers the tokenizer splits."""
    try:
        return get_format(format_for(tokenizer, choice))
    except ValueError as e:
        raise AgentError(str(e)) from None


def turn_stops(tokenizer: Tokenizer, fmt: ToolFormat, eos_ids: Sequence[int] = ()) -> tuple[tuple[int, ...],
                                                                                           tuple[str, ...]]:
    """(stop tokens, stop strings) that end a turn: the format's end-of-turn marker as a token when the
    tokenizer makes it one (else as text), and the model's end-of-sequence ids."""
    end = [int(i) for i in tokenizer.encode(fmt.end_of_turn)]
    tokens = tuple(dict.fromkeys([*map(int, eos_ids), *(end if len(end) == 1 else [])]))
    return tokens, (() if len(end) == 1 else (fmt.end_of_turn,))


@dataclasses.dataclass
class _Episode:
    request_id: int     # its last request, kept in a slot
    length: int         # tokens the engine holds for it


class EngineAgent:
    """The Agent protocol over an Engine (see the module docstring).

    model: a CausalLM (its `mesh` decides the engine's layout); tokenizer: what the environment encodes
    with (its ids must be in the model's vocabulary); name: what is evaluated (run.json, `eval
    compare`); eos_ids: stop tokens besides the format's end-of-turn marker; trained_with: the agent settings
    the model was trained with (tools, tool-output limit, turns: the evaluation's defaults). `settings` (pinned in
    run.json) holds what changes the tokens: sampling, turn length, context, format and `pinned`
    (e.g. model overrides); slots and steps per call do not, so a resumed run may change them."""

    def __init__(self, model, tokenizer: Tokenizer, name: str, config: EngineAgentConfig = EngineAgentConfig(), *,
                 eos_ids: Sequence[int] = (), pinned: dict | None = None, trained_with: dict | None = None):
        limit = model.cfg.rope.max_position_embeddings
        max_len = config.max_len or min(limit, MAX_LEN_CAP)
        if max_len > limit:
            raise AgentError(f"max_len={max_len} exceeds the model's {limit} positions (rope.max_position_embeddings)")
        if tokenizer.vocab_size > model.cfg.vocab_size:
            raise AgentError(f"{name}: the tokenizer has {tokenizer.vocab_size} ids, more than the model's vocabulary "
                            f"of {model.cfg.vocab_size}")
        self.name, self.config, self.tokenizer = name, config, tokenizer
        self.trained_with = dict(trained_with or {})   # the model's recorded agent settings (model_dirs.Chat.agent)
        self.fmt = tool_format(tokenizer, config.format)
        self.stop_tokens, self.stop_strings = turn_stops(tokenizer, self.fmt, eos_ids)
        try:
            self.engine = Engine(model, max_slots=config.max_slots, max_len=max_len,
                                 steps_per_call=config.steps_per_call, speculative=config.speculative,
                                 draft_tokens=config.draft_tokens, eos_ids=self.stop_tokens,
                                 detokenize=lambda ids: tokenizer.decode(ids))
        except GenerationError as e:
            raise AgentError(f"{name}: {e}") from None
        self.settings = {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k,
                         "max_new_tokens": config.max_new_tokens, "max_len": max_len, "format": self.fmt.name,
                         **(pinned or {})}
        # requests: turns submitted; max_requests_per_step: most requests that advanced in one engine step
        self.stats: collections.Counter = collections.Counter()
        self._episodes: dict[str, _Episode] = {}
        self._inbox: list[tuple[Callable[[], None], Future | None]] = []   # commands, the future each answers
        self._waiting: dict[int, Future] = {}        # request id -> the future of the worker waiting for it
        self._wake = threading.Condition()
        self._closing, self._failure = False, None
        self._driver = threading.Thread(target=self._drive, name="engine-agent", daemon=True)
        self._driver.start()

    # ------------------------------------------------------------------------------------------
    # the Agent protocol (any thread)

    def turn(self, request: TurnRequest) -> AgentTurn:
        held = self._episodes.get(request.episode)   # stays until a new request replaces it: end_episode frees it
        if held is not None and not request.turn:   # the key starts over: its old slot goes
            del self._episodes[request.episode]
            self._send(lambda: self.engine.release(held.request_id))
            held = None
        total, room = len(request.tokens), self.engine.max_len - len(request.tokens)
        if held is None and request.turn:
            raise AgentError(f"episode {request.episode}: turn {request.turn} of an episode this agent did not start")
        if held is not None and total - len(request.new_tokens) != held.length:
            raise AgentError(f"episode {request.episode}: {total - len(request.new_tokens)} tokens before the new ones, "
                            f"the engine holds {held.length}: the episode must pass on the turns as generated")
        if room <= 0:
            if held is None:
                raise AgentError(f"task {request.task}: its prompt of {total} tokens does not fit the agent's context "
                                f"(max_len={self.engine.max_len}); raise max_len")
            raise ContextFull(f"{total} tokens fill the context (max_len={self.engine.max_len})")
        future: Future = Future()
        previous = None if held is None else held.request_id
        sampling = self.config.sampling(request.seed + request.turn)
        self._send(lambda: self._submit(list(request.new_tokens), sampling, previous, future), future)
        try:
            completion: Completion = future.result()
        except GenerationError as e:   # refused: the previous request is still kept
            raise AgentError(f"episode {request.episode}: {e}") from None
        self._episodes[request.episode] = _Episode(completion.request_id, total + len(completion.tokens))
        return AgentTurn(list(completion.tokens), list(completion.behaviour_logprobs), list(completion.versions))

    def end_episode(self, episode: str) -> None:
        held = self._episodes.pop(episode, None)
        if held is not None and self._failure is None and not self._closing:   # else its slot is gone anyway
            self._send(lambda: self.engine.release(held.request_id))

    # ------------------------------------------------------------------------------------------
    # the learner's side

    def update_weights(self, weights, version: int) -> None:
        """Swap in new weights (a CausalLM or its nnx.State, same shapes) between engine steps; tokens
        produced from then on record `version`. Returns once they are in place."""
        self._between_steps(lambda: self.engine.update_weights(weights, version))

    def release_weights(self) -> None:
        """Drop the engine's weights between engine steps (`Engine.release_weights`): the next version
        lands without the current one beside it. Returns once they are gone."""
        self._between_steps(self.engine.release_weights)

    def _between_steps(self, command: Callable[[], None]) -> None:
        """Run `command` on the driver between engine steps; returns once it ran (raising what it raised)."""
        done: Future = Future()

        def run():
            try:
                command()
                done.set_result(None)
            except Exception as e:   # handed to the caller, the driver goes on
                done.set_exception(e)

        self._send(run, done)
        done.result()

    @property
    def version(self) -> int:
        return self.engine.version

    def close(self) -> None:
        """Stop the driver once the running requests have finished (turns after this are refused)."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._driver.join()

    def __enter__(self) -> EngineAgent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------
    # the driver thread

    def _send(self, command: Callable[[], None], answers: Future | None = None) -> None:
        """Queue `command` for the driver; `answers`: the future it settles (failed if it never runs)."""
        with self._wake:
            if self._failure is not None:
                raise AgentError(f"{self.name}: the engine failed earlier: {self._failure}")
            if self._closing:
                raise AgentError(f"{self.name}: the agent is closed")
            self._inbox.append((command, answers))
            self._wake.notify()

    def _submit(self, prompt: list[int], sampling: SamplingParams, previous: int | None, future: Future) -> None:
        try:
            request_id = self.engine.submit(prompt, max_new_tokens=self.config.max_new_tokens, sampling=sampling,
                                            stop_strings=self.stop_strings, keep=True, continue_from=previous)
        except Exception as e:   # a request the engine refuses fails its turn only
            future.set_exception(e)
            return
        self._waiting[request_id] = future
        self.stats["requests"] += 1

    def _drive(self) -> None:
        inbox: list = []
        try:
            while True:
                with self._wake:
                    # not `idle`: a request queued while every slot is kept must wait, not spin
                    while not self._inbox and not self.engine.busy and not self._closing:
                        self._wake.wait()
                    inbox, self._inbox = self._inbox, []
                    if self._closing and not inbox and self.engine.idle:
                        return
                while inbox:
                    command, _ = inbox.pop(0)
                    command()
                if self._closing:   # no turn follows any more: free the kept slots, or queued requests never start
                    for request_id in list(self.engine.kept):
                        self.engine.release(request_id)
                if self.engine.busy:
                    self._step()
        except BaseException as e:   # the engine broke: fail every waiting turn, refuse new ones
            with self._wake:
                self._failure = e
                inbox += self._inbox
            for future in [*self._waiting.values(), *(f for _, f in inbox if f is not None)]:
                if not future.done():
                    future.set_exception(e)

    def _step(self) -> None:
        updates = self.engine.step()
        self.stats["engine_steps"] += 1
        advanced = len({u.request_id for u in updates})
        self.stats["max_requests_per_step"] = max(self.stats["max_requests_per_step"], advanced)
        for update in updates:
            if update.finished is not None:
                self._waiting.pop(update.request_id).set_result(update.finished)


def _load_error(spec: str, e: BaseException) -> AgentError:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return AgentError(f"MODEL {spec!r}: does not load: {text}")


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens")   # agent settings a run records that sample


def open_engine_agent(spec: str, *, temperature: float | None = None, overrides: Sequence[str] = (),
                      episodes_at_once: int = 0) -> EngineAgent:
    """An EngineAgent for the model directory `spec` (composer_jax.source_weights.open_model: a Hugging Face
    directory, a converted directory or a training run's latest checkpoint, with its tokenizer; a model
    without one must be byte-level: a 256-id vocabulary). Its chat format and the sampling it was trained
    with (the run's agent settings) are the defaults; `overrides`: `key=value` EngineAgentConfig fields and
    `model.KEY=VALUE` model config changes; `temperature`, when given, wins over theirs. `episodes_at_once`
    (the caller's workers; 0: unknown) sizes `max_slots` unless an override sets it: a slot nobody fills
    still decodes every step (8 slots for 1 episode made the tiny model's decode 5x slower). The agent's
    `trained_with` holds the recorded agent settings (tools, tool-output limit, turns) for the environment."""
    from composer_jax.source_weights import open_model

    model_overrides = [o.removeprefix("model.") for o in overrides if o.startswith("model.")]
    try:
        config_lib.apply_overrides(ModelConfig, {}, model_overrides)   # unknown model keys fail before loading
        agent_overrides = [o for o in overrides if not o.startswith("model.")]
        if temperature is not None:
            agent_overrides.append(f"temperature={temperature}")
        config_lib.apply_overrides(EngineAgentConfig, {}, agent_overrides)
    except ValueError as e:   # ConfigError
        raise AgentError(f"MODEL {spec!r}: agent setting: {e}") from None
    try:
        opened = open_model(spec, model_overrides)
    except (ValueError, OSError) as e:   # CheckpointError, ConfigError, TokenizerError, FileNotFoundError
        raise _load_error(spec, e) from None
    trained = opened.chat.agent
    defaults = {k: trained[k] for k in SAMPLING_KEYS if trained.get(k) is not None}
    if opened.chat.format:
        defaults["format"] = opened.chat.format
    if episodes_at_once:
        defaults["max_slots"] = min(episodes_at_once, EngineAgentConfig.max_slots)
    try:
        config = config_lib.from_dict(EngineAgentConfig, config_lib.apply_overrides(EngineAgentConfig, defaults,
                                                                                    agent_overrides))
    except ValueError as e:   # ConfigError, or SamplingParams' check
        raise AgentError(f"MODEL {spec!r}: agent setting: {e}") from None
    tokenizer = opened.tokenizer
    if tokenizer is None:
        if opened.model.cfg.vocab_size != ByteTokenizer.vocab_size:
            raise AgentError(f"MODEL {spec!r}: no tokenizer (tokenizer.json or tiktoken.model) and a vocabulary of "
                            f"{opened.model.cfg.vocab_size} ids, not byte-level")
        tokenizer = ByteTokenizer()
    return EngineAgent(opened.model, tokenizer, opened.description, config, eos_ids=opened.eos_ids,
                       pinned={"model_overrides": model_overrides} if model_overrides else None, trained_with=trained)

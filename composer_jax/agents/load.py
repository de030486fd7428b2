"""`load_agent(spec)`: the agent a MODEL argument names (`composer-jax eval MODEL TASKS_DIR`):
`scripted:PATH`, fixed tool-call scripts per task (`ScriptedAgent`), or a model directory (Hugging
Face, converted, or a training run) sampled by the inference engine (`EngineAgent`, imported only
then: loading a scripted agent imports no jax)."""

from __future__ import annotations

from collections.abc import Sequence

from composer_jax.agents.errors import AgentError
from composer_jax.agents.protocol import Agent
from composer_jax.agents.scripted import SCRIPTED, ScriptedAgent


def load_agent(spec: str, *, temperature: float | None = None, overrides: Sequence[str] = (),
               episodes_at_once: int = 0) -> Agent:
    """The agent a MODEL argument names; `temperature` None: the agent's default.

    `scripted:PATH`: a ScriptedAgent (it does not sample: a temperature or settings are an error).
    Anything else is a model (a Hugging Face directory or model id, a converted directory or a training
    run) sampled by the inference engine: an EngineAgent, configured by `overrides` (`key=value`:
    EngineAgentConfig fields, `model.KEY=VALUE` model config changes; `episodes_at_once`, the episodes
    the caller runs together, sizes its slots unless `max_slots` is given). Call its `close()` when done."""
    if spec.startswith(SCRIPTED):
        if temperature is not None:
            raise AgentError(f"MODEL {spec!r}: a scripted agent does not sample; --temperature does not apply")
        if overrides:
            raise AgentError(f"MODEL {spec!r}: a scripted agent takes no settings, got {' '.join(overrides)}")
        return ScriptedAgent(spec[len(SCRIPTED):])
    from composer_jax.agents.engine_agent import open_engine_agent   # jax: only for a model

    return open_engine_agent(spec, temperature=temperature, overrides=overrides, episodes_at_once=episodes_at_once)

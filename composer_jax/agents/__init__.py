"""Agents and what they play: the Agent protocol, the scripted agent, the engine agent (a model sampled
by the inference engine, `composer_jax.agents.engine_agent`), one episode played token-in token-out,
and coding task sets. Evaluation (composer_jax.eval) scores agents on task sets; RL
(composer_jax.rl) trains the engine agent's model on its episodes. Importing this package imports no
jax: the engine agent is imported by name, or by `load_agent` for a model.

    from composer_jax.agents import load_agent, load_task_set
    agent = load_agent("scripted:scripts.json")
"""

from composer_jax.agents.episode import attempt_seed, play
from composer_jax.agents.errors import AgentError
from composer_jax.agents.load import load_agent
from composer_jax.agents.protocol import Agent, AgentTurn, ContextFull, TurnRequest
from composer_jax.agents.scripted import SCRIPTED, ScriptedAgent
from composer_jax.agents.task_sets import coding_env, load_task_set

__all__ = ["SCRIPTED", "Agent", "AgentError", "AgentTurn", "ContextFull", "ScriptedAgent", "TurnRequest",
           "attempt_seed", "coding_env", "load_agent", "load_task_set", "play"]

"""Evaluation: agents on task sets, pass@k, efficiency and interaction scores with bootstrap intervals,
and paired A/B comparison. Host-side (no jax): the agent that samples a model with the inference
engine (composer_jax.eval.engine_agent, `load_agent(MODEL_DIR)`) imports jax when it is made.

    from composer_jax.eval import EvalConfig, evaluate, load_agent, load_task_set
    summary = evaluate(load_agent("scripted:scripts.json"), load_task_set("tasks/"), "out/",
                       EvalConfig(samples=4, workers=4))
    summary.scores["pass@1"].value, summary.scores["pass@1"].ci
"""

from composer_jax.eval.agent import Agent, AgentTurn, ContextFull, ScriptedAgent, TurnRequest, load_agent
from composer_jax.eval.compare import Comparison, compare_runs, comparison_plot, comparison_table
from composer_jax.eval.errors import EvalError
from composer_jax.eval.runner import EvalConfig, evaluate, load_task_set
from composer_jax.eval.scores import Estimate, pass_at_k
from composer_jax.eval.summary import Summary, summary_table

__all__ = ["Agent", "AgentTurn", "Comparison", "ContextFull", "Estimate", "EvalConfig", "EvalError", "ScriptedAgent",
           "Summary", "TurnRequest", "compare_runs", "comparison_plot", "comparison_table", "evaluate", "load_agent",
           "load_task_set", "pass_at_k", "summary_table"]

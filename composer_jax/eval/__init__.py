"""Evaluation: agents (composer_jax.agents) on task sets, pass@k, efficiency and interaction scores with
bootstrap intervals, and paired A/B comparison. Host-side: importing it imports no jax (the engine
agent, composer_jax.agents.engine_agent, does when `load_agent` makes one for a model).

    from composer_jax.agents import load_agent, load_task_set
    from composer_jax.eval import EvalConfig, evaluate
    summary = evaluate(load_agent("scripted:scripts.json"), load_task_set("tasks/"), "out/",
                       EvalConfig(samples=4, workers=4))
    summary.scores["pass@1"].value, summary.scores["pass@1"].ci
"""

from composer_jax.eval.compare import Comparison, compare_runs, comparison_plot, comparison_table
from composer_jax.eval.errors import EvalError
from composer_jax.eval.runner import EvalConfig, evaluate
from composer_jax.eval.scores import Estimate, pass_at_k
from composer_jax.eval.summary import Summary, summary_table

__all__ = ["Comparison", "EvalConfig", "EvalError", "Estimate", "Summary", "compare_runs", "comparison_plot",
           "comparison_table", "evaluate", "pass_at_k", "summary_table"]

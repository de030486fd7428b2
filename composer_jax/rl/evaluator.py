"""The RL run's held-out evaluation: every `eval.every` steps (and at the last), pass@1 of the current
policy on the held-out tasks (`composer_jax.eval.evaluate`, one sample each), written to
RUN_DIR/eval/step-N/. It samples with the rollout engine when it runs in this process, else with an
engine of its own over the learner's policy, made at the first evaluation."""

from __future__ import annotations

from pathlib import Path

from composer_jax.agents.engine_agent import EngineAgent
from composer_jax.eval import EvalConfig, evaluate
from composer_jax.rl.engines import policy_engine
from composer_jax.rl.run_config import RLRunConfig
from composer_jax.rl.task_sets import TaskSets


class HeldOutEvaluator:
    """`rollout_agent`: the in-process rollout engine (None: the engines run elsewhere)."""

    def __init__(self, cfg: RLRunConfig, tasks: TaskSets, run_dir: Path, tokenizer,
                 rollout_agent: EngineAgent | None):
        self.cfg, self.tasks, self.run_dir, self.tokenizer = cfg, tasks, run_dir, tokenizer
        self.agent, self.own = rollout_agent, None

    def due(self, step: int) -> bool:
        every = self.cfg.eval.every
        return bool(every and self.tasks.held_out and (step % every == 0 or step == self.cfg.rl.steps))

    def __call__(self, step: int, learner) -> dict:
        """{"eval_pass@1", "eval_version"} of the policy at `step`."""
        if self.agent is None:
            self.agent = self.own = policy_engine(self.cfg, self.tokenizer, learner)
        elif self.agent is self.own:
            self.agent.update_weights(self.agent.engine.place_weights(learner.policy()), learner.version)
        held_out = self.tasks.held_out
        summary = evaluate(self.agent, held_out, self.run_dir / "eval" / f"step-{step}",
                           EvalConfig(samples=1, workers=min(len(held_out), self.cfg.rollout.max_slots),
                                      max_turns=self.cfg.env.max_turns, seed=self.cfg.seed),
                           make_env=self.tasks.make_env)
        return {"eval_pass@1": summary.scores["pass@1"].value, "eval_version": float(self.agent.version)}

    def close(self) -> None:
        """Stop the engine it made (the rollout engine is the run's to close)."""
        if self.own is not None:
            self.own.close()

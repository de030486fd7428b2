"""The settings an engine's batches depend on, which it must share with the learner (the learner puts its
own in the session; each engine checks its own against them)."""

from __future__ import annotations

import json

from composer_jax.config import to_dict
from composer_jax.rl.exchange.directory import ExchangeError
from composer_jax.rl.run_config import RLRunConfig

# What the engine's batches depend on: these settings must be the learner's (paths may differ by host).
# rl.log_rollouts_every: whether the engine picks episodes for RUN_DIR/rollouts.jsonl (rl.rollout_log).
ENGINE_SECTIONS = ("model", "rollout", "env", "rewards", "sampler", "monitor", "seed", "rl.group_size",
                   "rl.max_staleness", "rl.log_rollouts_every")
HOST_LOCAL = {"rollout.exchange_dir", "rollout.engine_timeout_s", "rollout.devices", "env.tasks_dir", "env.eval_dir",
              "env.repo"}


def _flatten(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix: tree}
    return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()} if tree else {}


def engine_settings(cfg: RLRunConfig) -> dict:
    """The dotted settings the engine's batches depend on (ENGINE_SECTIONS, host-local paths left out), in
    their JSON form (as the session file carries them)."""
    flat = {k.rstrip("."): v for k, v in _flatten(to_dict(cfg)).items()}
    return json.loads(json.dumps({k: v for k, v in flat.items() if k not in HOST_LOCAL
                                  and any(k == s or k.startswith(s + ".") for s in ENGINE_SECTIONS)}))


def check_same_settings(learner: dict, engine: dict) -> None:
    """ExchangeError naming the first setting where the engine's config differs from the learner's."""
    for key in sorted(learner.keys() | engine.keys()):
        if learner.get(key) != engine.get(key):
            raise ExchangeError(f"the engine's config differs from the learner's at '{key}' ({engine.get(key)!r}, "
                                f"the learner's {learner.get(key)!r}): start both with the same config and overrides")

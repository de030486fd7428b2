"""`composer-jax generate` settings: a typed config read from `key=value` arguments."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from composer_jax.config import ConfigError, apply_overrides, from_dict
from composer_jax.infer import speculation


class Speculative(str):
    """The `speculative` setting: off, on or auto (on where the model has MTP depths and the decode bench
    measured it faster on the platform: `infer.speculation`); YAML's booleans (on / off / true / false)
    read as on / off."""

    @classmethod
    def from_config(cls, value, key: str) -> str:
        try:
            return speculation.setting(value)
        except ValueError as e:
            raise ConfigError(key, str(e)) from None


RECORDED = ("temperature", "top_p", "top_k", "max_new_tokens")   # the sampling a run records for its agent


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    max_new_tokens: int = 256
    temperature: float = 1.0        # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0: no limit
    seed: int = 0                   # request i uses seed + i
    speculative: Speculative = "auto"   # MTP speculative decoding: off, on, auto (where measured faster)
    draft_tokens: int = 0           # speculative drafts per step (0: infer.speculation.DEFAULT_DRAFT_TOKENS)
    stop: str = ""                  # a stop string ("" : none); --chat adds the template's end marker
    max_slots: int = 0              # requests decoded at once; 0: every prompt, as memory allows
    max_len: int = 0                # cache positions per slot; 0: the longest prompt + max_new_tokens
    steps_per_call: int = 8         # decode steps per engine call (and per streamed chunk)

    def __post_init__(self):
        for name in ("max_new_tokens", "steps_per_call"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ConfigError("temperature", f"must be >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "speculative", Speculative.from_config(self.speculative, "speculative"))
        for name in ("top_k", "max_len", "max_slots", "draft_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**32:
            raise ConfigError("seed", f"must be in [0, 2**32), got {self.seed}")


def load_generate_config(overrides: Sequence[str], recorded: dict | None = None) -> GenerateConfig:
    """`key=value` overrides over a run's recorded agent settings (their RECORDED keys, where set)."""
    defaults = {k: v for k, v in (recorded or {}).items() if k in RECORDED and v is not None}
    return from_dict(GenerateConfig, apply_overrides(GenerateConfig, defaults, list(overrides)))

"""The reference of config keys (`composer-jax config keys`, and with `--markdown` the page
docs/config-keys.md): every key of the configs a user writes, with its type, default and meaning, read
from the dataclasses' source (`config.describe_keys`), so the page cannot drift from the code."""

from __future__ import annotations

from composer_jax.config import KeyInfo, describe_keys

# kind -> what reads it
KINDS = {
    "run": "`composer-jax pretrain` and `composer-jax sft` run configs (YAML files, `key=value` overrides)",
    "rl": "`composer-jax rl` and `composer-jax rl-engine` run configs",
    "model": "model configs (`configs/model/*.yaml`; the `model.` section of a run config)",
    "generate": "`composer-jax generate` settings (`key=value` after MODEL)",
    "eval": "`composer-jax eval` settings of a model agent (`key=value` after TASKS_DIR)",
}


def config_class(kind: str) -> type:
    """The dataclass of `kind` (imported here: the RL and eval configs pull in their packages)."""
    from composer_jax.config import ModelConfig
    from composer_jax.agents.engine_agent import EngineAgentConfig
    from composer_jax.infer.config import GenerateConfig
    from composer_jax.rl.run_config import RLRunConfig
    from composer_jax.train.config import RunConfig

    return {"run": RunConfig, "rl": RLRunConfig, "model": ModelConfig, "generate": GenerateConfig,
            "eval": EngineAgentConfig}[kind]


def keys_of(kind: str) -> list[KeyInfo]:
    return describe_keys(config_class(kind))


def text_table(kind: str) -> str:
    """Aligned columns: key, default, meaning [type]."""
    keys = keys_of(kind)
    w_key = max(len("key"), *(len(k.key) for k in keys))
    w_default = max(len("default"), *(len(k.default) for k in keys))
    lines = [f"{'key':<{w_key}}  {'default':<{w_default}}  meaning [type]"]
    lines += [f"{k.key:<{w_key}}  {k.default:<{w_default}}  {k.meaning + ' ' if k.meaning else ''}[{k.type}]"
              for k in keys]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def markdown_section(kind: str) -> str:
    """One kind's keys as a Markdown table; a run config's `model.*` keys point to the model section."""
    title, cls = KINDS[kind], config_class(kind)
    target = f"{cls.__module__}:{cls.__qualname__}"
    keys = keys_of(kind)
    has_model = kind != "model" and any(k.key.startswith("model.") for k in keys)
    lines = [f"## {kind}", "", f"{title[0].upper()}{title[1:]}: `{target}`" + (
        "; its `model.*` keys are those of [model](#model), under `model.`." if has_model else "."), ""]
    doc = (cls.__doc__ or "").strip()
    if doc and not doc.startswith(f"{cls.__name__}("):   # dataclasses write a signature when there is none
        lines += [" ".join(doc.split()), ""]
    lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    lines += [f"| `{k.key}` | {_cell(k.type)} | {_cell(_code(k.default))} | {_cell(k.meaning)} |"
              for k in keys if not (has_model and k.key.startswith("model."))]
    return "\n".join(lines)


def markdown_page() -> str:
    """The whole reference, docs/config-keys.md: one section per kind."""
    intro = ("Generated from the source by `composer-jax config keys --markdown > docs/config-keys.md` "
             "(a test checks this page equals the command's output). Each meaning is the comment beside "
             "(or above) the field in its dataclass; a key without one has none. `(required)`: no default, "
             "the config must set it. Any key is overridable on the command line as a dotted `key=value`.")
    return "\n".join(["# Config keys", "", intro, "", "\n\n".join(markdown_section(kind) for kind in KINDS)]) + "\n"


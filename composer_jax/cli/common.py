"""Helpers shared by the command modules: number formatting, argument types, logging, command groups."""

from __future__ import annotations

import argparse
import logging
import math
import sys

from composer_jax.checkpoint.safetensors_io import CheckpointError
from composer_jax.config import ConfigError
from composer_jax.data.errors import DataError

EXIT_USAGE = 2
USAGE_ERRORS = (ConfigError, CheckpointError, FileNotFoundError, DataError)  # one line on stderr, exit EXIT_USAGE


def command_error(command: str, error: Exception, status: int = EXIT_USAGE) -> int:
    """`composer-jax COMMAND: error: ...` on stderr (one line, no traceback); the exit status."""
    print(f"composer-jax {command}: error: {error}", file=sys.stderr)
    return status


def human(n: float, units=("", "K", "M", "B", "T")) -> str:
    """3 significant digits with a unit suffix: 1026408232448 -> '1.03T', 32861500928 -> '32.9B'."""
    if n == 0:
        return "0"
    tier = min(int(math.log10(abs(n)) // 3), len(units) - 1)
    x = n / 1000 ** tier
    decimals = max(0, 2 - int(math.floor(math.log10(abs(x))))) if tier else 0
    return f"{x:.{decimals}f}{units[tier]}"


def human_flops(n: float) -> str:
    return human(n, ("", "K", "M", "G", "T", "P", "E"))


def _int_at_least(text: str, low: int, kind: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {kind} integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected a {kind} integer, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "positive")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "non-negative")


def command_group(sub, name: str, help_text: str, default: str | None = None):
    """A command with subcommands (`composer-jax NAME COMMAND ...`); returns their subparsers. `default`:
    the subcommand that runs when the first argument names none."""
    group = sub.add_parser(name, help=help_text).add_subparsers(dest=f"{name}_command", required=True,
                                                               metavar="command")
    group.default_command = default   # read by _with_default_subcommand
    return group


def subcommand(group, name: str, run, help_text: str, description: str) -> argparse.ArgumentParser:
    """A subcommand of a `command_group` that runs `run(args) -> exit code`."""
    p = group.add_parser(name, help=help_text, description=description)
    p.set_defaults(run=run)
    return p


def quiet_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("absl", "jax", "orbax", "tensorboardX"):
        logging.getLogger(name).setLevel(logging.WARNING)


def log_to_stderr(command: str, quiet: bool) -> bool:
    logger = logging.getLogger("composer_jax.checkpoint")
    if not quiet and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"composer-jax {command}: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return not quiet and sys.stderr.isatty()


def load_model_or_run_config(name: str, overrides):
    """(ModelConfig, RunConfig / RLRunConfig or None) of a model config or a run config (bundled name or
    YAML path; a run config with an RL section or a top-level `init_from` is an RL run's)."""
    from composer_jax.config import load_config, read_yaml, resolve_config_path
    from composer_jax.train.config import is_run_config, load_run_config

    if is_run_config(name):
        keys = {str(k).split(".")[0] for k in read_yaml(resolve_config_path(name, kind="run"))}
        if keys & {"rl", "rollout", "env", "init_from"}:      # RL's own sections (its source key is top-level)
            from composer_jax.rl.run_config import load_rl_config

            run = load_rl_config(name, overrides)
        else:
            run = load_run_config(name, overrides)
        return run.model, run
    return load_config(name, overrides), None

"""`composer-jax <command> CONFIG [key=value ...]`.

Each command is one `_add_<name>` function in a module of this package (models, training, agents)
that registers a subparser and sets `run` (a function of the parsed args returning an exit code).
Commands that take a config accept dotted `key=value` overrides anywhere after the config, also after
options (argparse alone would reject them there).
Config and file errors print one line to stderr and exit 2, like argparse's own usage errors.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import composer_jax
from composer_jax.cli.agents import _add_eval, _add_tasks
from composer_jax.cli.bench import _add_bench
from composer_jax.cli.common import USAGE_ERRORS, command_error, human, human_flops
from composer_jax.cli.models import _add_convert, _add_export, _add_generate, _add_info
from composer_jax.cli.plan import _add_plan
from composer_jax.cpu_devices import quiet_cuda_plugin_without_driver
from composer_jax.cli.training import (_add_config, _add_plot, _add_pretrain, _add_rl, _add_rl_engine, _add_rollouts,
                                      _add_sft)

__all__ = ["build_parser", "human", "human_flops", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="composer-jax", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"composer-jax {composer_jax.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    _add_info(sub)
    _add_pretrain(sub)
    _add_sft(sub)
    _add_rl(sub)
    _add_rl_engine(sub)
    _add_plot(sub)
    _add_rollouts(sub)
    _add_config(sub)
    _add_convert(sub)
    _add_export(sub)
    _add_tasks(sub)
    _add_generate(sub)
    _add_eval(sub)
    _add_bench(sub)
    _add_plan(sub)
    return parser


def _subcommand_parser(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The parser of the (sub)command that `args` ran, for usage errors that show its own usage."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or getattr(args, sub.dest, None) not in sub.choices:
            return parser
        parser = sub.choices[getattr(args, sub.dest)]


def _with_default_subcommand(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`eval MODEL ...` -> `eval run MODEL ...`: when a command group's first argument names none of its
    subcommands (and is no option), its default subcommand runs."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if len(argv) < 2 or argv[0] not in commands.choices:
        return argv
    group = next((a for a in commands.choices[argv[0]]._actions if isinstance(a, argparse._SubParsersAction)), None)
    default = getattr(group, "default_command", None)
    if default is None or argv[1] in group.choices or argv[1].startswith("-"):
        return argv
    return [argv[0], default, *argv[1:]]


def main(argv=None) -> int:
    quiet_cuda_plugin_without_driver()   # before any command starts JAX
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    argv = _with_default_subcommand(parser, argv)
    args, extra = parser.parse_known_args(argv)
    args.argv = argv
    # Overrides given after an option land in `extra`; anything else there is a genuine usage error.
    unknown = [x for x in extra if x.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        hint = " (config values are key=value overrides, e.g. train.steps=5)" if hasattr(args, "default_config") else ""
        _subcommand_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        return args.run(args)
    except USAGE_ERRORS as e:
        return command_error(args.command, e)
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (which handles it): nothing to save
        from composer_jax.train.lifecycle import exit_status

        print(f"composer-jax {args.command}: interrupted", file=sys.stderr)
        return exit_status(signal.SIGINT)
    except BrokenPipeError:  # the reader went away (`... | head`): stop quietly, as shell tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


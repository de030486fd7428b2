"""Training commands: `pretrain`, `sft`, `rl`, `rl-engine`, `plot`, `rollouts`, and `config show|keys`."""

from __future__ import annotations

import os
import sys
import traceback

from composer_jax.cli.common import (EXIT_USAGE, USAGE_ERRORS, command_error, command_group, load_model_or_run_config,
                                     non_negative_int, positive_int, quiet_logging, subcommand)
from composer_jax.config import ConfigError
from composer_jax.config_reference import KINDS as KEY_KINDS
from composer_jax.cpu_devices import use_cpu_devices


# pretrain / sft / plot


def _run_training(args, command: str) -> int:
    from composer_jax.train.config import load_run_config

    if "=" in args.config:  # `composer-jax pretrain train.steps=5`: an override, not a config
        args.overrides, args.config = [args.config, *args.overrides], args.default_config
    cfg = load_run_config(args.config, args.overrides)
    if command == "sft" and cfg.data.format != "chat":
        raise ConfigError("data.format", "sft trains on conversations (loss on assistant tokens): set data.format=chat")
    use_cpu_devices(cfg.train.host_cpu_devices)
    quiet_logging()
    from composer_jax.train.lifecycle import interrupted_line
    from composer_jax.train.loop import train

    s, reports = _in_group(args, command, lambda: train(cfg))
    if "interrupted" in s:
        if reports:
            print(interrupted_line(command, s["interrupted"], s["end_step"], s["checkpoint"], args.argv),
                  file=sys.stderr)
        return s["exit_status"]
    if not reports:
        return 0
    line = f"{command}: steps {s['start_step']} -> {s['end_step']} in {s['wall_s']:.0f} s"
    if "first_eval_loss" in s and "last_eval_loss" in s:
        drop = 100 * (1 - s["last_eval_loss"] / s["first_eval_loss"])
        line += f"; held-out loss {s['first_eval_loss']:.4f} -> {s['last_eval_loss']:.4f} ({drop:.1f}% lower)"
    elif "last_eval_loss" in s:
        line += f"; held-out loss {s['last_eval_loss']:.4f}"
    if s["skipped_steps"]:
        line += f"; {s['skipped_steps']} non-finite steps skipped"
    if s["skipped_records"]:
        line += f"; data: {s['skipped_records']} (listed in {s['skip_file']})"
    print(f"{line}\nrun directory: {cfg.run_dir} (metrics.jsonl, tb/, checkpoints/; "
          f"plot: composer-jax plot {cfg.run_dir})")
    return 0


def _find_group(args):
    """The process group the flags and the environment describe (parallel/distributed.py), or None."""
    from composer_jax.parallel.distributed import DistributedError, find_group

    try:
        return find_group(coordinator=args.coordinator, num_processes=args.num_processes,
                          process_id=args.process_id, coordinator_port=args.coordinator_port)
    except DistributedError as e:  # a usage error too: one line
        raise ConfigError("", str(e)) from None


def _in_group(args, command: str, run, one_line: tuple = ()) -> tuple[dict, bool]:
    """`run()` alone, or as one process of the group the flags and the environment describe: (its summary,
    whether this process reports it: alone or process 0). A process that fails tells its peers (they stop
    with its reason) and exits at once (JAX's exit-time shutdown would wait for peers that are gone), with
    one line for a usage error or one of `one_line` (status 1), else the traceback."""
    import jax

    from composer_jax.parallel.distributed import DistributedError, initialize

    group = _find_group(args)
    if group is None:
        return run(), True
    try:
        watchdog = initialize(group, peer_timeout_s=args.peer_timeout, init_timeout_s=args.init_timeout,
                              label=f"composer-jax {command}")
    except DistributedError as e:
        raise ConfigError("", str(e)) from None
    try:
        summary = run()
    except BaseException as e:  # noqa: BLE001 - every failure must reach the peers before this process ends
        if isinstance(e, jax.errors.JaxRuntimeError):  # a failed collective: is a peer gone?
            watchdog.await_peers()
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        watchdog.fail(f"{type(e).__name__}: {reason}")
        if isinstance(e, (*USAGE_ERRORS, *one_line)):
            command_error(command, e)
        else:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_USAGE if isinstance(e, USAGE_ERRORS) else 1)
    watchdog.finish()
    return summary, group.process_id == 0


def _add_distributed_flags(p, note: str = "") -> None:
    g = p.add_argument_group("multi-process (one process per host)",
                             "By default the group comes from SLURM (srun) or a Kubernetes indexed Job / JobSet "
                             f"(JOB_COMPLETION_INDEX); these flags override it. Without either: one process. {note}")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (its coordination service)")
    g.add_argument("--num-processes", type=positive_int, metavar="N", help="processes in the group")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0..N-1")
    g.add_argument("--coordinator-port", type=positive_int, metavar="PORT",
                   help="the coordinator's port when the address comes from SLURM or Kubernetes")
    g.add_argument("--peer-timeout", type=float, default=120.0, metavar="S",
                   help="a peer silent this long ends every process with an error naming it (default: 120)")
    g.add_argument("--init-timeout", type=positive_int, default=300, metavar="S",
                   help="how long to wait for all processes to join (default: 300)")


def _add_training(sub, command: str, default: str, help_text: str) -> None:
    p = sub.add_parser(command, help=help_text,
                       description=f"{help_text}. Resumes from RUN_DIR/checkpoints when present.")
    p.add_argument("config", nargs="?", default=default,
                   help=f"a run YAML path or a bundled run config name (default: {default})")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted config overrides, e.g. train.steps=50 model.rope.factor=16")
    _add_distributed_flags(p)
    p.set_defaults(run=lambda args: _run_training(args, command), default_config=default)


def _add_pretrain(sub) -> None:
    _add_training(sub, "pretrain", "pretrain-tiny",
                  "continued pretraining or context extension (MTP, checkpoints, metrics)")


def _add_sft(sub) -> None:
    _add_training(sub, "sft", "sft-tiny", "supervised fine-tuning on conversations (loss on assistant tokens)")


def _one_process_only(command: str) -> None:
    """`rl-engine` runs as one process: a launch of several tasks (srun, or COMPOSER_JAX_NUM_PROCESSES > 1)
    would start independent engines on one exchange directory."""
    from composer_jax.parallel.distributed import launched_tasks

    tasks = launched_tasks()
    if tasks is not None:
        raise ConfigError("", f"{command} runs as one process, but {tasks[1]} is {tasks[0]}: launch `composer-jax "
                              "rl-engine` as one task (srun --ntasks=1; docs/multihost.md, Launching RL on a cluster)")


def _load_rl(args):
    """The RL run config of `rl` / `rl-engine`, fake CPU devices set up before JAX starts; a multi-process
    learner (`rl` in a process group) must take its batches from `rl-engine`."""
    from composer_jax.rl.run_config import load_rl_config

    if args.command == "rl-engine":
        _one_process_only(args.command)
    if "=" in args.config:  # `composer-jax rl rl.steps=5`: an override, not a config
        args.overrides, args.config = [args.config, *args.overrides], args.default_config
    cfg = load_rl_config(args.config, args.overrides)
    group = _find_group(args) if args.command == "rl" else None
    if group is not None:       # checked before the group forms: no process waits for a peer that stopped
        cfg.check_processes(group.num_processes)
    use_cpu_devices(cfg.host_cpu_devices)
    quiet_logging()
    return cfg


def _run_rl(args) -> int:
    cfg = _load_rl(args)
    from composer_jax.rl.exchange.directory import ExchangeError
    from composer_jax.rl.loop import train_rl
    from composer_jax.train.lifecycle import interrupted_line

    try:
        s, reports = _in_group(args, "rl", lambda: train_rl(cfg), one_line=(ExchangeError,))
    except ExchangeError as e:   # the engine process failed or is silent
        return command_error("rl", e, 1)
    if "interrupted" in s:
        if reports:
            print(interrupted_line("rl", s["interrupted"], s["end_step"], s["checkpoint"], args.argv),
                  file=sys.stderr)
        return s["exit_status"]
    if not reports:
        return 0
    line = f"rl: steps {s['start_step']} -> {s['end_step']} in {s['wall_s']:.0f} s"
    if "first_fifth_reward" in s:
        line += f"; reward {s['first_fifth_reward']:.3f} (first fifth) -> {s['last_fifth_reward']:.3f} (last fifth)"
    line += (f"; rollout and learning overlapped {100 * s['overlap_fraction']:.0f}% of the time after the first step, "
             f"the learner waited for batches {100 * s['learner_wait_fraction']:.0f}%")
    print(f"{line}\nrun directory: {cfg.run_dir} (metrics.jsonl, tb/, monitor.jsonl, rollouts.jsonl, eval/, "
          f"checkpoints/; plot: composer-jax plot {cfg.run_dir}; episodes: composer-jax rollouts {cfg.run_dir})")
    return 0


def _rl_parser(sub, name: str, help_text: str, description: str, config_help: str, overrides_help: str, run):
    """A subcommand taking an RL run config (default: rl-tiny) and dotted overrides."""
    default = "rl-tiny"
    p = sub.add_parser(name, help=help_text, description=description)
    p.add_argument("config", nargs="?", default=default, help=f"{config_help} (default: {default})")
    p.add_argument("overrides", nargs="*", metavar="key=value", help=overrides_help)
    p.set_defaults(run=run, default_config=default)
    return p


def _add_rl(sub) -> None:
    help_text = "asynchronous agent RL (rollouts by the inference engine, the fused RL step)"
    p = _rl_parser(sub, "rl", help_text, f"{help_text}. Resumes from RUN_DIR/checkpoints when present.",
                   "an RL run YAML path or a bundled config name", "dotted config overrides, e.g. rl.steps=20 "
                   "rollout.devices=2", _run_rl)
    _add_distributed_flags(p, "A learner of several processes trains on the batches of `composer-jax rl-engine` "
                              "(rollout.transport=directory).")


def _run_rl_engine(args) -> int:
    cfg = _load_rl(args)
    from composer_jax.rl.exchange.directory import ExchangeError
    from composer_jax.rl.exchange.engine_process import serve

    try:
        s = serve(cfg, engine=args.engine)
    except ExchangeError as e:   # the learner is silent, or the config is not a directory-transport run
        return command_error("rl-engine", e, 1)
    print(f"rl-engine: {s['batches']} batches, {s['sessions']} learner session(s), weight versions loaded "
          f"{'; '.join(', '.join(map(str, v)) for v in s['versions'] if v) or 'none'}")
    return 0


def _add_rl_engine(sub) -> None:
    help_text = "the rollout engine of an RL run as a separate process (rollout.transport=directory)"
    p = _rl_parser(sub, "rl-engine", help_text,
                   f"{help_text}: start it with the learner's config (`composer-jax rl`); it takes weight versions "
                   "from rollout.exchange_dir and writes batches there, and exits when the learner stops.",
                   "the learner's RL run YAML path or bundled config name",
                   "the learner's dotted overrides, e.g. rollout.transport=directory", _run_rl_engine)
    p.add_argument("--engine", type=int, default=0, metavar="K",
                   help="this engine's index, 0..rollout.engines-1: it samples its share of the tasks and writes "
                        "batches K, K + rollout.engines, ... (default: 0)")


def _run_plot(args) -> int:
    from composer_jax.train.plot import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def _add_plot(sub) -> None:
    p = subcommand(sub, "plot", _run_plot, "PNG curves of a training run",
                   "Plot RUN_DIR/metrics.jsonl "
                   "(loss, held-out loss, MTP, throughput, MFU, lr, grad norm, expert balance) as PNGs.")
    p.add_argument("run_dir", help="a training run directory (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR/plots)")


def _run_rollouts(args) -> int:
    from composer_jax.rl.rollout_log import read_rollouts, render, summary_line

    records = read_rollouts(args.run_dir)
    steps = sorted({r["step"] for r in records})
    if not steps:
        return command_error("rollouts", ValueError(f"{args.run_dir}/rollouts.jsonl holds no episode yet"))
    if args.step is not None and args.step not in steps:
        return command_error("rollouts", ValueError(f"step {args.step} has no logged episodes ({len(steps)} steps "
                                                    f"logged, {steps[0]} to {steps[-1]}: see --list)"))
    if not (args.list and args.step is None):       # one step: the one asked for, else the last
        step = steps[-1] if args.step is None else args.step
        records = [r for r in records if r["step"] == step]
    picks = [p for p in ("best", "worst", "random") if getattr(args, p)]
    chosen = [r for r in records if not picks or r["pick"] in picks]
    print("\n".join(summary_line(r) for r in chosen) if args.list
          else "\n\n".join(render(r, args.max_chars) for r in chosen))
    return 0


def _add_rollouts(sub) -> None:
    p = subcommand(sub, "rollouts", _run_rollouts, "the episodes an RL run logged, readable in a terminal",
                   "Show RUN_DIR/rollouts.jsonl (the best, the worst and a random episode of every "
                   "rl.log_rollouts_every-th step): reward and its terms, the monitor's findings, and the "
                   "conversation with the policy's turns, their versions, flags and hints.")
    p.add_argument("run_dir", help="an RL run directory (holds rollouts.jsonl)")
    p.add_argument("--step", type=non_negative_int, default=None, metavar="N",
                   help="this step (default: the last logged)")
    for name in ("best", "worst", "random"):
        p.add_argument(f"--{name}", action="store_true", help=f"only the {name} episode (combinable)")
    p.add_argument("--list", action="store_true", help="one line per episode (of every step unless --step)")
    p.add_argument("--max-chars", type=non_negative_int, default=2000, metavar="N",
                   help="cut each environment piece (prompt, tool output) to N characters (0: whole; default: 2000)")


# config show / keys


def _run_config_show(args) -> int:
    import yaml

    from composer_jax.config import to_dict

    model, run = load_model_or_run_config(args.name, args.overrides)
    print(yaml.safe_dump(to_dict(run if run is not None else model), sort_keys=False), end="")
    return 0


def _run_config_keys(args) -> int:
    from composer_jax import config_reference

    if args.markdown:
        print(config_reference.markdown_section(args.kind) if args.kind else config_reference.markdown_page(), end="")
    else:
        print(config_reference.text_table(args.kind or "run"))
    return 0


def _add_config(sub) -> None:
    config_sub = command_group(sub, "config", "print a resolved config, or every key with its default and meaning")
    show = subcommand(config_sub, "show", _run_config_show, "the resolved config as YAML (loadable as a config file)",
                      "Resolve a run config (e.g. pretrain-tiny) or a model config (e.g. "
                      "tiny) with overrides, every default filled in, and print it as YAML.")
    show.add_argument("name", metavar="NAME", help="a bundled config name or a YAML path")
    show.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    keys = subcommand(config_sub, "keys", _run_config_keys, "every key with its default and meaning",
                      "List every key of a config (a run config's model.* included), with its default, its "
                      "meaning and its type. --markdown without KIND prints the reference page of every "
                      "kind (docs/config-keys.md).")
    keys.add_argument("kind", nargs="?", choices=tuple(KEY_KINDS), metavar="KIND",
                      help=f"which config: {', '.join(KEY_KINDS)} (default: run)")
    keys.add_argument("--markdown", action="store_true", help="Markdown tables (type, default, meaning)")



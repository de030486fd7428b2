"""`composer-jax <command> CONFIG [key=value ...]`.

Each command is one `_add_<name>` function that registers a subparser and sets `run` (a function of
the parsed args returning an exit code). Commands that take a config accept dotted `key=value`
overrides anywhere after the config, also after options (argparse alone would reject them there).
Config and file errors print one line to stderr and exit 2, like argparse's own usage errors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from composer_jax.config import ConfigError
from composer_jax.data.errors import DataError

EXIT_USAGE = 2


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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a YAML path or a bundled model config name (tiny, kimi-k2.5, deepseek-v3)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. mtp.num_layers=1")


# ----------------------------------------------------------------------------------------------------
# info


def _info_table(name: str, info, cfg) -> str:
    """The `info` report: sections of (label, exact count, human count, share of total params)."""
    from composer_jax.model.accounting import COMPONENTS

    f, depths = info.flops, cfg.mtp.num_layers
    share = lambda n: f"{100 * n / info.total:.2f}%"  # noqa: E731
    params = [(c, n, human(n), share(n)) for c in COMPONENTS if (n := info.components.get(c))]
    if info.mtp:
        params.append((f"mtp ({depths} depth{'s' * (depths > 1)}, unique)", info.mtp, human(info.mtp),
                       share(info.mtp)))
    params.append(("total", info.total, human(info.total), ""))
    if info.mtp:
        params.append(("total without MTP", info.main, human(info.main), ""))
    active = [("with input embedding", info.active, human(info.active), share(info.active)),
              ("without input embedding", info.active_no_embed, human(info.active_no_embed),
               share(info.active_no_embed))]
    if info.mtp:
        active.append(("MTP depths", info.mtp_active, human(info.mtp_active), share(info.mtp_active)))
    flops = [("matmuls (6 x active)", f.matmul), ("attention (causal)", f.attention)]
    if info.mtp:
        flops += [("MTP matmuls", f.mtp_matmul), ("MTP attention", f.mtp_attention)]
    flops = [(label, n, human_flops(n), "") for label, n in flops + [("total", f.total)]]
    sections = [("parameters", params), ("active parameters per token", active),
                (f"training FLOPs per token (forward + backward), seq len {f.seq_len:,}", flops)]

    rows = [r for _, section in sections for r in section]
    w_label = max(len(r[0]) for r in rows) + 2
    w_num = max(len(f"{r[1]:,}") for r in rows)
    w_human = max(len(r[2]) for r in rows)
    out = [f"{name}: {cfg.num_layers} layers ({cfg.num_dense_layers} dense + {cfg.num_moe_layers} MoE), "
           f"{cfg.moe.n_routed_experts} routed experts (top-{cfg.moe.num_experts_per_tok}), "
           f"{depths} MTP depth{'s' * (depths != 1)}, vocab {cfg.vocab_size:,}"]
    for title, section in sections:
        out += ["", title]
        out += [f"  {label:<{w_label}}{n:>{w_num},}  {h:>{w_human}}  {pct:>7}".rstrip()
                for label, n, h, pct in section]
    return "\n".join(out)


def _run_info(args) -> int:
    from composer_jax.config import load_config
    from composer_jax.model.accounting import model_info

    cfg = load_config(args.config, args.overrides)
    if args.seq_len is not None and args.seq_len > cfg.rope.max_position_embeddings:
        raise ConfigError("", f"--seq-len {args.seq_len} exceeds rope.max_position_embeddings="
                              f"{cfg.rope.max_position_embeddings}")
    info = model_info(cfg, args.seq_len)
    if args.json:
        print(json.dumps({"config": args.config, "overrides": list(args.overrides), **info.to_dict()}, indent=2))
    else:
        print(_info_table(args.config, info, cfg))
    return 0


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="parameter counts, active params and training FLOPs of a model config",
                       description="Count parameters (total, per component, active per token) and training "
                                   "FLOPs per token from the abstract model; allocates nothing.")
    _add_config_args(p)
    p.add_argument("--seq-len", type=_positive_int, default=None,
                   help="sequence length for attention FLOPs (default: rope.original_max_position_embeddings)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    p.set_defaults(run=_run_info)


# ----------------------------------------------------------------------------------------------------
# pretrain / sft / plot


def _use_cpu_devices(count: int) -> None:
    """Ask XLA for `count` fake host devices (CPU runs); only effective before JAX starts its backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def _quiet_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("absl", "jax", "orbax", "tensorboardX"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _run_training(args, command: str) -> int:
    from composer_jax.train.config import load_run_config

    if "=" in args.config:  # `composer-jax pretrain train.steps=5`: an override, not a config
        args.overrides, args.config = [args.config, *args.overrides], args.default_config
    cfg = load_run_config(args.config, args.overrides)
    if command == "sft" and cfg.data.format != "chat":
        raise ConfigError("data.format", "sft trains on conversations (loss on assistant tokens): set data.format=chat")
    _use_cpu_devices(cfg.train.cpu_devices)
    _quiet_logging()
    from composer_jax.train.loop import train

    s = train(cfg)
    line = f"{command}: steps {s['start_step']} -> {s['end_step']} in {s['wall_s']:.0f} s"
    if "first_eval_loss" in s and "last_eval_loss" in s:
        drop = 100 * (1 - s["last_eval_loss"] / s["first_eval_loss"])
        line += f"; held-out loss {s['first_eval_loss']:.4f} -> {s['last_eval_loss']:.4f} ({drop:.1f}% lower)"
    elif "last_eval_loss" in s:
        line += f"; held-out loss {s['last_eval_loss']:.4f}"
    if s["skipped_steps"]:
        line += f"; {s['skipped_steps']} non-finite steps skipped"
    if s["skipped_records"]:
        line += "; skipped records: " + ", ".join(f"{k} {v}" for k, v in s["skipped_records"].items())
    print(f"{line}\nrun directory: {cfg.run_dir} (metrics.jsonl, tb/, checkpoints/; "
          f"plot: composer-jax plot {cfg.run_dir})")
    return 0


def _add_training(sub, command: str, default: str, help_text: str) -> None:
    p = sub.add_parser(command, help=help_text,
                       description=f"{help_text}. Resumes from RUN_DIR/checkpoints when present.")
    p.add_argument("config", nargs="?", default=default,
                   help=f"a run YAML path or a bundled run config name (default: {default})")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted config overrides, e.g. train.steps=50 model.rope.factor=16")
    p.set_defaults(run=lambda args: _run_training(args, command), default_config=default)


def _add_pretrain(sub) -> None:
    _add_training(sub, "pretrain", "pretrain-tiny",
                  "continued pretraining or context extension (MTP, checkpoints, metrics)")


def _add_sft(sub) -> None:
    _add_training(sub, "sft", "sft-tiny", "supervised fine-tuning on conversations (loss on assistant tokens)")


def _run_plot(args) -> int:
    from composer_jax.train.plot import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def _add_plot(sub) -> None:
    p = sub.add_parser("plot", help="PNG curves of a training run", description="Plot RUN_DIR/metrics.jsonl "
                       "(loss, held-out loss, MTP, throughput, MFU, lr, grad norm, expert balance) as PNGs.")
    p.add_argument("run_dir", help="a training run directory (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR/plots)")
    p.set_defaults(run=_run_plot)


# ----------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="composer-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    _add_info(sub)
    _add_pretrain(sub)
    _add_sft(sub)
    _add_plot(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides given after an option land in `extra`; anything else there is a genuine usage error.
    unknown = [x for x in extra if x.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        return args.run(args)
    except (ConfigError, FileNotFoundError, DataError) as e:
        print(f"composer-jax {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

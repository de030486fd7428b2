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
import signal
import sys

import composer_jax
from composer_jax.checkpoint.safetensors_io import CheckpointError
from composer_jax.config import ConfigError
from composer_jax.cpu_devices import use_cpu_devices
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


def _load_model_or_run_config(name: str, overrides):
    """(ModelConfig, RunConfig or None) of a model config or a run config (bundled name or YAML path)."""
    from composer_jax.config import load_config
    from composer_jax.train.config import is_run_config, load_run_config

    if is_run_config(name):
        run = load_run_config(name, overrides)
        return run.model, run
    return load_config(name, overrides), None


def _run_info(args) -> int:
    from composer_jax.model.accounting import model_info

    cfg, run = _load_model_or_run_config(args.config, args.overrides)
    if args.seq_len is None and run is not None:
        args.seq_len = run.train.seq_len
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
    p.add_argument("config", help="a model config (YAML path or bundled name: tiny, kimi-k2.5, deepseek-v3) or a run "
                                  "config (e.g. pretrain-tiny: its model, at its train.seq_len)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. mtp.num_layers=1")
    p.add_argument("--seq-len", type=_positive_int, default=None,
                   help="sequence length for attention FLOPs (default: a run config's train.seq_len, else "
                        "rope.original_max_position_embeddings)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    p.set_defaults(run=_run_info)


# ----------------------------------------------------------------------------------------------------
# convert / export (Hugging Face <-> orbax)


def _stream_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=_positive_int, default=None, help="parallel work items (default: min(8, CPUs))")
    p.add_argument("--chunk-mb", type=_positive_int, default=64,
                   help="largest block read, converted and written at once, in MiB (default 64)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--restart", action="store_true", help="discard a partial DST.partial left by another job")
    p.add_argument("--quiet", action="store_true", help="no progress bar or log lines")


def _log_to_stderr(command: str, quiet: bool) -> bool:
    import logging

    logger = logging.getLogger("composer_jax.checkpoint")
    if not quiet and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"composer-jax {command}: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return not quiet and sys.stderr.isatty()


def _run_convert(args) -> int:
    from composer_jax.checkpoint.convert import convert

    mesh_sizes = None
    if args.mesh is not None or args.devices is not None:
        from composer_jax import config as config_lib
        from composer_jax.parallel.mesh import resolve_sizes

        if args.devices is None:
            raise ConfigError("", "--mesh needs --devices (the device count of the target mesh)")
        items = [x for x in (args.mesh or "").split(",") if x]
        mesh = config_lib.from_dict(config_lib.MeshConfig, config_lib.apply_overrides(config_lib.MeshConfig, {}, items),
                                    prefix="mesh")
        mesh_sizes = resolve_sizes(mesh, args.devices)
    progress = _log_to_stderr("convert", args.quiet)
    convert(args.src, args.dst, args.overrides, mesh_sizes=mesh_sizes, workers=args.workers,
            chunk_bytes=args.chunk_mb << 20, compress=args.compress, strict=not args.allow_extra,
            overwrite=args.overwrite, restart=args.restart, progress=progress)
    return 0


def _streaming_command(sub, name: str, help_text: str, description: str, src_help: str,
                       overrides_help: str) -> argparse.ArgumentParser:
    """A `name SRC DST [key=value ...]` subcommand with the streaming-job options."""
    p = sub.add_parser(name, help=help_text, description=description)
    p.add_argument("src", help=src_help)
    p.add_argument("dst", help="output directory (written as DST.partial, renamed when complete)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help=overrides_help)
    _stream_args(p)
    return p


def _add_convert(sub) -> None:
    p = _streaming_command(
        sub, "convert", "Hugging Face checkpoint -> orbax (bf16/fp16/fp32, FP8 blocks, K2.5 INT4)",
        "Stream a Hugging Face DeepSeek-V3 / Kimi K2 / K2.5 directory into a converted model directory DST (orbax "
        "params, model_config.yaml), dequantizing as it goes. Resumable: re-run the same command after an "
        "interruption.", "Hugging Face model directory (config.json + *.safetensors)",
        "model config overrides, e.g. param_dtype=float32 or mtp.num_layers=0")
    p.add_argument("--devices", type=_positive_int, default=None,
                   help="chunk for a target mesh of this many devices (with --mesh)")
    p.add_argument("--mesh", default=None, metavar="AXIS=SIZE,...",
                   help="target mesh axis sizes, e.g. fsdp=8,ep=64 (MeshConfig fields; default: fsdp and ep fill)")
    p.add_argument("--compress", action="store_true", help="zstd-compress chunks (slower, ~10%% smaller for bf16)")
    p.add_argument("--allow-extra", action="store_true", help="warn about unexpected tensors instead of failing")
    p.set_defaults(run=_run_convert)


def _run_export(args) -> int:
    from composer_jax.checkpoint.export import export

    cfg = None
    if args.config is not None:
        from composer_jax.config import load_config

        cfg = load_config(args.config, args.overrides)
    elif args.overrides:
        raise ConfigError("", f"overrides ({' '.join(args.overrides)}) apply to --config, which is not given")
    progress = _log_to_stderr("export", args.quiet)
    export(args.src, args.dst, cfg=cfg, dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * 2**30),
           workers=args.workers, chunk_bytes=args.chunk_mb << 20, overwrite=args.overwrite, restart=args.restart,
           progress=progress, mtp=not args.no_mtp)
    return 0


def _add_export(sub) -> None:
    p = _streaming_command(
        sub, "export", "orbax checkpoint -> Hugging Face directory (transformers-loadable)",
        "Stream a converted model directory, a training checkpoint step (RUN/checkpoints/STEP) or an orbax params "
        "checkpoint (with --config) into a Hugging Face directory: config.json, sharded safetensors and index.",
        "directory written by convert, a training checkpoint step, or an orbax checkpoint",
        "overrides of the --config model config")
    p.add_argument("--config", default=None,
                   help="model config (default: SRC/model_config.yaml, or the training step's run config)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="weight dtype (default: each parameter's dtype; the router bias stays float32)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size in GiB (default 5)")
    p.add_argument("--no-mtp", action="store_true",
                   help="leave the MTP depths out (transformers has no MTP module and reports them as UNEXPECTED)")
    p.set_defaults(run=_run_export)


# ----------------------------------------------------------------------------------------------------
# pretrain / sft / plot


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
    use_cpu_devices(cfg.train.cpu_devices)
    _quiet_logging()
    from composer_jax.train.lifecycle import interrupted_line
    from composer_jax.train.loop import train

    s = train(cfg)
    if "interrupted" in s:
        print(interrupted_line(command, s["interrupted"], s["end_step"], s["checkpoint"], args.argv), file=sys.stderr)
        return s["exit_status"]
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
# config show / keys


def _run_config_show(args) -> int:
    import yaml

    from composer_jax.config import to_dict

    model, run = _load_model_or_run_config(args.name, args.overrides)
    print(yaml.safe_dump(to_dict(run if run is not None else model), sort_keys=False), end="")
    return 0


def _run_config_keys(args) -> int:
    from composer_jax.config import ModelConfig, describe_keys
    from composer_jax.train.config import RunConfig

    keys = describe_keys(RunConfig if args.kind == "run" else ModelConfig)
    w_key, w_default = max(len(k.key) for k in keys), max(len(k.default) for k in keys)
    print(f"{'key':<{w_key}}  {'default':<{w_default}}  meaning [type]")
    for k in keys:
        print(f"{k.key:<{w_key}}  {k.default:<{w_default}}  {k.meaning + ' ' if k.meaning else ''}[{k.type}]")
    return 0


def _command_group(sub, name: str, help_text: str, default: str | None = None):
    """A command with subcommands (`composer-jax NAME COMMAND ...`); returns their subparsers. `default`:
    the subcommand that runs when the first argument names none."""
    group = sub.add_parser(name, help=help_text).add_subparsers(dest=f"{name}_command", required=True,
                                                               metavar="command")
    group.default_command = default   # read by _with_default_subcommand
    return group


def _add_config(sub) -> None:
    config_sub = _command_group(sub, "config", "print a resolved config, or every config key with its default and "
                                               "meaning")
    show = config_sub.add_parser("show", help="the resolved config as YAML (loadable as a config file)",
                                 description="Resolve a run config (e.g. pretrain-tiny) or a model config (e.g. "
                                             "tiny) with overrides, every default filled in, and print it as YAML.")
    show.add_argument("name", metavar="NAME", help="a bundled config name or a YAML path")
    show.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    show.set_defaults(run=_run_config_show)
    keys = config_sub.add_parser("keys", help="every key with its default and meaning",
                                 description="List every key of a run config (model.* included) or of a model "
                                             "config, with its default, its meaning and its type.")
    keys.add_argument("kind", nargs="?", choices=("run", "model"), default="run", help="which config (default: run)")
    keys.set_defaults(run=_run_config_keys)


# ----------------------------------------------------------------------------------------------------
# tasks check


def _run_tasks_check(args) -> int:
    import time

    from composer_jax.sandbox import Sandbox, SandboxError, SandboxUnavailable
    from composer_jax.tasks import TaskError, check_tasks, load_task, summary_line

    start = time.monotonic()
    try:
        tasks = [load_task(d) for d in args.task_dirs]
        results = check_tasks(tasks, Sandbox(args.backend), solution=args.solution, workers=args.workers)
    except (TaskError, SandboxError, SandboxUnavailable) as e:
        print(f"composer-jax tasks check: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    lines = [json.dumps(r.to_json()) for r in results]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
    else:
        print("\n".join(lines))
    print(summary_line(results, time.monotonic() - start))
    return 0


def _run_feature_deletion(args) -> int:
    from composer_jax.sandbox import SandboxError, SandboxUnavailable
    from composer_jax.tasks.feature_deletion import (FeatureDeletionConfig, FeatureDeletionError, generate_tasks,
                                                     summary)

    try:
        config = FeatureDeletionConfig(max_tasks=args.max_tasks, workers=args.workers, seed=args.seed,
                                       test_command=args.test_command, timeout_s=args.timeout,
                                       min_lines=args.min_lines, backend=args.backend)
        report = generate_tasks(args.repo_dir, args.out_dir, config, log=lambda line: print(line, file=sys.stderr))
    except (FeatureDeletionError, SandboxError, SandboxUnavailable) as e:
        print(f"composer-jax tasks feature-deletion: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(summary(report))
    print(f"report: {os.path.join(args.out_dir, 'report.json')}")
    return 0


def _run_tasks_list(args) -> int:
    from composer_jax.tasks import TaskError
    from composer_jax.tasks.listing import find_tasks, task_table

    try:
        print(task_table(find_tasks(args.out_dir)))
    except TaskError as e:
        print(f"composer-jax tasks list: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _add_tasks(sub) -> None:
    tasks_sub = _command_group(sub, "tasks", "coding tasks: generate, list and check (reward from tests in the "
                                             "sandbox)")
    c = tasks_sub.add_parser("check", help="run each task's tests in the sandbox and report its reward",
                             description="Validate TASK_DIRs, run their test commands in the sandbox on copies of "
                                         "repo/ and print one JSON object per task (task, reward, passed, failed, "
                                         "status, seconds) and a summary line. Task directories are never modified.")
    c.add_argument("task_dirs", nargs="+", metavar="TASK_DIR")
    c.add_argument("--solution", action="store_true", help="apply solution.patch to the copy first")
    c.add_argument("--json", default=None, metavar="OUT", help="write the JSON lines to OUT instead of stdout")
    c.add_argument("--workers", type=_positive_int, default=1, help="tasks checked at once (default 1)")
    c.add_argument("--backend", choices=("bwrap", "none"), default="bwrap",
                   help="sandbox backend; 'none' runs the tests UNSANDBOXED on this machine (default bwrap)")
    c.set_defaults(run=_run_tasks_check)
    f = tasks_sub.add_parser("feature-deletion", help="make tasks from a repository by deleting tested features",
                             description="Run REPO_DIR's pytest suite in the sandbox with tracing, delete one "
                                         "function, method or class per task (the module still imports), keep the "
                                         "task if the tests that ran it now fail, the others still pass and "
                                         "solution.patch restores them; write OUT_DIR/<id>/{repo/, task.json, "
                                         "solution.patch} and OUT_DIR/report.json. REPO_DIR is only read.")
    f.add_argument("repo_dir", metavar="REPO_DIR")
    f.add_argument("out_dir", metavar="OUT_DIR", help="a new or empty directory")
    f.add_argument("--max-tasks", type=_positive_int, default=20, help="stop after keeping this many (default 20)")
    f.add_argument("--workers", type=_positive_int, default=1, help="candidates checked at once (default 1)")
    f.add_argument("--seed", type=int, default=0, help="order in which candidates are tried (default 0)")
    f.add_argument("--test-command", default=None,
                   help="pytest command run from the repository root (default: python -m pytest -q without plugin "
                        "autoload, PYTHONPATH=src for a src/ layout)")
    f.add_argument("--timeout", type=float, default=600.0, help="seconds the whole test suite may take (default 600)")
    f.add_argument("--min-lines", type=_positive_int, default=3,
                   help="lines of code a deletion must remove, at least (default 3)")
    f.add_argument("--backend", choices=("bwrap", "none"), default="bwrap",
                   help="sandbox backend; 'none' runs the tests UNSANDBOXED on this machine (default bwrap)")
    f.set_defaults(run=_run_feature_deletion)
    t = tasks_sub.add_parser("list", help="table of the tasks in a directory",
                             description="Print id, target tests, deleted lines and pass rate of every task "
                                         "directory under OUT_DIR.")
    t.add_argument("out_dir", metavar="OUT_DIR")
    t.set_defaults(run=_run_tasks_list)


# ----------------------------------------------------------------------------------------------------
# generate


def _generate_prompts(args, tokenizer) -> list[tuple[str, list[int]]]:
    """(where it came from, token ids) per prompt, from --prompt or a --prompts JSONL file."""
    from composer_jax.data.chat import START, render

    def encode(text: str, where: str) -> list[int]:
        if tokenizer is None:
            raise ValueError(f"{where}: text prompts need a tokenizer, and {args.model} has none "
                             "(tokenizer.json / tiktoken.model): give token ids ({\"tokens\": [...]} lines in --prompts)")
        return [int(i) for i in tokenizer.encode(text)]

    def chat(messages, where: str) -> list[int]:
        text = "".join(piece for piece, _ in render(messages)) + f"{START}assistant\n"
        return encode(text, where)

    if args.prompt is not None:
        where = "--prompt"
        return [(where, chat([{"role": "user", "content": args.prompt}], where) if args.chat
                 else encode(args.prompt, where))]
    out = []
    with open(args.prompts, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{args.prompts} line {n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected an object with 'prompt', 'tokens' or 'messages'")
            if "tokens" in record:
                tokens = record["tokens"]
                if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                    raise ValueError(f"{where}: 'tokens' must be a list of ints")
                out.append((where, tokens))
            elif "messages" in record:
                out.append((where, chat(record["messages"], where)))
            elif isinstance(record.get("prompt"), str):
                text = record["prompt"]
                out.append((where, chat([{"role": "user", "content": text}], where) if args.chat else encode(text, where)))
            else:
                raise ValueError(f"{where}: expected a string 'prompt', a 'tokens' list or 'messages'")
    if not out:
        raise ValueError(f"{args.prompts}: no prompts")
    return out


def _run_generate(args) -> int:
    use_cpu_devices(args.devices)
    import time

    from composer_jax.config import MeshConfig, ModelConfig, apply_overrides, from_dict
    from composer_jax.data.chat import END
    from composer_jax.infer import Engine, GenerationError, SamplingParams
    from composer_jax.infer.config import GenerateConfig
    from composer_jax.infer.generate import default_max_len, request_seeds
    from composer_jax.model_dirs import open_model

    model_overrides = [o.removeprefix("model.") for o in args.overrides if o.startswith("model.")]
    gen = from_dict(GenerateConfig, apply_overrides(GenerateConfig, {}, [o for o in args.overrides
                                                                         if not o.startswith("model.")]))
    apply_overrides(ModelConfig, {}, model_overrides)  # unknown model keys fail here, before loading
    try:
        opened = open_model(args.model, model_overrides)
        tokenizer, model = opened.tokenizer, opened.model
        prompts = _generate_prompts(args, tokenizer)
        if args.devices > 1:
            import jax

            from composer_jax.parallel import DualMesh, set_mesh

            set_mesh(model, DualMesh(MeshConfig(), jax.devices()[:args.devices], model=model.cfg))
        stops = tuple(s for s in (gen.stop, END if args.chat else "") if s)
        detokenize = None if tokenizer is None else (lambda ids: tokenizer.decode(ids))
        if stops and detokenize is None:
            raise ValueError(f"stop strings need a tokenizer, and {args.model} has none")
        engine = Engine(model, max_slots=gen.max_slots, steps_per_call=gen.steps_per_call,
                        max_len=gen.max_len or default_max_len(model.cfg, [p for _, p in prompts], gen.max_new_tokens),
                        speculative=gen.speculative, eos_ids=opened.eos_ids, detokenize=detokenize)
        ids = {}
        for (where, tokens), seed in zip(prompts, request_seeds(gen.seed, len(prompts))):
            try:
                ids[engine.submit(tokens, max_new_tokens=gen.max_new_tokens, stop_strings=stops,
                                  sampling=SamplingParams(gen.temperature, gen.top_p, gen.top_k, seed))] = where
            except GenerationError as e:
                raise GenerationError(f"{where}: {e}") from None
    except (ValueError, OSError) as e:  # GenerationError, ConfigError, CheckpointError, DataError are ValueErrors
        print(f"composer-jax generate: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{opened.description}: {len(prompts)} prompt(s)", file=sys.stderr)
    stream = args.prompt is not None and args.out is None and tokenizer is not None
    printed, streamed, done, start = "", [], {}, time.perf_counter()
    while not engine.idle:
        for update in engine.step():
            if update.finished is not None:
                done[update.request_id] = update.finished
            if stream:  # print the decoded text as it grows (held back while a UTF-8 sequence is partial)
                streamed += update.new_tokens
                text = tokenizer.decode(streamed).rstrip("\ufffd")
                if text.startswith(printed):
                    sys.stdout.write(text[len(printed):])
                    sys.stdout.flush()
                    printed = text
    wall = time.perf_counter() - start
    if stream:
        print()
    else:
        lines = []
        for request_id, where in ids.items():
            c = done[request_id]
            record = {"source": where, "tokens": c.tokens, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
            if tokenizer is not None:
                record["text"] = tokenizer.decode(c.tokens)
            lines.append(json.dumps(record))
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in lines))
        else:
            print("\n".join(lines))
    total, compiling = sum(len(c.tokens) for c in done.values()), engine.stats["compile_s"]
    line = (f"generated {total} tokens in {wall:.2f} s ({compiling:.1f} s compiling): "
            f"{total / max(wall - compiling, 1e-9):.1f} tokens/s")
    if gen.speculative:
        acc = engine.acceptance
        line += (f"; acceptance {100 * acc['acceptance_rate']:.1f}%, mean accepted length "
                 f"{acc['mean_accepted_length']:.2f}")
    print(f"{line} ({len(engine.compiled)} programs compiled)", file=sys.stderr)
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="sample from a model: HF directory, converted directory or training run",
                       description="Generate with the inference engine (latent cache, continuous batching, "
                                   "optional MTP speculative decoding). Streams the text of one --prompt, or "
                                   "writes one JSON line per --prompts record (source, tokens, logprobs, "
                                   "finish_reason, text); prints tokens/s (and acceptance) to stderr. Settings as "
                                   "key=value: max_new_tokens, temperature (0: greedy), top_p, top_k, seed, "
                                   "speculative, stop, max_slots, max_len, steps_per_call; model.KEY=VALUE "
                                   "overrides the model config (e.g. model.dtype=bfloat16).")
    p.add_argument("model", help="a Hugging Face directory, a converted directory or a training run directory")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", default=None, help="one text prompt (needs the model's tokenizer)")
    source.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                        help='one prompt per line: {"prompt": text}, {"tokens": [ids]} or {"messages": [...]}')
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template; stop at its end marker")
    p.add_argument("--out", default=None, metavar="FILE.jsonl", help="write the JSON lines here instead of stdout")
    p.add_argument("--devices", type=_positive_int, default=1,
                   help="decode on this many devices (the dual grid's inference layout; default 1)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="generation settings and model.KEY overrides")
    p.set_defaults(run=_run_generate)


# ----------------------------------------------------------------------------------------------------
# eval / eval compare


def _run_eval(args) -> int:
    from composer_jax.eval import EvalConfig, EvalError, evaluate, load_agent, load_task_set, summary_table
    from composer_jax.sandbox import Sandbox, SandboxError, SandboxUnavailable
    from composer_jax.tasks import TaskError

    out = args.out or f"eval-{_slug(args.model)}-{_slug(args.tasks_dir)}"
    try:
        config = EvalConfig(samples=args.samples, max_turns=args.max_turns, workers=args.workers, seed=args.seed)
        tasks = load_task_set(args.tasks_dir)
        agent = load_agent(args.model, temperature=args.temperature)
        summary = evaluate(agent, tasks, out, config, sandbox=Sandbox(args.backend),
                           log=None if args.quiet else lambda line: print(line, file=sys.stderr))
    except (EvalError, TaskError, SandboxError, SandboxUnavailable) as e:
        print(f"composer-jax eval: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(summary_table(summary))
    print(f"run directory: {out} (attempts.jsonl, summary.json, transcripts/)")
    return 0


def _slug(path: str) -> str:
    """A directory-name-safe label of a MODEL or TASKS_DIR argument."""
    name = os.path.basename(os.path.normpath(path.split(":", 1)[-1])) or "run"
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def _run_eval_compare(args) -> int:
    from composer_jax.eval import EvalError, compare_runs, comparison_plot, comparison_table

    try:
        comparison = compare_runs(args.run_a, args.run_b)
    except EvalError as e:
        print(f"composer-jax eval compare: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(comparison_table(comparison))
    png = args.png or os.path.join(args.run_b, f"compare_{_slug(args.run_a)}.png")
    print(f"plot: {comparison_plot(comparison, png)}")
    return 0


def _add_eval(sub) -> None:
    eval_sub = _command_group(sub, "eval", "run an agent on a task set (pass@k, efficiency, lint); compare two runs",
                              default="run")
    r = eval_sub.add_parser("run", help="run an agent K times per task and score it (the default: `composer-jax "
                                        "eval MODEL TASKS_DIR`)",
                            description="Run the agent MODEL K times on every task of TASKS_DIR in the coding "
                                        "environment (commands in the sandbox), writing OUT/attempts.jsonl (one line "
                                        "per attempt), OUT/transcripts/ and OUT/summary.json: pass@k (unbiased), "
                                        "mean reward, tokens and turns per solved attempt, tool-error rate and lint "
                                        "findings added, with bootstrap confidence intervals over tasks. Resumable: "
                                        "the same command again skips the attempts already recorded.")
    r.add_argument("model", metavar="MODEL", help="the agent: scripted:PATH (a JSON file of per-task tool-call "
                                                  "scripts; engine-backed models are not wired in yet)")
    r.add_argument("tasks_dir", metavar="TASKS_DIR", help="a directory of task directories (or one task directory)")
    r.add_argument("--samples", type=int, default=1, metavar="K", help="attempts per task (default 1)")
    r.add_argument("--max-turns", type=int, default=30, metavar="T", help="assistant turns per attempt (default 30)")
    r.add_argument("--temperature", type=float, default=None, metavar="X",
                   help="sampling temperature (default: the agent's)")
    r.add_argument("--workers", type=int, default=1, metavar="N", help="attempts at once (default 1)")
    r.add_argument("--seed", type=int, default=0, help="attempt seeds derive from it (default 0)")
    r.add_argument("--out", default=None, metavar="DIR", help="run directory (default: eval-MODEL-TASKS in the "
                                                              "current directory)")
    r.add_argument("--backend", choices=("bwrap", "none"), default="bwrap",
                   help="sandbox backend; 'none' runs the agent's commands UNSANDBOXED (default bwrap)")
    r.add_argument("--quiet", action="store_true", help="no line per finished attempt on stderr")
    r.set_defaults(run=_run_eval)
    c = eval_sub.add_parser("compare", help="paired difference of two runs per score, flipped tasks, a PNG",
                            description="Compare two evaluation run directories on the tasks both ran: per score, "
                                        "B - A with a paired bootstrap 95%% interval over tasks, and the tasks solved "
                                        "by only one of them; prints a table and writes a PNG.")
    c.add_argument("run_a", metavar="RUN_A")
    c.add_argument("run_b", metavar="RUN_B")
    c.add_argument("--png", default=None, help="where to write the plot (default: RUN_B/compare_<RUN_A name>.png)")
    c.set_defaults(run=_run_eval_compare)


# ----------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="composer-jax", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"composer-jax {composer_jax.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    _add_info(sub)
    _add_pretrain(sub)
    _add_sft(sub)
    _add_plot(sub)
    _add_config(sub)
    _add_convert(sub)
    _add_export(sub)
    _add_tasks(sub)
    _add_generate(sub)
    _add_eval(sub)
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
    except (ConfigError, CheckpointError, FileNotFoundError, DataError) as e:
        print(f"composer-jax {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (which handles it): nothing to save
        from composer_jax.train.lifecycle import exit_status

        print(f"composer-jax {args.command}: interrupted", file=sys.stderr)
        return exit_status(signal.SIGINT)
    except BrokenPipeError:  # the reader went away (`... | head`): stop quietly, as shell tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())

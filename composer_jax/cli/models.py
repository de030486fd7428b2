"""Commands on model files: `info`, `convert`, `export`, `generate`."""

from __future__ import annotations

import argparse
import json
import sys

from composer_jax.cli.common import (command_error, human, human_flops, load_model_or_run_config, log_to_stderr,
                                     positive_int)
from composer_jax.config import ConfigError
from composer_jax.cpu_devices import use_cpu_devices


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
    from composer_jax.model.accounting import model_info

    cfg, run = load_model_or_run_config(args.config, args.overrides)
    if args.seq_len is None and run is not None:
        args.seq_len = run.train.seq_len if hasattr(run, "train") else run.rollout.max_len   # RL: a trajectory row
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
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="sequence length for attention FLOPs (default: a run config's train.seq_len, else "
                        "rope.original_max_position_embeddings)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    p.set_defaults(run=_run_info)


# convert / export (Hugging Face <-> orbax)


def _stream_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=positive_int, default=None, help="parallel work items (default: min(8, CPUs))")
    p.add_argument("--chunk-mb", type=positive_int, default=64,
                   help="largest block read, converted and written at once, in MiB (default 64)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--restart", action="store_true", help="discard a partial DST.partial left by another job")
    p.add_argument("--quiet", action="store_true", help="no progress bar or log lines")


def _run_convert(args) -> int:
    from composer_jax.checkpoint.convert import convert
    from composer_jax.model import abstract_params

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
    progress = log_to_stderr("convert", args.quiet)
    convert(args.src, args.dst, args.overrides, params_of=abstract_params, mesh_sizes=mesh_sizes, workers=args.workers,
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
        "interruption.", "Hugging Face model directory (config.json + *.safetensors) or model id (org/name: the local "
        "Hugging Face cache, downloaded when missing)",
        "model config overrides, e.g. param_dtype=float32 or mtp.num_layers=0")
    p.add_argument("--devices", type=positive_int, default=None,
                   help="chunk for a target mesh of this many devices (with --mesh)")
    p.add_argument("--mesh", default=None, metavar="AXIS=SIZE,...",
                   help="target mesh axis sizes, e.g. fsdp=8,ep=64 (MeshConfig fields; default: fsdp and ep fill)")
    p.add_argument("--compress", action="store_true", help="zstd-compress chunks (slower, ~10%% smaller for bf16)")
    p.add_argument("--allow-extra", action="store_true", help="warn about unexpected tensors instead of failing")
    p.set_defaults(run=_run_convert)


def _run_export(args) -> int:
    from composer_jax.model_dirs import export_model

    cfg = None
    if args.config is not None:
        from composer_jax.config import load_config

        cfg = load_config(args.config, args.overrides)
    elif args.overrides:
        raise ConfigError("", f"overrides ({' '.join(args.overrides)}) apply to --config, which is not given")
    progress = log_to_stderr("export", args.quiet)
    export_model(args.src, args.dst, cfg=cfg, dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * 2**30),
                 workers=args.workers, chunk_bytes=args.chunk_mb << 20, overwrite=args.overwrite,
                 restart=args.restart, progress=progress, mtp=not args.no_mtp)
    return 0


def _add_export(sub) -> None:
    p = _streaming_command(
        sub, "export", "orbax checkpoint -> Hugging Face directory (transformers-loadable)",
        "Stream a run directory of any phase (its latest checkpoint), a training checkpoint step "
        "(RUN/checkpoints/STEP), a converted model directory or an orbax params checkpoint (with --config) into a "
        "Hugging Face directory: config.json, sharded safetensors and index, and the model's tokenizer files with "
        "the chat template it was trained with (transformers' AutoTokenizer loads them).",
        "a run directory, a training checkpoint step, a directory written by convert, or an orbax checkpoint",
        "overrides of the --config model config")
    p.add_argument("--config", default=None,
                   help="model config (default: SRC/model_config.yaml, or the training step's run config)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="weight dtype (default: each parameter's dtype; the router bias stays float32)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size in GiB (default 5)")
    p.add_argument("--no-mtp", action="store_true",
                   help="leave the MTP depths out (transformers has no MTP module and reports them as UNEXPECTED)")
    p.set_defaults(run=_run_export)


# generate


def _open_generation(args):
    """(the opened model, its Generation of the prompts): settings checked before the model loads; a run's
    recorded sampling is the default; --chat renders prompts in the model's chat format and stops at its
    end marker; --devices > 1 decodes on the engine grids."""
    import jax

    from composer_jax.config import ModelConfig, apply_overrides
    from composer_jax.data.chat import format_for, get_chat_format
    from composer_jax.data.prompts import prompt_ids
    from composer_jax.infer.config import load_generate_config
    from composer_jax.infer.stream import Generation
    from composer_jax.source_weights import open_model

    model_overrides = [o.removeprefix("model.") for o in args.overrides if o.startswith("model.")]
    gen_overrides = [o for o in args.overrides if not o.startswith("model.")]
    load_generate_config(gen_overrides)                 # bad settings fail before loading
    apply_overrides(ModelConfig, {}, model_overrides)   # unknown model keys too
    opened = open_model(args.model, model_overrides)
    gen = load_generate_config(gen_overrides, opened.chat.agent)
    tokenizer = opened.tokenizer
    fmt = get_chat_format(format_for(tokenizer, opened.chat.format)) if tokenizer is not None else None
    prompts = prompt_ids(prompt=args.prompt, path=args.prompts, tokenizer=tokenizer, fmt=fmt, chat=args.chat,
                         model=args.model)
    stops = tuple(s for s in (gen.stop, fmt.end_of_turn if args.chat and fmt else "") if s)
    return opened, Generation(opened.model, prompts, gen, tokenizer=tokenizer, eos_ids=opened.eos_ids,
                              stop_strings=stops, devices=jax.devices()[:args.devices] if args.devices > 1 else None)


def _throughput_line(stats: dict) -> str:
    line = (f"generated {stats['tokens']} tokens in {stats['wall_s']:.2f} s ({stats['compile_s']:.1f} s compiling): "
            f"{stats['tokens_per_s']:.1f} tokens/s")
    if "acceptance_rate" in stats:
        line += (f"; acceptance {100 * stats['acceptance_rate']:.1f}%, mean accepted length "
                 f"{stats['mean_accepted_length']:.2f}")
    return f"{line} ({stats['programs']} programs compiled)"


def _run_generate(args) -> int:
    use_cpu_devices(args.devices)
    try:
        opened, generation = _open_generation(args)
    except (ValueError, OSError) as e:  # GenerationError, ConfigError, CheckpointError, DataError are ValueErrors
        return command_error("generate", e)
    print(f"{opened.description}: {len(generation.sources)} prompt(s)", file=sys.stderr)
    if args.prompt is not None and args.out is None and opened.tokenizer is not None:
        for piece in generation.text_pieces():
            sys.stdout.write(piece)
            sys.stdout.flush()
        print()
    else:
        lines = "".join(json.dumps(record) + "\n" for record in generation.records())
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(lines)
        else:
            sys.stdout.write(lines)
    print(_throughput_line(generation.stats()), file=sys.stderr)
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
    p.add_argument("model", help="a Hugging Face directory or model id (org/name: the local Hugging Face cache, "
                                 "downloaded when missing), a converted directory or a training run directory")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", default=None, help="one text prompt (needs the model's tokenizer)")
    source.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                        help='one prompt per line: {"prompt": text}, {"tokens": [ids]} or {"messages": [...]}')
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template; stop at its end marker")
    p.add_argument("--out", default=None, metavar="FILE.jsonl", help="write the JSON lines here instead of stdout")
    p.add_argument("--devices", type=positive_int, default=1,
                   help="decode on this many devices (the dual grid's inference layout; default 1)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="generation settings and model.KEY overrides")
    p.set_defaults(run=_run_generate)



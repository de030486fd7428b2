"""`composer-jax plan CONFIG [key=value ...] --devices N`: does a step fit, and where does the memory go."""

from __future__ import annotations

import json

from composer_jax.cli.common import non_negative_int, positive_int, subcommand
from composer_jax.config import ConfigError, MeshConfig

HBM_GB = 141.0            # --hbm-gb's default: an H200


def parse_layout(text: str) -> MeshConfig:
    """'fsdp=64,cp=2,ep=128' -> MeshConfig (other axes at their defaults)."""
    from composer_jax.config import from_dict

    fields = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not value.strip().lstrip("-").isdigit():
            raise ConfigError("--layout", f"{text!r}: expected axis=size pairs such as fsdp=64,cp=2,ep=128")
        fields[key.strip()] = int(value)
    try:
        return from_dict(MeshConfig, fields)
    except ConfigError as e:
        raise ConfigError("--layout", f"{text!r}: {e}") from None


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _layout_text(sizes: dict) -> str:
    dense = " ".join(f"{a}={sizes[a]}" for a in ("replica", "fsdp", "cp"))
    expert = " ".join(f"{a}={sizes[a]}" for a in ("ereplica", "efsdp", "ep"))
    return f"{dense} | {expert}"


def _verdict(total: float, hbm_gb: float) -> str:
    from composer_jax.plan.report import fits

    return "fits" if fits(total, hbm_gb) else "does not fit"


def plan_table(plans, hbm_gb: float) -> str:
    """Per-device rows (one column per plan: train, rl) and the verdict against the HBM."""
    from composer_jax.plan.report import MEM_FRACTION

    rows = [("parameters", "params"), ("router biases", "biases"), ("optimizer state", "optimizer"),
            ("gradients", "gradients"), ("batch", "batch"), ("activations (kept for backward)", "activations"),
            ("temporaries (peak phase)", "temporaries"), ("  of which one MoE layer's dispatch buffers", "dispatch")]
    width = max(len(label) for label, _ in rows) + 2
    out = [f"{'per device':<{width}}" + "".join(f"{p.step:>14}" for p in plans)]
    for label, field in rows:
        out.append(f"{label:<{width}}" + "".join(f"{_gb(getattr(p, field)):>14}" for p in plans))
    out.append(f"{'total':<{width}}" + "".join(f"{_gb(p.total):>14}" for p in plans))
    out.append(f"{'peak phase':<{width}}" + "".join(f"{p.settings['phase']:>14}" for p in plans))
    usable = hbm_gb * MEM_FRACTION
    out.append(f"{f'vs {hbm_gb:g} GB HBM ({usable:.1f} GB usable)':<{width}}"
               + "".join(f"{_verdict(p.total, hbm_gb):>14}" for p in plans))
    for p in plans:
        phases = ", ".join(f"{name} {_gb(size)}" for name, size in sorted(p.phases.items(), key=lambda kv: -kv[1]))
        out.append(f"{p.step} phases beyond the state and batch: {phases}")
        for kind in ("activations", "temporaries"):
            items = sorted(p.where[kind].items(), key=lambda kv: -kv[1])[:6]
            if items:
                out.append(f"{p.step} {kind}: " + ", ".join(f"{name} {_gb(size)}" for name, size in items))
    return "\n".join(out)


def _run_plan(args) -> int:
    from composer_jax.plan.report import load_plan_config, plan_report

    cfg = load_plan_config(args.config, args.overrides)
    options = {"attention": args.attention, "grouped_matmul": args.grouped_matmul, "platform": args.platform}
    report = plan_report(cfg, args.devices, rl_slots=args.rl_slots, rl_window=args.rl_window,
                         devices_per_host=args.devices_per_host, seq_lens=args.seq_lens or (),
                         layouts=[parse_layout(text) for text in args.layout], **options)
    print(_heading(args, cfg, report) + "\n")
    print(plan_table([p for p in (report.train, report.rl) if p is not None], args.hbm_gb))
    if report.loading is not None:
        _print_loading(report.loading)
    if report.muon is not None:
        share = report.muon
        print(f"\nMuon Newton-Schulz per device: {share.per_device / 1e12:.4g} TFLOP, {share.ratio:.4f}x the even "
              f"share (total {share.total / 1e12:.4g} TFLOP over {share.matrices:,} matrices / {share.devices})")
    if report.verdicts:
        _print_verdicts(report, args.hbm_gb)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "overrides": list(args.overrides), "devices": args.devices,
                       **report.to_dict(args.hbm_gb)}, f, indent=2)
    return 0


def _heading(args, cfg, report) -> str:
    s, window = report.train.settings, min(args.rl_window, cfg.train.seq_len)
    if report.rl is None:
        rl_note = f"RL step not planned: {report.rl_error}"
    else:
        feedback = f"{args.rl_slots} feedback window(s) of {window} tokens" if args.rl_slots else "no feedback windows"
        rl_note = f"RL: {cfg.train.batch_size} rows of {cfg.train.seq_len} tokens, {feedback} per row"
    return (f"plan: {args.config} on {args.devices} devices, layout {_layout_text(report.train.sizes)}\n"
            f"attention {s['attention']} ({s['platform']}), remat {s['remat']}, dispatch {s['dispatch']} (capacity "
            f"factor {s['capacity_factor']}), grouped matmul {s['grouped_matmul']}, optimizer {s['optimizer']}; "
            f"train: {cfg.train.batch_size // cfg.train.grad_accum} rows of {cfg.train.seq_len} tokens per "
            f"micro-batch; {rl_note}")


def _print_loading(loading) -> None:
    peak = loading.peak
    print(f"\nloading {loading.description}: peak {_gb(peak.bytes)} per host of {loading.devices_per_host} devices "
          f"({peak.leaf}: its local shards {_gb(peak.held)} + one source tensor's block {_gb(peak.read)}"
          f"{', dequantized to float32' if loading.quantized else ''})")


def _print_verdicts(report, hbm_gb: float) -> None:
    from composer_jax.plan.report import MEM_FRACTION

    print(f"\ntraining step per device by layout and sequence length (1 sequence per data-parallel shard, "
          f"{MEM_FRACTION:.0%} of {hbm_gb:g} GB usable):")
    print(f"  {'layout':<46}" + "".join(f"{f'seq {n:,}':>24}" for n in report.seq_lens))
    for layout in report.verdicts:
        if layout.error is not None:
            print(f"  {layout.mesh}: {layout.error}")
            continue
        cells = [f"{'n/a':>24}" if isinstance(p, str) else f"{p.total / 1e9:9.1f} GB {_verdict(p.total, hbm_gb):>12}"
                 for p in layout.plans]
        print(f"  {_layout_text(layout.sizes):<46}" + "".join(f"{c:>24}" for c in cells))


def _seq_lens(text: str) -> list[int]:
    return [positive_int(x) for x in text.split(",") if x]


def _add_plan(sub) -> None:
    p = subcommand(sub, "plan", _run_plan, "per-device memory of the training and RL steps on a layout",
                   "Plan per-device memory (parameters, optimizer state, gradients, activations, temporaries, "
                   "expert dispatch buffers) of the training step and the RL step on N devices, from the config "
                   "alone (no devices, nothing allocated), with a verdict against the GPU's memory; with "
                   "--seq-lens or --layout, a verdict per layout and sequence length.")
    p.add_argument("config", help="a run config (e.g. pretrain-tiny) or a model config (e.g. kimi-k2.5), YAML path "
                                  "or bundled name")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="run-config overrides, e.g. model.moe.dispatch=ep_a2a train.remat=full mesh.cp=2")
    p.add_argument("--devices", type=positive_int, required=True, help="devices to plan for")
    p.add_argument("--layout", action="append", default=[], metavar="AXIS=SIZE,...",
                   help="a layout to judge with --seq-lens (repeatable), e.g. fsdp=64,cp=2,ep=128 (default: "
                        "context parallelism 1, 2, 4, ... 64 with FSDP over the rest)")
    p.add_argument("--seq-lens", type=_seq_lens, metavar="L1,L2",
                   help="sequence lengths to judge, e.g. 32768,262144 (with --layout alone: train.seq_len)")
    p.add_argument("--attention", choices=("reference", "blockwise", "cudnn", "auto"),
                   help="attention implementation (default: model.attention)")
    p.add_argument("--platform", choices=("gpu", "cpu"), default="gpu",
                   help="where the step runs, for model.attention=auto: gpu (cuDNN where it applies, else "
                        "blockwise) or cpu (the dense reference up to 1024 keys, else blockwise); default gpu")
    p.add_argument("--grouped-matmul", choices=("expanded", "kernel"), default="expanded",
                   help="how ragged_dot runs: XLA's expansion over a masked [experts, rows, width] copy (CPU, and "
                        "GPU without a grouped kernel) or a grouped-GEMM kernel (default: expanded)")
    p.add_argument("--rl-slots", type=non_negative_int, default=1,
                   help="RL feedback windows per trajectory (default 1; 0: no self-distillation teacher)")
    p.add_argument("--rl-window", type=positive_int, default=2048, help="tokens per RL feedback window (default 2048)")
    p.add_argument("--devices-per-host", type=positive_int, default=8,
                   help="devices a host drives, for the host memory of loading train.init_from (default 8)")
    p.add_argument("--hbm-gb", type=float, default=HBM_GB, help=f"memory per device in GB (default {HBM_GB:g}: H200)")
    p.add_argument("--json", metavar="PATH", help="also write the plans and verdicts as JSON")

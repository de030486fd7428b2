"""`composer-jax plan CONFIG [key=value ...] --devices N`: does a step fit, and where does the memory go."""

from __future__ import annotations

import json

from composer_jax.cli.common import non_negative_int, positive_int, subcommand
from composer_jax.config import ConfigError, MeshConfig

HBM_GB = 141.0            # an H200
MEM_FRACTION = 0.9        # XLA_PYTHON_CLIENT_MEM_FRACTION: what JAX may take (shared/reference/performance.md 3)


def load_plan_config(name: str, overrides):
    """A RunConfig: a run config with overrides, or a model config with default run settings (then the
    overrides are run-config keys: model.moe.dispatch=ep_a2a, train.remat=full, mesh.cp=2)."""
    from composer_jax.config import (
        apply_overrides,
        command_line_overrides,
        from_dict,
        override_origin,
        read_yaml,
        resolve_config_path,
    )
    from composer_jax.train.config import RunConfig, is_run_config, load_run_config

    if is_run_config(name):
        return load_run_config(name, overrides)
    path = resolve_config_path(name, kind="model")
    try:
        return from_dict(RunConfig, apply_overrides(RunConfig, {"model": read_yaml(path)}, overrides))
    except ConfigError as e:
        raise override_origin(e, path, command_line_overrides(overrides)) from None


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


def candidate_layouts(cfg, devices: int) -> list[MeshConfig]:
    """Layouts to judge when none is given: context parallelism 1, 2, 4, ... 64 with FSDP over the rest
    of the devices, experts on the widest expert-parallel axis that divides both the experts and the
    devices (replicated over the remainder)."""
    experts = cfg.model.moe.n_routed_experts
    ep = max(e for e in range(1, devices + 1) if devices % e == 0 and experts % e == 0)
    return [MeshConfig(fsdp=devices // cp, cp=cp, ereplica=devices // ep, ep=ep)
            for cp in (1, 2, 4, 8, 16, 32, 64) if cp <= devices and devices % cp == 0]


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _layout_text(sizes: dict) -> str:
    dense = " ".join(f"{a}={sizes[a]}" for a in ("replica", "fsdp", "cp"))
    expert = " ".join(f"{a}={sizes[a]}" for a in ("ereplica", "efsdp", "ep"))
    return f"{dense} | {expert}"


def _verdict(total: float, hbm_gb: float) -> str:
    usable = hbm_gb * 1e9 * MEM_FRACTION
    return "fits" if total <= usable else "does not fit"


def plan_table(plans, hbm_gb: float) -> str:
    """Per-device rows (one column per plan: train, rl) and the verdict against the HBM."""
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
    import dataclasses

    from composer_jax.plan.memory import plan_train
    from composer_jax.plan.muon import ns_share
    from composer_jax.plan.rl import plan_rl
    from composer_jax.rl.config import RLConfig

    cfg = load_plan_config(args.config, args.overrides)
    layouts = [parse_layout(text) for text in args.layout]
    options = {"attention": args.attention, "grouped_matmul": args.grouped_matmul, "platform": args.platform}
    train = plan_train(cfg, args.devices, **options)
    window = min(args.rl_window, cfg.train.seq_len)
    tc = cfg.train   # the RL step with the run's optimizer, remat policy, loss chunk and micro-batches
    rl_cfg = RLConfig(optimizer=cfg.optimizer, remat=tc.remat, loss_chunk=tc.loss_chunk,
                      micro_batch=tc.batch_size // tc.grad_accum if tc.grad_accum > 1 else 0)
    try:
        rl = plan_rl(cfg, rl_cfg, args.devices, rows=cfg.train.batch_size, seq=cfg.train.seq_len,
                     slots=args.rl_slots, window=window, **options)
    except ConfigError as e:   # a layout the RL step cannot take: the training plan stands alone
        rl, rl_note = None, f"RL step not planned: {e}"
    else:
        feedback = f"{args.rl_slots} feedback window(s) of {window} tokens" if args.rl_slots else "no feedback windows"
        rl_note = f"RL: {cfg.train.batch_size} rows of {cfg.train.seq_len} tokens, {feedback} per row"
    plans = [train] if rl is None else [train, rl]
    s = train.settings
    print(f"plan: {args.config} on {args.devices} devices, layout {_layout_text(train.sizes)}\n"
          f"attention {s['attention']} ({s['platform']}), remat {s['remat']}, dispatch {s['dispatch']} (capacity "
          f"factor {s['capacity_factor']}), grouped matmul {s['grouped_matmul']}, optimizer {s['optimizer']}; "
          f"train: {cfg.train.batch_size // cfg.train.grad_accum} rows of {cfg.train.seq_len} tokens per "
          f"micro-batch; {rl_note}\n")
    print(plan_table(plans, args.hbm_gb))
    report = {"config": args.config, "overrides": list(args.overrides), "devices": args.devices,
              "hbm_gb": args.hbm_gb, "mem_fraction": MEM_FRACTION, "plans": [p.to_dict() for p in plans]}
    if cfg.train.init_from:
        report["loading"] = _loading(cfg, train.sizes, min(args.devices, args.devices_per_host))
    if cfg.optimizer.name == "muon":
        share = ns_share(cfg.model, train.sizes, ns_dtype=cfg.optimizer.ns_dtype)
        print(f"\nMuon Newton-Schulz per device: {share.per_device / 1e12:.4g} TFLOP, {share.ratio:.4f}x the even "
              f"share (total {share.total / 1e12:.4g} TFLOP over {share.matrices:,} matrices / {share.devices})")
        report["muon_ns"] = dataclasses.asdict(share) | {"ratio": share.ratio}
    if args.seq_lens or layouts:
        report["verdicts"] = _verdicts(cfg, args.seq_lens or [cfg.train.seq_len],
                                       layouts or candidate_layouts(cfg, args.devices), args, options)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _loading(cfg, sizes: dict, devices_per_host: int) -> dict:
    """Print and return the host memory of streaming train.init_from's weights onto the layout."""
    import numpy as np

    from composer_jax.model_dirs import open_source
    from composer_jax.plan.loading import loading_peak

    source = open_source(cfg.train.init_from, need_weights=False)    # its config and index: nothing is read
    itemsize = 4 if source.quantized else np.dtype(source.model.param_dtype).itemsize
    peak = loading_peak(cfg.model, sizes, devices_per_host, itemsize)
    print(f"\nloading {source.description}: peak {_gb(peak.bytes)} per host of {devices_per_host} devices ({peak.leaf}: "
          f"its local shards {_gb(peak.held)} + one source tensor's block {_gb(peak.read)}"
          f"{', dequantized to float32' if source.quantized else ''})")
    return {"source": str(source.path), "devices_per_host": devices_per_host, **peak.to_dict()}


def _verdicts(cfg, seq_lens: list[int], layouts: list[MeshConfig], args, options) -> list[dict]:
    """Print and return the training step's verdict per layout and sequence length (one sequence per
    data-parallel shard, no gradient accumulation)."""
    import dataclasses

    from composer_jax.plan.memory import layout_sizes, plan_train

    print(f"\ntraining step per device by layout and sequence length (1 sequence per data-parallel shard, "
          f"{MEM_FRACTION:.0%} of {args.hbm_gb:g} GB usable):")
    print(f"  {'layout':<46}" + "".join(f"{f'seq {n:,}':>24}" for n in seq_lens))
    verdicts = []
    for mesh in layouts:
        layout_cfg = dataclasses.replace(cfg, mesh=mesh)
        try:
            sizes = layout_sizes(layout_cfg, args.devices)
        except ConfigError as e:
            print(f"  {mesh}: {e}")
            continue
        cells = []
        for seq in seq_lens:
            try:
                train = dataclasses.replace(cfg.train, batch_size=sizes["replica"] * sizes["fsdp"], grad_accum=1,
                                            seq_len=seq)
                p = plan_train(dataclasses.replace(layout_cfg, train=train), args.devices, **options)
            except ConfigError as e:
                cells.append(f"{'n/a':>24}")
                verdicts.append({"layout": sizes, "seq": seq, "error": str(e)})
                continue
            fits = _verdict(p.total, args.hbm_gb)
            cells.append(f"{p.total / 1e9:9.1f} GB {fits:>12}")
            verdicts.append({"layout": sizes, "seq": seq, "total": p.total, "fits": fits == "fits", "plan": p.to_dict()})
        print(f"  {_layout_text(sizes):<46}" + "".join(f"{c:>24}" for c in cells))
    return verdicts


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

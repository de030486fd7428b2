"""`composer-jax plan CONFIG [key=value ...] --devices N`: does a step fit, and where does the memory go."""

from __future__ import annotations

import json

from composer_jax.cli.common import non_negative_int, positive_int, subcommand
from composer_jax.config import ConfigError, MeshConfig


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


def _hardware(args):
    """The device and links the step time is estimated for: the --gpu preset, with any rate given."""
    import dataclasses

    from composer_jax.plan.timing import PRESETS

    hw = PRESETS[args.gpu]
    flops = hw.flops if args.flops is None else args.flops
    return dataclasses.replace(
        hw, hbm_gb=hw.hbm_gb if args.hbm_gb is None else args.hbm_gb, flops=flops,
        flops_f32=hw.flops_f32 * flops / hw.flops, devices_per_node=args.devices_per_host,
        intra_bw=hw.intra_bw if args.intra_bw is None else args.intra_bw * 1e9,
        inter_bw=hw.inter_bw if args.inter_bw is None else args.inter_bw * 1e9)


def _run_plan(args) -> int:
    from composer_jax.config import command_line_overrides
    from composer_jax.plan.report import fits, load_plan_config, plan_report
    from composer_jax.plan.search import (
        SEARCH_KEYS,
        best_fitting,
        search,
        with_settings,
    )
    from composer_jax.train.config import is_run_config

    cfg = load_plan_config(args.config, args.overrides)
    if args.compile_for:
        return _run_compile(args, cfg)
    hw = _hardware(args)
    options = {"attention": args.attention, "grouped_matmul": args.grouped_matmul, "platform": args.platform}
    fixed = set(command_line_overrides(args.overrides)) & set(SEARCH_KEYS)
    chosen, found = None, []
    if not is_run_config(args.config):   # a model config has no run settings: the search picks those not given
        chosen, found = best_fitting(cfg, args.devices, hw, fixed, **options)
        cfg = cfg if chosen is None else with_settings(cfg, chosen.settings)
    report = plan_report(cfg, args.devices, rl_slots=args.rl_slots, rl_window=args.rl_window,
                         devices_per_host=args.devices_per_host, seq_lens=args.seq_lens or (),
                         layouts=[parse_layout(text) for text in args.layout], **options)
    print(_heading(args, cfg, report))
    if chosen is not None:
        print(f"run settings chosen for {args.devices} devices by the layout search (keys not on the command "
              f"line): {chosen.overrides()}")
    print()
    print(plan_table([p for p in (report.train, report.rl) if p is not None], hw.hbm_gb))
    _print_extras(report, hw.hbm_gb)
    deployment = _print_deployment(args, cfg, report, hw) if args.engines else None
    found = (found or search(cfg, args.devices, hw, fixed=fixed, **options)) if args.search else []
    if found:
        _print_search(found, args.top, hw)
    if not fits(report.train.total, hw.hbm_gb):
        _print_remedy(args, cfg, hw, fixed, options, found or None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "overrides": list(args.overrides), "devices": args.devices,
                       **report.to_dict(hw.hbm_gb), "search": [_candidate_json(c) for c in found[:args.top]],
                       **({"deployment": deployment.to_dict()} if deployment else {})},
                      f, indent=2)
    return 0


def _run_compile(args, cfg) -> int:
    """`--compile-for`: the steps built for the GPU topology, each beside the planner's estimate."""
    from composer_jax.plan.gpu_compile import compile_for

    seq = cfg.train.seq_len
    engine = None if not args.engine_slots else {"slots": args.engine_slots, "max_len": seq, "chunk": min(256, seq),
                                                 "steps": 8}
    programs = compile_for(cfg, args.compile_for, args.devices, args.hosts, slots=args.rl_slots,
                           window=args.rl_window, engine=engine)
    print(f"compiled for {args.hosts} host(s) x {args.devices // args.hosts} {args.compile_for} "
          f"(deviceless; per device):")
    for program in programs:
        if isinstance(program, str):
            print(f"  {program}")
            continue
        ratios = ", ".join(f"{how} {r:.3f}" for how, r in program.ratios().items()) or "(no planner estimate)"
        print(f"  {program.name}: arguments {_gb(program.argument)}, outputs {_gb(program.output)}, aliased "
              f"{_gb(program.alias)}, temporaries {_gb(program.temp)}; total {_gb(program.total)}; plan / "
              f"compiled {ratios}; model FLOPs {program.model_flops / 1e12:.4g} TFLOP (XLA gives none)")
        for (kind, span), c in sorted(program.summary.collectives.items()):
            print(f"    {kind:<20} over {span:<28} {c.count:>8g} per step  {_gb(c.bytes)}")
        calls = ", ".join(f"{name} x{n}" for name, n in sorted(program.summary.custom_calls.items()))
        print(f"    custom calls and fusions: {calls or 'none'}")
        if program.note:
            print(f"    note: {program.note}")
    return 0


def _print_extras(report, hbm_gb: float) -> None:
    if report.loading is not None:
        _print_loading(report.loading)
    if report.muon is not None:
        share = report.muon
        print(f"\nMuon Newton-Schulz per device: {share.per_device / 1e12:.4g} TFLOP, {share.ratio:.4f}x the even "
              f"share (total {share.total / 1e12:.4g} TFLOP over {share.matrices:,} matrices / {share.devices})")
    if report.verdicts:
        _print_verdicts(report, hbm_gb)


def _print_deployment(args, cfg, report, hw):
    """The RL deployment (--engines): each engine's memory and what a weight version moves."""
    from composer_jax.plan.deployment import learner_quantizing, plan_deployment

    int4 = args.engine_weights == "int4"
    max_len = args.engine_max_len or cfg.train.seq_len
    d = plan_deployment(cfg.model, learner_devices=args.devices, devices_per_host=args.devices_per_host,
                        engines=args.engines, engine_devices=args.engine_devices, int4=int4,
                        slots=args.engine_slots, max_len=max_len, bandwidth=hw.inter_bw)
    e, v, hosts = d.engine, d.traffic, -(-args.devices // args.devices_per_host)
    experts = f"INT4, {e.sizes['ep']} ways" if int4 else f"{e.weights}, {e.sizes['ep']} ways"
    print(f"\nRL deployment: the learner on {args.devices} devices ({hosts} hosts), {args.engines} engine(s) of "
          f"{args.engine_devices} devices; an engine per device:")
    for label, size in ((f"dense weights (replicated, {cfg.model.param_dtype})", e.dense_params),
                        (f"routed experts ({experts})", e.routed_params),
                        (f"latent cache ({args.engine_slots} slots x {max_len} positions)", e.cache),
                        ("one layer's experts dequantized", e.dequantized_layer)):
        print(f"  {label:<58}{_gb(size):>12}")
    print(f"  {'total (an engine process drops a version, then reads the next)':<58}{_gb(e.total):>12}  "
          f"{_verdict(e.total, hw.hbm_gb)} in {hw.hbm_gb:g} GB")
    print(f"  {'an in-process engine taking a version (two copies)':<58}{_gb(e.swapping):>12}  "
          f"{_verdict(e.swapping, hw.hbm_gb)}")
    print(f"  an engine host ({args.engine_devices} devices): {_gb(e.total * args.engine_devices)} of device memory")
    if report.rl is not None:
        quantizing = (f"; quantizing a version between steps adds {_gb(learner_quantizing(cfg.model, report.rl.sizes))}"
                      " a device" if int4 else "")
        print(f"the learner: {_gb(report.rl.total)} a device in its RL step ({_gb(report.rl.total * args.devices_per_host)}"
              f" a host of {args.devices_per_host}){quantizing}; a version's own shards on their way to the files: "
              f"{_gb(v.learner_host_buffer)} of host memory a host; device to device: its copies of a device's "
              f"share, {_gb(v.learner_device_held)} a device")
    print(f"a version: {_gb(v.bytes)} (routed experts {_gb(v.routed_bytes)}{', INT4: quantized by the learner' * int4}),"
          f" read whole by each engine; at {v.bandwidth / 1e9:g} GB/s a device: an engine takes it in "
          f"{v.engine_s:.3g} s, the learner sends it to {args.engines} engine(s) in {v.learner_s:.3g} s: "
          f"{v.seconds:.3g} s a version")
    return d


def _candidate_json(c) -> dict:
    return {"settings": c.settings, "fits": c.fits, "total": c.plan.total, "step_s": c.time.total_s,
            "compute_s": c.time.compute_s, "comm_s": c.time.comm_s, "comm_bytes": c.time.comm_bytes}


def _print_search(found, top: int, hw) -> None:
    fitting = [c for c in found if c.fits]
    print(f"\nlayout search: {len(found):,} layouts planned, {len(fitting):,} fit; the fastest by the estimated "
          f"step time ({hw.name}: {hw.flops / 1e12:g} TFLOP/s bf16, {hw.intra_bw / 1e9:g} GB/s within a node of "
          f"{hw.devices_per_node}, {hw.inter_bw / 1e9:g} GB/s between nodes; docs/planning.md):")
    for i, c in enumerate(fitting[:top], 1):
        comm = ", ".join(f"{name} {sec:.3g}" for name, sec in sorted(c.time.comm_s.items(), key=lambda kv: -kv[1])[:3])
        print(f"  {i}. {c.plan.total / 1e9:.1f} GB, {c.time.total_s:.3g} s/step (compute {c.time.compute_s:.3g} s"
              f"{'; ' + comm if comm else ''}): {c.overrides()}")
    if not fitting:
        print("  none fits")


def _print_remedy(args, cfg, hw, fixed: set[str], options: dict, searched) -> None:
    """After a plan that does not fit: the fastest layout that does, or why none does (`searched`: the
    search already run for `--search`, or None)."""
    from composer_jax.plan.search import best_fitting, changed, largest_term

    best, candidates = best_fitting(cfg, args.devices, hw, fixed, searched, **options)
    if best is not None:
        print(f"\ndoes not fit in {hw.hbm_gb:g} GB; the fastest layout that fits ({best.plan.total / 1e9:.1f} GB, "
              f"{best.time.total_s:.3g} s/step estimated): {' '.join(f'{k}={v}' for k, v in changed(cfg, best).items())}")
        return
    if not candidates:
        print(f"\ndoes not fit in {hw.hbm_gb:g} GB, and no layout of {args.devices} devices takes this run")
        return
    smallest = min(candidates, key=lambda c: c.plan.total)
    term, size = largest_term(smallest.plan)
    print(f"\ndoes not fit in {hw.hbm_gb:g} GB on any layout of {args.devices} devices: the smallest "
          f"({smallest.overrides()}) needs {smallest.plan.total / 1e9:.1f} GB, its largest term {term} "
          f"{size / 1e9:.1f} GB")


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


def _add_engine_args(p) -> None:
    """The engines' flags: the engine programs of --compile-for, and the RL deployment of --engines."""
    p.add_argument("--engine-slots", type=non_negative_int, default=8,
                   help="engine slots: with --compile-for, also build the engine's prefill (256-token chunks) and "
                        "decode (8 steps a call) for this many slots of train.seq_len cached positions (0: not); with "
                        "--engines, the slots whose cache an engine holds (default 8)")
    p.add_argument("--engines", type=non_negative_int, default=0,
                   help="also plan an RL deployment of this many rollout engines: each engine's memory and the "
                        "bytes and seconds a weight version moves (0: not; default 0)")
    p.add_argument("--engine-devices", type=positive_int, default=8, help="devices of each engine (default 8)")
    p.add_argument("--engine-weights", choices=("int4", "learner"), default="int4",
                   help="the engines' routed experts: int4 (K2.5's INT4, rollout.weights=int4) or the learner's "
                        "dtype (default int4)")
    p.add_argument("--engine-max-len", type=positive_int,
                   help="cache positions per engine slot (default train.seq_len); slots: --engine-slots")


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
    p.add_argument("--grouped-matmul", choices=("expanded", "kernel", "blocked"),
                   help="how the MoE's grouped matmuls run: XLA's ragged_dot expanded over a masked [experts, rows, "
                        "width] copy (GPU without a grouped kernel), a grouped-GEMM kernel, or blocks of one "
                        "expert's rows (CPU) (default: blocked on --platform cpu, else expanded)")
    p.add_argument("--rl-slots", type=non_negative_int, default=1,
                   help="RL feedback windows per trajectory (default 1; 0: no self-distillation teacher)")
    p.add_argument("--rl-window", type=positive_int, default=2048, help="tokens per RL feedback window (default 2048)")
    p.add_argument("--devices-per-host", type=positive_int, default=8,
                   help="devices a host (a node) drives: the host memory of loading train.init_from, and which "
                        "collectives stay within a node (default 8)")
    p.add_argument("--hbm-gb", type=float, help="memory per device in GB (default: the --gpu preset's)")
    p.add_argument("--gpu", choices=("h100", "h200"), default="h200",
                   help="the device preset: memory, FLOP/s and link bandwidths (datasheets; default h200)")
    p.add_argument("--flops", type=float, metavar="FLOP/S", help="dense bf16 FLOP/s per device, e.g. 989e12 "
                                                                  "(default: the preset's)")
    p.add_argument("--intra-bw", type=float, metavar="GB/S",
                   help="bandwidth per device and direction within a node of --devices-per-host (default: the "
                        "preset's NVLink, 450)")
    p.add_argument("--inter-bw", type=float, metavar="GB/S",
                   help="bandwidth per device and direction between nodes (default: the preset's network, 50)")
    p.add_argument("--search", action="store_true",
                   help="enumerate layouts (dense and expert grids, dispatch, remat, micro-batches, Muon's NS dtype; "
                        "keys on the command line stay) and print the fastest that fit by the estimated step time")
    p.add_argument("--top", type=positive_int, default=5, help="layouts --search prints (default 5)")
    p.add_argument("--json", metavar="PATH", help="also write the plans and verdicts as JSON")
    p.add_argument("--compile-for", choices=("h100", "h200"),
                   help="compile (never run) the training and RL steps for --hosts hosts of these GPUs on this "
                        "machine, no GPU needed, and report XLA's memory beside the plan, the collectives and "
                        "custom calls (needs the cuda12 extra: pip install -e '.[cuda12]')")
    _add_engine_args(p)
    p.add_argument("--hosts", type=positive_int, default=1,
                   help="hosts of the --compile-for topology, --devices split evenly over them (default 1)")

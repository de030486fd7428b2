"""`composer-jax bench`: every benchmark section in one run, one JSON, a short table.

Presets size the run: `cpu` (the tiny model; a few minutes on a laptop CPU), `gpu` (the proxy MoE of
configs/model/proxy-moe.yaml, sized to fill one H200); `--quick` shrinks either to a smoke run (the
CPU one is what the tests run). Each section is measured side by side against its reference:

    train_step   the step's tokens/s and MFU; compiled FLOPs over the analytic model FLOPs (the waste)
    attention    blockwise (and cuDNN on a GPU) against the dense reference: fwd+bwd time, step memory
    dispatch     ragged, ep_a2a (and ep_ragged off CPU) against dense: time and error
    rl_teacher   the RL step's teacher share against the naive full-context teacher
    decode       MTP-speculative against plain greedy decoding (a trained run; self-drafting models per size)
    decode_peer  our greedy decoding against transformers' `generate` on the same checkpoint, per batch
    train_peer   `composer-jax pretrain`'s step against a PyTorch loop over transformers' model, same checkpoint
    muon         our sharded Muon against optax.contrib.muon
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import time
from pathlib import Path

FILL_FRACTION = 0.8   # of the device memory XLA may use: the GPU preset's batch fills this much
SECTIONS = ("train_step", "attention", "dispatch", "rl_teacher", "decode", "decode_peer", "train_peer", "muon")
PRESETS = ("cpu", "gpu")
# train_peer's rows beside the run's defaults (a device per core, `ragged` dispatch, layers unrolled on
# CPU): each default against its alternative (issue 41's table)
PEER_SETTINGS = (("model.layer_loop=scan",), ("model.moe.dispatch=dense",), ("train.num_devices=1",))


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every size a run uses (a preset, possibly quick)."""

    model: str                    # bundled model config of the training step
    batch_size: int               # 0: as many rows as fit in FILL_FRACTION of the device's memory
    seq_len: int
    repeats: int                  # timed repetitions of each contender (after one untimed warm-up)
    kernel_lengths: tuple         # attention fwd+bwd key lengths
    kernel_shapes: dict           # {name: (heads, dk, dv)}
    memory_lengths: tuple         # training-step temp memory (tiny model), per sequence length; () skips
    kernel_dtype: str
    dispatch: tuple               # tokens, embed, moe_mlp, experts, k
    teacher: tuple                # prefix, turn, (flagged turns per row to compare with one) (tiny model)
    decode: tuple                 # prompt_len, new_tokens, model sizes of self-drafting rows (bench/decode.py)
    muon: tuple                   # experts, moe_layers
    decode_peer: tuple            # model sizes (bench/decode_peer.py), batches, prompt_len, new_tokens
    model_overrides: tuple = ()   # dotted changes to the train-step and teacher sections' models
    # shapes (bench/train_peer.py SHAPES), rows of extra settings, compiled FLOPs with loops unrolled
    train_peer: tuple = ((), (), True)


def sizes(preset: str, quick: bool) -> Sizes:
    if preset == "cpu" and quick:
        # Two decoder layers (one dense, one MoE): the smoke run's time is tracing and compiling, per layer.
        return Sizes("tiny", 2, 64, 2, (128,), {"tiny": (4, 24, 24)}, (), "float32",
                     (128, 64, 32, 16, 4), (16, 8, (2,)), (8, 16, ()), (8, 1), (("tiny",), (1, 8), 8, 8),
                     ("num_layers=2",), train_peer=(("tiny_quick",), (), False))
    if preset == "cpu":
        return Sizes("tiny", 8, 128, 5, (256, 1024, 2048), {"tiny": (4, 24, 24), "k25_8heads": (8, 192, 128)},
                     (1024, 2048, 4096), "float32", (2048, 256, 128, 32, 8), (32, 16, (2, 4)),
                     (32, 64, ("tiny", "weight_bound")), (32, 2), (("tiny", "weight_bound"), (1, 8, 32, 128), 48, 64),
                     train_peer=(("held_out", "tiny_recipe"), PEER_SETTINGS, True))
    k25 = {"k25_16heads": (16, 192, 128)}
    if quick:
        return Sizes("proxy-moe", 1, 2048, 3, (1024, 4096), k25, (), "bfloat16",
                     (8192, 2048, 1024, 32, 8), (32, 16, (2, 4)), (32, 64, ("tiny",)), (32, 2),
                     (("tiny",), (1, 8), 8, 8), train_peer=(("tiny_quick",), (), False))
    # Sized for tools/device_check.sh's 8 minutes: the step's memory growth is measured on CPU, and
    # decode_peer keeps to the smoke sizes (transformers runs on the host's CPU).
    return Sizes("proxy-moe", 0, 4096, 5, (1024, 4096, 8192), k25, (), "bfloat16",
                 (32768, 2048, 1024, 32, 8), (32, 16, (2, 4)), (32, 128, ("tiny", "weight_bound")),
                 (32, 2), (("tiny",), (1, 8), 8, 8), train_peer=(("tiny_quick",), (), False))


def section_model(name: str, s: Sizes):
    """The model config of the train_step or rl_teacher section (rl_teacher: the tiny model)."""
    from composer_jax import load_config

    return load_config(s.model if name == "train_step" else "tiny", list(s.model_overrides))


def section_shapes(name: str, s: Sizes) -> None:
    """Trace or lower (shapes only: nothing compiled, nothing run) every program section `name` builds
    at sizes `s`, by the builders its run uses: a size that cannot run fails here in seconds, before
    minutes of measuring (and in tests/test_bench_shapes.py, at every preset's sizes)."""
    import jax.numpy as jnp

    from composer_jax import load_config
    from composer_jax.bench import attention, decode, decode_peer, dispatch, muon, rl_teacher, train_peer, train_step

    if name == "train_step":   # batch 0 (fill the device) is found by compiling batch 1
        train_step.train_step_shapes(section_model(name, s), s.batch_size or 1, s.seq_len)
    elif name == "attention":
        attention.kernel_shapes(s.kernel_lengths, s.kernel_shapes, jnp.dtype(s.kernel_dtype))
        attention.memory_shapes(load_config("tiny"), s.memory_lengths)
    elif name == "dispatch":
        dispatch.dispatch_shapes(*s.dispatch)
    elif name == "rl_teacher":
        rl_teacher.section_shapes(section_model(name, s), *s.teacher)
    elif name == "decode":
        decode.decode_shapes(*s.decode)
    elif name == "decode_peer":
        decode_peer.decode_peer_shapes(*s.decode_peer, s.model_overrides)
    elif name == "train_peer":
        train_peer.train_peer_shapes(*s.train_peer[:2])
    else:
        muon.muon_shapes(*s.muon)


def run_section(name: str, s: Sizes, decode_run: Path | None) -> dict:
    import jax.numpy as jnp

    from composer_jax import load_config

    if name == "train_step":
        from composer_jax.bench.train_step import device_memory_bytes, fitting_batch, train_step_section

        model, batch, sized = section_model(name, s), s.batch_size, {}
        if not batch:
            budget = FILL_FRACTION * (device_memory_bytes() or 0)
            batch = fitting_batch(model, s.seq_len, budget) if budget else 1
            sized = {"batch_fills_bytes": budget}
        return {"model": s.model, **sized, **train_step_section(model, batch, s.seq_len, s.repeats)}
    if name == "attention":
        from composer_jax.bench.attention import kernel_section, memory_section

        out = {"kernel": kernel_section(s.kernel_lengths, s.kernel_shapes, s.repeats, jnp.dtype(s.kernel_dtype))}
        if s.memory_lengths:
            out["memory"] = memory_section(load_config("tiny"), s.memory_lengths)
        return out
    if name == "dispatch":
        from composer_jax.bench.dispatch import dispatch_section

        return dispatch_section(*s.dispatch, s.repeats)
    if name == "rl_teacher":
        from composer_jax.bench.rl_teacher import teacher_section

        return teacher_section(section_model(name, s), *s.teacher)   # positions: the longest rollout it builds
    if name == "decode":
        from composer_jax.bench.decode import decode_section

        return decode_section(decode_run, *s.decode, s.repeats)
    if name == "decode_peer":
        from composer_jax.bench.decode_peer import decode_peer_section

        return decode_peer_section(*s.decode_peer, min(s.repeats, 3), s.model_overrides)
    if name == "train_peer":
        from composer_jax.bench.train_peer import train_peer_section

        shapes, settings, unrolled = s.train_peer
        return train_peer_section(shapes, settings, s.repeats, unrolled)
    from composer_jax.bench.muon import compare

    experts, layers = s.muon
    out = compare(experts, layers, repeats=s.repeats)
    return {k: v for k, v in out.items() if not k.startswith("times")}


def run(preset: str, quick: bool, sections=SECTIONS, decode_run: Path | None = None, progress=print,
        save=lambda results: None) -> dict:
    """{"environment": ..., "sizes": ..., section: results, ...}; each section also records its wall time.
    `save(results)` runs after each section (a run cut short keeps what it measured)."""
    import jax

    s = sizes(preset, quick)
    for name in sections:   # seconds: a size that cannot run fails before any section is measured
        progress(f"bench: {name} shapes ...")
        section_shapes(name, s)
    results = {"environment": {"jax": jax.__version__, "backend": jax.default_backend(),
                               "device": jax.devices()[0].device_kind, "devices": len(jax.devices()),
                               "machine": platform.machine(), "cpus": os.cpu_count(),
                               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "preset": preset, "quick": quick},
               "sizes": dataclasses.asdict(s)}
    for name in sections:
        progress(f"bench: {name} ...")
        start = time.perf_counter()
        results[name] = run_section(name, s, decode_run)
        results[name]["wall_s"] = time.perf_counter() - start
        save(results)
    return results


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def rows(results: dict) -> list[tuple[str, str, str, str]]:
    """(section, measured, reference, ratio) per line of the table."""
    out = []
    if "train_step" in results:
        r = results["train_step"]
        out.append(("train step", f"{r['tokens_per_s']:,.0f} tok/s, MFU {_pct(r['mfu'])}",
                    f"peak {r['peak_flops'] / 1e12:.3g} TFLOP/s", ""))
        out.append(("  FLOPs/token", f"compiled {r['compiled_flops_per_token']:.3g}",
                    f"model {r['model_flops_per_token']:.3g}", f"x{r['compiled_over_model_flops']:.2f}"))
    if "attention" in results:
        for r in results["attention"]["kernel"]:
            for impl in ("blockwise", "cudnn"):
                if f"{impl}_s" in r:
                    out.append((f"attention {r['shape']} {r['seq']}", f"{impl} {1e3 * r[f'{impl}_s']:.2f} ms",
                                f"reference {1e3 * r['reference_s']:.2f} ms", f"x{r[f'{impl}_over_reference']:.2f}"))
        for mem in results["attention"].get("memory", {}).get("train_step_temp_bytes", [])[-1:]:
            out.append((f"  step temp {mem['seq']}", f"blockwise {mem['blockwise'] / 2**20:.1f} MiB",
                        f"reference {mem['reference'] / 2**20:.1f} MiB",
                        f"x{mem['blockwise'] / mem['reference']:.2f}"))
    if "dispatch" in results:
        r = results["dispatch"]
        for kind, ms in r["median_ms"].items():
            if kind != "dense":
                out.append((f"dispatch {kind}", f"{ms:.2f} ms (err {r['rel_error_vs_dense'][kind]:.1e})",
                            f"dense {r['median_ms']['dense']:.2f} ms", f"x{r['over_dense'][kind]:.2f}"))
        out += [(f"dispatch {kind}", f"not run: {why}", "", "") for kind, why in r["skipped"].items()]
    if "rl_teacher" in results:
        r = results["rl_teacher"]
        out.append(("RL teacher share", _pct(r["prefix"]["share_of_step"]),
                    f"naive {_pct(r['full']['share_of_step'])}", f"naive x{r['naive_over_ours']:.2f}"))
        per_slot = r["per_slot_over_one"]
        out.append(("  per flagged turn", f"{'/'.join(per_slot)} per row", "1 per row",
                    " ".join(f"{k}: x{v:.2f}" for k, v in per_slot.items())))
    if "decode" in results:
        r = results["decode"]["greedy"]
        out.append(("decode speculative", f"{r['speculative_tokens_per_s']:,.0f} tok/s",
                    f"plain {r['plain_tokens_per_s']:,.0f} tok/s", f"x{r['speedup']:.2f}"))
        for size, sized in results["decode"]["sizes"].items():
            for r in sized["rows"]:
                out.append((f"  {size} self-drafting, {r['draft_tokens']} drafts",
                            f"{r['speculative_tokens_per_s']:,.0f} tok/s",
                            f"plain {r['plain_tokens_per_s']:,.0f} tok/s", f"x{r['speedup']:.2f}"))
    for size, r in results.get("decode_peer", {}).get("sizes", {}).items():
        for row in r["rows"]:
            out.append((f"decode {size} batch {row['batch']}", f"{row['ours_tokens_per_s']:,.0f} tok/s "
                        f"({_pct(row['ours_roofline_fraction'])} of roofline)",
                        f"transformers {row['transformers_tokens_per_s']:,.0f} tok/s", f"x{row['ratio']:.2f}"))
    for shape, r in results.get("train_peer", {}).get("shapes", {}).items():
        torch_rate = r["torch"]["tokens_per_s"]
        for row in r["rows"]:
            out.append((f"train {shape} {row['name']}", f"{row['tokens_per_s']:,.0f} tok/s",
                        f"torch {torch_rate:,.0f} tok/s", f"x{row['over_torch']:.2f}"))
        out.append(("  FLOPs/token", f"compiled {r['compiled_flops_per_token']:.3g}",
                    f"model {r['model_flops_per_token']:.3g}", f"x{r['compiled_over_model_flops']:.2f}"))
    if "muon" in results:
        r = results["muon"]
        out.append(("muon update", f"ours {1e3 * r['ours_s']:.1f} ms", f"optax {1e3 * r['optax_s']:.1f} ms",
                    f"speedup x{r['speedup']:.2f}"))
        out.append(("  NS FLOPs/device", f"ours x{r['ns_share_ours']:.2f} of total/N",
                    f"optax x{r['ns_share_optax']:.2f}", ""))
    return out


def table(results: dict) -> str:
    header = ("benchmark", "measured", "reference", "ratio")
    lines = [header, *rows(results)]
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def non_finite(results: dict, path: str = "") -> list[str]:
    """Paths of every non-finite float in `results` (a benchmark that produced NaN or inf)."""
    if isinstance(results, dict):
        return [p for k, v in results.items() for p in non_finite(v, f"{path}.{k}" if path else str(k))]
    if isinstance(results, list):
        return [p for i, v in enumerate(results) for p in non_finite(v, f"{path}[{i}]")]
    return [path] if isinstance(results, float) and not math.isfinite(results) else []

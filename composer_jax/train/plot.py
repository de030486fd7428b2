"""`composer-jax plot RUN_DIR`: PNG curves from RUN_DIR/metrics.jsonl.

Each curve has one point per logged value (throughput and MFU are measured once per `log_every` steps
and logged once), and quantities of different scale get their own axis (the MTP KL to the main head
is far smaller than the cross-entropies: it is drawn against a right-hand axis).
"""

from __future__ import annotations

from pathlib import Path

from composer_jax.train.metrics import read_metrics

LEFT, RIGHT = "left", "right"

# figure name -> (title, {axis: y label}, [(metric key, legend label, axis)])
FIGURES = {
    "loss": ("Loss", {LEFT: "nats / token"},
             [("loss", "train objective", LEFT), ("ce", "train CE", LEFT), ("eval_loss", "held-out CE", LEFT)]),
    "bits_per_byte": ("Held-out loss per byte", {LEFT: "bits / byte of text"},
                      [("eval_bpb", "held-out CE (comparable across tokenizers)", LEFT)]),
    "mtp": ("MTP", {LEFT: "cross-entropy (nats / token)", RIGHT: "KL to main head (nats / token)"},
            [("mtp1_ce", "MTP depth 1 CE", LEFT), ("eval_mtp1_ce", "held-out MTP depth 1 CE", LEFT),
             ("mtp1_kl", "MTP depth 1 KL to main", RIGHT)]),
    "mtp_acceptance": ("MTP speculative acceptance", {LEFT: "probability a draft is kept"},
                       [("mtp1_acceptance", "MTP depth 1 (sum_x min(p, q))", LEFT)]),
    "throughput": ("Throughput", {LEFT: "tokens / s"}, [("tokens_per_s", "tokens/s", LEFT)]),
    "mfu": ("Model FLOPs utilisation (estimate)", {LEFT: "MFU"}, [("mfu", "MFU", LEFT)]),
    "lr": ("Learning rate", {LEFT: "lr"}, [("lr", "lr", LEFT)]),
    "grad_norm": ("Gradient norm (before clipping)", {LEFT: "global norm"}, [("grad_norm", "grad norm", LEFT)]),
    "router": ("Expert load balance", {LEFT: "max / mean load"},
               [("expert_load_max_over_mean", "main MoE layers", LEFT)]),
    # RL runs (composer-jax rl)
    "reward": ("Reward", {LEFT: "reward / pass rate"},
               [("reward_mean", "mean reward (rollouts)", LEFT), ("pass_rate", "pass rate (rollouts)", LEFT),
                ("eval_pass@1", "held-out pass@1", LEFT)]),
    "rl_loss": ("RL loss terms", {LEFT: "loss"},
                [("loss_pg", "policy gradient", LEFT), ("loss_sd", "self-distillation", LEFT),
                 ("loss_kl", "KL (k2)", LEFT), ("loss_mtp", "MTP distillation", LEFT)]),
    "rl_rollouts": ("Rollouts", {LEFT: "rate", RIGHT: "tokens / turn"},
                    [("tool_error_rate", "failed / attempted calls", LEFT),
                     ("tool_turn_error_rate", "turns with a bad or no call", LEFT),
                     ("groups_dropped_zero_variance", "groups dropped (no signal)", LEFT),
                     ("response_length_mean", "response length", RIGHT)]),
    "rl_throughput": ("RL throughput", {LEFT: "tokens / s", RIGHT: "fraction of wall time"},
                      [("rollout_tokens_per_s", "rollout tokens/s", LEFT),
                       ("learner_tokens_per_s", "learner tokens/s", LEFT),
                       ("overlap_fraction", "rollout and learning overlap", RIGHT),
                       ("learner_wait_fraction", "learner waiting for rollouts", RIGHT),
                       ("engine_occupancy", "engine slots busy", RIGHT)]),
    "staleness": ("Staleness", {LEFT: "policy versions"},
                  [("staleness_mean", "mean", LEFT), ("staleness_max", "max", LEFT)]),
}


def make_figures(records: list[dict], run_name: str) -> dict:
    """{figure name: matplotlib Figure} for every figure with data (one line per series, one point per
    record holding its key; lines on the right-hand axis are drawn dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {}
    for name, (title, ylabels, series) in FIGURES.items():
        curves = []
        for key, label, axis in series:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                curves.append((label, axis, points))
        if not curves:
            continue
        fig, left = plt.subplots(figsize=(7, 4))
        axes = {LEFT: left}
        if any(axis == RIGHT for _, axis, _ in curves):
            axes[RIGHT] = left.twinx()
            axes[RIGHT].set_ylabel(ylabels[RIGHT])
        for i, (label, axis, points) in enumerate(curves):  # one colour cycle across both axes
            xs, ys = zip(*points)
            axes[axis].plot(xs, ys, label=label, color=f"C{i}", marker="o" if len(points) < 20 else None,
                            markersize=3, linestyle="--" if axis == RIGHT else "-")
        left.set(title=f"{title}: {run_name}", xlabel="step", ylabel=ylabels[LEFT])
        left.grid(alpha=0.3)
        handles = [h for ax in axes.values() for h in ax.get_legend_handles_labels()[0]]
        left.legend(handles, [h.get_label() for h in handles])
        fig.tight_layout()
        figures[name] = fig
    return figures


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per figure that has data; returns the paths written."""
    records = read_metrics(run_dir)
    if not records:
        raise FileNotFoundError(f"{Path(run_dir) / 'metrics.jsonl'} has no records yet")
    out = Path(out_dir) if out_dir else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    figures = make_figures(records, Path(run_dir).name)
    import matplotlib.pyplot as plt

    written = []
    for name, fig in figures.items():
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written

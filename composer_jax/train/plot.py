"""`composer-jax plot RUN_DIR`: PNG curves from RUN_DIR/metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from composer_jax.train.metrics import read_metrics

# figure name -> (title, y label, [(metric key, legend label)])
FIGURES = {
    "loss": ("Loss", "nats / token", [("loss", "train objective"), ("ce", "train CE"), ("eval_loss", "held-out CE")]),
    "mtp": ("MTP", "nats / token", [("mtp1_ce", "MTP depth 1 CE"), ("mtp1_kl", "MTP depth 1 KL to main"),
                                    ("eval_mtp1_ce", "held-out MTP depth 1 CE")]),
    "throughput": ("Throughput", "tokens / s", [("tokens_per_s", "tokens/s")]),
    "mfu": ("Model FLOPs utilisation (estimate)", "MFU", [("mfu", "MFU")]),
    "lr": ("Learning rate", "lr", [("lr", "lr")]),
    "grad_norm": ("Gradient norm (before clipping)", "global norm", [("grad_norm", "grad norm")]),
    "router": ("Expert load balance", "max / mean load", [("expert_load_max_over_mean", "main MoE layers")]),
}


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per figure that has data; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    if not records:
        raise FileNotFoundError(f"{Path(run_dir) / 'metrics.jsonl'} has no records yet")
    out = Path(out_dir) if out_dir else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (title, ylabel, series) in FIGURES.items():
        curves = []
        for key, label in series:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                curves.append((label, points))
        if not curves:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, points in curves:
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=label, marker="o" if len(points) < 20 else None, markersize=3)
        ax.set(title=f"{title}: {Path(run_dir).name}", xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written

"""Training: configs, losses, the step and loop, metrics, plots."""

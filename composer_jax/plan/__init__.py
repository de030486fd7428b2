"""Memory planning: per-device bytes of a step on any layout, from the config alone (`plan_train`)."""

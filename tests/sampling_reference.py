"""An independent NumPy statement of the sampling distribution (temperature, top-k, then top-p over
the renormalised top-k set; temperature 0: the argmax), written from the definitions, not from
composer_jax.infer.sampling."""

from __future__ import annotations

import numpy as np


def sampling_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """float64[vocab]: the probability of each token under the settings. logits: [vocab]."""
    logits = np.asarray(logits, np.float64)
    out = np.zeros_like(logits)
    if temperature == 0:
        out[int(np.argmax(logits))] = 1.0
        return out
    scaled = logits / temperature
    order = list(np.argsort(-scaled, kind="stable"))
    if top_k:
        order = order[:top_k]
    weights = np.exp(scaled[order] - scaled[order].max())
    weights /= weights.sum()
    kept, mass = [], 0.0
    for token, w in zip(order, weights):
        if top_p < 1 and mass >= top_p:
            break
        kept.append(token)
        mass += w
    kept_weights = np.exp(scaled[kept] - scaled[kept].max())
    out[kept] = kept_weights / kept_weights.sum()
    return out

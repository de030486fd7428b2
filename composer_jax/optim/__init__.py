"""Optimizers: sharded, batched Muon (with AdamW for non-matrix parameters) and QK-clip."""

from composer_jax.optim.muon import MuonState, muon
from composer_jax.optim.param_labels import MuonPlan, dimension_numbers
from composer_jax.optim.qk_clip import clip_mla, clip_model

__all__ = ["MuonPlan", "MuonState", "clip_mla", "clip_model", "dimension_numbers", "muon"]

"""Optimizers: sharded, batched Muon (with AdamW for non-matrix parameters) and QK-clip."""

from composer_jax.optim.muon import MuonPlan, MuonState, dimension_numbers, muon, scale_by_muon

__all__ = ["MuonPlan", "MuonState", "dimension_numbers", "muon", "scale_by_muon"]

"""Logits parity with transformers' DeepseekV3ForCausalLM (float32, random tiny weights)."""

import numpy as np
import pytest

from composer_jax import from_pretrained, load_config
from tests.hf_reference import hf_logits, save_random_hf_model

VARIANTS = {"group_limited": [], "kimi_single_group": ["moe.n_group=1", "moe.topk_group=1"]}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dispatch", ["ragged", "dense"])
def test_logits_match_transformers(tmp_path, variant, dispatch):
    cfg = load_config("tiny", VARIANTS[variant] + ["mtp.num_layers=0"])
    hf_model = save_random_hf_model(cfg, tmp_path)
    model = from_pretrained(tmp_path, [f"moe.dispatch={dispatch}"])
    assert model.cfg.moe.n_group == cfg.moe.n_group and model.cfg.rope == cfg.rope
    # Longer than original_max_position_embeddings (16), so the YaRN ramp and mscale matter.
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(3, 48), dtype=np.int32)
    ours = np.asarray(model(tokens))
    ref = hf_logits(hf_model, tokens)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (3, 48, cfg.vocab_size)
    diff = np.abs(ours - ref).max()
    print(f"max |logit diff| = {diff:.2e}, logit scale {np.abs(ref).max():.2f}")
    assert diff <= 1e-4, f"max |logit diff| = {diff:.2e}"

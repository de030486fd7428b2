"""Config loading: YAML + overrides, typed, validated, errors naming the key."""

import pytest

from composer_jax.config import ConfigError, load_config, replace


def test_bundled_configs_are_faithful():
    k25 = load_config("kimi-k2.5")
    assert (k25.rms_norm_eps, k25.mla.latent_norm_eps) == (1e-5, 1e-6)
    assert (k25.rope.factor, k25.rope.theta, k25.rope.beta_fast, k25.rope.beta_slow) == (64.0, 50000.0, 32.0, 1.0)
    assert (k25.moe.n_routed_experts, k25.moe.num_experts_per_tok, k25.moe.n_group) == (384, 8, 1)
    assert k25.moe.routed_scaling_factor == 2.827 and k25.num_dense_layers == 1 and k25.mtp.num_layers == 0
    ds = load_config("deepseek-v3")
    assert (ds.moe.n_group, ds.moe.topk_group, ds.num_dense_layers, ds.mtp.num_layers) == (8, 4, 3, 1)
    tiny = load_config("tiny")
    assert tiny.moe.n_group == 4 and tiny.moe.topk_group == 2 and tiny.mtp.num_layers == 1
    small = load_config("small")        # the coding study's: tiny's structure, the BPE tokenizer's vocabulary
    assert (small.vocab_size, small.moe.n_group, small.num_dense_layers, small.mtp.num_layers) == (4096, 4, 1, 1)


def test_overrides_are_typed():
    cfg = load_config("tiny", ["moe.dispatch=dense", "rms_norm_eps=1e-6", "mla.num_heads=2", "rope.factor=8"])
    assert cfg.moe.dispatch == "dense" and cfg.rms_norm_eps == 1e-6 and cfg.mla.num_heads == 2
    assert isinstance(cfg.rope.factor, float)
    assert replace(cfg, **{"moe.topk_group": 1}).moe.topk_group == 1


@pytest.mark.parametrize("override, key, message", [
    (["moe.num_expert_per_tok=2"], "moe.num_expert_per_tok", "did you mean 'num_experts_per_tok'"),
    (["mla.num_head=2"], "mla.num_head", "did you mean 'num_heads'"),
    (["hiden_size=2"], "hiden_size", "did you mean 'hidden_size'"),
    (["moe.num_experts_per_tok=17"], "moe.num_experts_per_tok", r"must be in \[1, n_routed_experts=16\]"),
    (["moe.n_group=3"], "moe.n_group", "must divide n_routed_experts=16"),
    (["moe.topk_group=5"], "moe.topk_group", r"must be in \[1, n_group=4\]"),
    (["moe.topk_group=1", "moe.num_experts_per_tok=5"], "moe.num_experts_per_tok", "kept groups hold only 4"),
    (["mla.num_heads=two"], "mla.num_heads", "expected an int, got 'two'"),
    (["rms_norm_eps=tiny"], "rms_norm_eps", "expected a float"),
    (["moe.norm_topk_prob=3"], "moe.norm_topk_prob", "expected a bool"),
    (["dtype=float16"], "dtype", "expected one of 'float32', 'bfloat16'"),
    (["mla.qk_rope_head_dim=7"], "mla.qk_rope_head_dim", "positive even number"),
    (["num_dense_layers=5"], "num_dense_layers", r"must be in \[0, num_layers=4\]"),
    (["rope.max_position_embeddings=8"], "rope.max_position_embeddings", "must be >= original_max"),
    (["mla=3"], "mla", "expected a mapping for MLAConfig"),
    (["hidden_size.x=3"], "hidden_size", "not a section"),
])
def test_bad_values_name_the_key(override, key, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config("tiny", override)
    assert err.value.key == key
    assert f"'{key}'" in str(err.value) and f"(command-line override {key}" in str(err.value)
    assert "tiny.yaml" not in str(err.value)  # the override is at fault, not the file


def test_errors_blame_the_file_or_the_command_line(tmp_path):
    """A bad value is attributed to where it was written: the YAML file, or the command-line override."""
    import yaml

    from composer_jax.config import CONFIG_DIR

    data = yaml.safe_load((CONFIG_DIR / "model" / "tiny.yaml").read_text())
    data["mla"]["num_heads"] = "two"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        load_config(path, ["rope.factor=2"])
    assert str(err.value) == f"config key 'mla.num_heads': expected an int, got 'two' (in {path})"
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["mla.num_heads=three"])
    assert str(err.value) == ("config key 'mla.num_heads': expected an int, got 'three' "
                              "(command-line override mla.num_heads=three)")


def test_malformed_and_incomplete_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("vocab_size: [1, 2\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        load_config(bad)
    incomplete = tmp_path / "incomplete.yaml"
    incomplete.write_text("vocab_size: 10\n")
    with pytest.raises(ConfigError, match="required key is missing") as err:
        load_config(incomplete)
    assert err.value.key == "hidden_size"
    with pytest.raises(ConfigError, match="not of the form"):
        load_config("tiny", ["moe.dispatch"])
    with pytest.raises(FileNotFoundError, match=r"is neither a file nor a bundled model config \(bundled: "
                                                r"deepseek-v3, kimi-k2.5, proxy-moe, small, tiny\)$"):
        load_config("tiny2")

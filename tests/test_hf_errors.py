"""from_pretrained on broken Hugging Face directories: clear errors naming the culprit."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from composer_jax import config, from_pretrained, load_config
from composer_jax.checkpoint.safetensors_io import CheckpointError
from tests.hf_reference import save_random_hf_model

MISSING = "model.layers.2.mlp.experts.3.up_proj.weight"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    save_random_hf_model(config.replace(load_config("tiny"), **{"mtp.num_layers": 0}), path)
    return path


def _edit(hf_dir, tmp_path, edit_tensors=None, edit_config=None):
    tensors = load_file(str(hf_dir / "model.safetensors"))
    cfg = json.loads((hf_dir / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(cfg)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_missing_tensor_is_named(hf_dir, tmp_path):
    path = _edit(hf_dir, tmp_path, edit_tensors=lambda t: t.pop(MISSING))
    with pytest.raises(CheckpointError, match=f"1 tensor\\(s\\) missing .*'{MISSING}'"):
        from_pretrained(path)


def test_wrong_shape_is_named(hf_dir, tmp_path):
    key = "model.layers.1.self_attn.kv_b_proj.weight"

    def shrink(t):
        t[key] = t[key][:-8].contiguous()

    with pytest.raises(CheckpointError, match=f"'{key}' has shape \\[152, 32\\], expected \\[160, 32\\]"):
        from_pretrained(_edit(hf_dir, tmp_path, edit_tensors=shrink))


def test_config_mismatch_and_unsupported_config(hf_dir, tmp_path):
    def more_experts(c):
        c["n_routed_experts"] = 32

    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.gate\.\S+' has shape \[16\S*\], expected \[32"):
        from_pretrained(_edit(hf_dir, tmp_path, edit_config=more_experts))

    def softmax_routing(c):
        c["scoring_func"] = "softmax"

    with pytest.raises(CheckpointError, match="scoring_func='softmax' is not supported"):
        from_pretrained(_edit(hf_dir, tmp_path, edit_config=softmax_routing))

    def bad_value(c):
        c["num_experts_per_tok"] = 99

    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        from_pretrained(_edit(hf_dir, tmp_path, edit_config=bad_value))


def test_truncated_and_missing_files(hf_dir, tmp_path):
    data = (hf_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match="truncated"):
        from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!!!!!")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="nowhere does not exist"):
        from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty: no config.json"):
        from_pretrained(tmp_path / "empty")


def test_kimi_k25_layout_loads(hf_dir, tmp_path):
    """K2.5 nests the text model under `text_config` and prefixes its tensors with `language_model.`."""
    tensors = {f"language_model.{k}": v for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    tensors["vision_tower.patch_embed.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    text = json.loads((hf_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": text,
                                                      "vision_config": {}}))
    plain, nested = from_pretrained(hf_dir), from_pretrained(tmp_path)
    tokens = torch.randint(0, 256, (1, 20)).numpy().astype("int32")
    assert abs(plain(tokens) - nested(tokens)).max() == 0

"""convert / export: bit-exact round trips, transformers loading, sharded output, resume, atomicity,
and clear errors for broken inputs (nothing half-written left behind)."""

import copy
import json

import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import DeepseekV3ForCausalLM

from composer_jax import CausalLM, config, load_config
from composer_jax.checkpoint import convert as convert_mod
from composer_jax.checkpoint.convert import convert
from composer_jax.checkpoint.export import export
from composer_jax.checkpoint.hf_config import config_from_hf
from composer_jax.checkpoint.orbax_io import OrbaxTree
from composer_jax.checkpoint.safetensors_io import CheckpointError
from composer_jax.cli import main
from composer_jax.model import abstract_params
from composer_jax.model_dirs import load_converted
from tests.hf_reference import save_random_hf_model


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A float32 tiny DeepSeek-V3 saved by transformers, and the model itself."""
    path = tmp_path_factory.mktemp("hf")
    model = save_random_hf_model(config.replace(load_config("tiny"), **{"mtp.num_layers": 0}), path)
    return path, model


def _tensors(directory) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _assert_same_tensors(original: dict, exported: dict) -> None:
    assert set(exported) == set(original)
    for key, value in original.items():
        if key.endswith("e_score_correction_bias"):  # always exported in float32: compare values
            assert np.array_equal(exported[key].astype(np.float32), value.astype(np.float32)), key
        else:
            assert exported[key].dtype == value.dtype and exported[key].tobytes() == value.tobytes(), key


def _leaves(directory) -> dict:
    tree = OrbaxTree(directory / "params")
    return {p: tree.open(p).read().result() for p in tree.paths()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_is_bit_exact_and_loads_in_transformers(tmp_path, tiny_hf, dtype):
    src, model = tiny_hf
    if dtype != "float32":
        model = copy.deepcopy(model).to(getattr(torch, dtype))
        src = tmp_path / "src"
        model.save_pretrained(src)
    assert main(["convert", str(src), str(tmp_path / "orbax"), "--quiet"]) == 0
    # float16 weights become float32 parameters (exactly); export casts them back.
    export_dtype = ["--dtype", "float16"] if dtype == "float16" else []
    assert main(["export", str(tmp_path / "orbax"), str(tmp_path / "out"), "--quiet", "--max-shard-gb", "0.0005",
                 *export_dtype]) == 0
    out = tmp_path / "out"
    _assert_same_tensors(_tensors(src), _tensors(out))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(list(out.glob("*.safetensors"))) > 1
    assert config_from_hf(json.loads((out / "config.json").read_text())) == \
        config_from_hf(json.loads((src / "config.json").read_text()))
    assert (out / "generation_config.json").is_file()  # small source files travel along

    reloaded = DeepseekV3ForCausalLM.from_pretrained(out).eval()
    original = DeepseekV3ForCausalLM.from_pretrained(src).eval()
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, original(tokens).logits)


def test_mtp_layers_round_trip(tmp_path):
    from tests.test_mtp import _build

    src = tmp_path / "src"
    src.mkdir()
    _build(src)  # DeepSeek-V3 layout: the MTP layer is model.layers.4.*, with embedding / head copies
    convert(src, tmp_path / "orbax", params_of=abstract_params)
    assert load_converted(tmp_path / "orbax").cfg.mtp.num_layers == 1
    export(tmp_path / "orbax", tmp_path / "out", params_of=abstract_params)
    _assert_same_tensors(_tensors(src), _tensors(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_export_without_mtp_loads_in_transformers_without_unexpected_tensors(tmp_path):
    """transformers' DeepseekV3ForCausalLM has no MTP module: an export with MTP loads with its tensors
    reported UNEXPECTED; `--no-mtp` leaves them out and keeps every other tensor as it was."""
    from tests.test_mtp import _build

    src = tmp_path / "src"
    src.mkdir()
    cfg, _, _ = _build(src)
    convert(src, tmp_path / "orbax", params_of=abstract_params)
    export(tmp_path / "orbax", tmp_path / "with", params_of=abstract_params)
    assert main(["export", str(tmp_path / "orbax"), str(tmp_path / "without"), "--quiet", "--no-mtp"]) == 0
    _, with_info = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "with", output_loading_info=True)
    assert with_info["unexpected_keys"] and all(k.startswith(f"model.layers.{cfg.num_layers}.")
                                                for k in with_info["unexpected_keys"])
    _, without_info = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "without", output_loading_info=True)
    assert not without_info["unexpected_keys"] and not without_info["missing_keys"]
    kept = {k: v for k, v in _tensors(tmp_path / "with").items() if not k.startswith(f"model.layers.{cfg.num_layers}.")}
    _assert_same_tensors(kept, _tensors(tmp_path / "without"))
    assert json.loads((tmp_path / "without" / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_sharded_conversion_restores_without_target(tmp_path, tiny_hf):
    from composer_jax.config import MeshConfig
    from composer_jax.parallel import DualMesh, param_shardings

    src, _ = tiny_hf
    model_cfg = config.replace(load_config("tiny"), **{"mtp.num_layers": 0})
    state = nnx.state(nnx.eval_shape(lambda: CausalLM(model_cfg, rngs=nnx.Rngs(0))))
    dual = DualMesh(MeshConfig(replica=2, fsdp=4, ep=8))
    shardings = param_shardings(state, dual)
    convert(src, tmp_path / "sharded", shardings=shardings, compress=True, chunk_bytes=4096, params_of=abstract_params)
    convert(src, tmp_path / "plain", params_of=abstract_params)
    plain = _leaves(tmp_path / "plain")

    restored = ocp.StandardCheckpointer().restore((tmp_path / "sharded" / "params").absolute())  # no target
    want = nnx.to_pure_dict(shardings)
    for path, value in plain.items():
        leaf, sharding = restored, want
        for k in path:
            leaf, sharding = leaf[k], sharding[k]
        assert leaf.sharding.spec == sharding.spec and leaf.sharding.mesh.shape == sharding.mesh.shape, path
        np.testing.assert_array_equal(np.asarray(leaf), value)
        zarray = json.loads((tmp_path / "sharded" / "params" / ".".join(path) / ".zarray").read_text())
        shard = sharding.shard_shape(value.shape)
        assert all(s % c == 0 for s, c in zip(shard, zarray["chunks"])), (path, shard, zarray["chunks"])

    # The CLI chunks for the same layout from mesh sizes alone (no devices needed).
    assert main(["convert", str(src), str(tmp_path / "cli"), "--quiet", "--chunk-mb", "1", "--devices", "8",
                 "--mesh", "replica=2,fsdp=4,ep=8"]) == 0
    convert(src, tmp_path / "api", shardings=shardings, chunk_bytes=1 << 20, params_of=abstract_params)
    for path in plain:
        chunks = [json.loads((tmp_path / d / "params" / ".".join(path) / ".zarray").read_text())["chunks"]
                  for d in ("cli", "api")]
        assert chunks[0] == chunks[1], path

    other = DualMesh(MeshConfig(replica=1, fsdp=8, ereplica=2, ep=4))  # restore onto a different layout
    model = load_converted(tmp_path / "sharded", shardings=lambda s: param_shardings(s, other))
    kernel = model.moe_layers.mlp.gate_proj[...]
    assert kernel.sharding.mesh.shape["ep"] == 4
    np.testing.assert_array_equal(np.asarray(kernel), plain[("moe_layers", "mlp", "gate_proj")])


def test_interrupted_conversion_resumes(tmp_path, tiny_hf, monkeypatch):
    src, _ = tiny_hf
    dst, partial = tmp_path / "out", tmp_path / "out.partial"
    real, done = convert_mod._write_block, []

    def interrupted(*args):
        if len(done) >= 50:
            raise KeyboardInterrupt  # as if Ctrl-C hit mid-conversion
        done.append(1)
        real(*args)

    monkeypatch.setattr(convert_mod, "_write_block", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(src, dst, workers=2, params_of=abstract_params)
    assert not dst.exists() and partial.is_dir()
    with pytest.raises(CheckpointError, match="no _METADATA"):  # the partial tree does not pass as a checkpoint
        OrbaxTree(partial / "params")
    with pytest.raises(CheckpointError, match="partial output of a different job"):
        convert(src, dst, ["param_dtype=bfloat16"], params_of=abstract_params)

    resumed = []
    monkeypatch.setattr(convert_mod, "_write_block", lambda *a: (resumed.append(1), real(*a)))
    summary = convert(src, dst, params_of=abstract_params)
    assert len(resumed) == summary["items"] - 50 and not partial.exists()
    monkeypatch.setattr(convert_mod, "_write_block", real)
    convert(src, tmp_path / "clean", params_of=abstract_params)
    clean, got = _leaves(tmp_path / "clean"), _leaves(dst)
    assert set(clean) == set(got) and all(np.array_equal(clean[p], got[p]) for p in clean)


EXTRA = "model.layers.1.mlp.unknown.weight"
MISSING = "model.layers.2.mlp.experts.3.up_proj.weight"
BROKEN = {
    "missing": (lambda t, c: t.pop(MISSING), rf"1 tensor\(s\) missing from the checkpoint: '{MISSING}'"),
    "extra": (lambda t, c: t.update({EXTRA: np.zeros(3, np.float32)}),
              rf"1 unexpected tensor\(s\) the model does not use: '{EXTRA}'"),
    "shape": (lambda t, c: t.update({"model.norm.weight": np.ones(65, np.float32)}),
              r"'model\.norm\.weight' has shape \[65\], expected \[64\]"),
    "config_layers": (lambda t, c: c.update(num_hidden_layers=5),
                      r"tensor\(s\) missing from the checkpoint: 'model\.layers\.4\."),
    "config_experts": (lambda t, c: c.update(n_routed_experts=32),
                       r"'model\.layers\.1\.mlp\.gate\.\S+' has shape \[16\S*\], expected \[32"),
}


@pytest.mark.parametrize("case", list(BROKEN) + ["truncated", "corrupt"])
def test_broken_inputs_are_clear_errors_and_leave_nothing(tmp_path, tiny_hf, capsys, case):
    src, _ = tiny_hf
    bad = tmp_path / "bad"
    bad.mkdir()
    tensors, cfg = load_file(str(src / "model.safetensors")), json.loads((src / "config.json").read_text())
    match = {"truncated": "truncated", "corrupt": "corrupt safetensors header"}.get(case)
    if case in BROKEN:
        BROKEN[case][0](tensors, cfg)
        match = BROKEN[case][1]
    save_file(tensors, str(bad / "model.safetensors"))
    (bad / "config.json").write_text(json.dumps(cfg))
    data = (bad / "model.safetensors").read_bytes()
    if case == "truncated":
        (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif case == "corrupt":
        (bad / "model.safetensors").write_bytes(data[:8] + b"{not json" + data[17:])
    dst = tmp_path / "out"
    assert main(["convert", str(bad), str(dst), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("composer-jax convert: error: ") and "\n" not in err
    assert __import__("re").search(match, err), err
    assert not dst.exists() and not (tmp_path / "out.partial").exists()
    if case == "extra":  # allowed on request
        assert main(["convert", str(bad), str(dst), "--quiet", "--allow-extra"]) == 0


def test_export_errors(tmp_path, tiny_hf, capsys):
    src, _ = tiny_hf
    convert(src, tmp_path / "orbax", params_of=abstract_params)
    assert main(["convert", str(src), str(tmp_path / "orbax"), "--quiet"]) == 2
    assert "already exists (pass --overwrite" in capsys.readouterr().err
    assert main(["convert", str(src), str(tmp_path / "orbax"), "--quiet", "--overwrite"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["orbax"]  # replaced; no old or partial copy left
    assert main(["export", str(src), str(tmp_path / "x"), "--quiet"]) == 2
    assert "is an orbax checkpoint (no _METADATA)" in capsys.readouterr().err
    chunk = next((tmp_path / "orbax" / "params" / "moe_layers.attn.o_proj").glob("1.*"))
    chunk.unlink()  # a damaged checkpoint: the error names the parameter, and no output appears
    with pytest.raises(CheckpointError, match=r"cannot read parameter 'moe_layers\.attn\.o_proj' \[1\]"):
        export(tmp_path / "orbax", tmp_path / "out", params_of=abstract_params)
    assert not (tmp_path / "out").exists()


def test_interrupted_export_resumes(tmp_path, tiny_hf, monkeypatch):
    from composer_jax.checkpoint import export as export_mod

    src, _ = tiny_hf
    convert(src, tmp_path / "orbax", params_of=abstract_params)
    real, done = export_mod._write_rows, []

    def interrupted(*args):
        if len(done) >= 40:
            raise OSError("disk full")
        done.append(1)
        real(*args)

    monkeypatch.setattr(export_mod, "_write_rows", interrupted)
    with pytest.raises(OSError, match="disk full"):
        export(tmp_path / "orbax", tmp_path / "out", max_shard_bytes=300_000, params_of=abstract_params)
    assert not (tmp_path / "out").exists() and (tmp_path / "out.partial").is_dir()
    resumed = []
    monkeypatch.setattr(export_mod, "_write_rows", lambda *a: (resumed.append(1), real(*a)))
    summary = export(tmp_path / "orbax", tmp_path / "out", max_shard_bytes=300_000, params_of=abstract_params)
    assert len(resumed) == summary["items"] - 40 and summary["shards"] > 1
    _assert_same_tensors(_tensors(src), _tensors(tmp_path / "out"))


def test_export_from_training_checkpoint(tmp_path, tiny_hf):
    """A training step (`model` item: {'params', 'biases'} nnx States; `config` item: the run config)."""
    from composer_jax.checkpoint.manager import TrainCheckpointer
    from composer_jax.model.layers import RouterBias

    src, _ = tiny_hf
    convert(src, tmp_path / "orbax", params_of=abstract_params)
    model = load_converted(tmp_path / "orbax")
    _, params, biases, _ = nnx.split(model, nnx.Param, RouterBias, ...)
    ckpt = TrainCheckpointer(tmp_path / "run", array_items=("model",), json_items=("config",), async_save=False)
    ckpt.save(3, {"model": {"params": params, "biases": biases}}, {"config": {"model": config.to_dict(model.cfg)}},
              force=True)
    ckpt.close()
    assert main(["export", str(tmp_path / "run" / "3"), str(tmp_path / "out"), "--quiet"]) == 0
    _assert_same_tensors(_tensors(src), _tensors(tmp_path / "out"))

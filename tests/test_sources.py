"""Model sources (composer_jax.model_dirs, composer_jax.source_weights): any phase starts from a Hugging Face,
converted or run directory, takes its architecture, tokenizer and chat format, and streams its weights into
their shards; bad sources are one-line errors that name the culprit and write nothing."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import yaml

from composer_jax import config, from_pretrained, load_config
from composer_jax.cli import main
from composer_jax.config import CONFIG_DIR, ConfigError, MeshConfig
from composer_jax.model_dirs import open_source
from composer_jax.parallel import DualMesh
from composer_jax.train.config import load_run_config
from composer_jax.train.loop import Trainer
from tests.hf_reference import save_random_hf_model
from tests.hub_cache import COMMIT, cache_model

TINY_BPE = CONFIG_DIR / "tokenizers" / "tiny-bpe"
FAST = ["train.steps=1", "train.batch_size=8", "train.seq_len=64", "train.eval_every=1000", "train.log_every=1",
        "data.eval_fraction=0", "train.progress=false", "optimizer.warmup_steps=0"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny DeepSeek-V3 saved by transformers (float32, no MTP, a 4096-id vocabulary) with the shipped BPE
    tokenizer beside it, and the transformers model."""
    path = tmp_path_factory.mktemp("hf")
    cfg = config.replace(load_config("tiny"), **{"mtp.num_layers": 0, "vocab_size": 4096})
    model = save_random_hf_model(cfg, path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TINY_BPE / name, path / name)
    return path, model


@pytest.fixture(scope="module")
def hub_cache(hf_dir, tmp_path_factory):
    """(a Hugging Face cache holding hf_dir's files as the model org/name, its snapshot directory)."""
    cache = tmp_path_factory.mktemp("hub")
    return cache, cache_model(cache, "org/name", hf_dir[0])


@pytest.fixture
def hub(hub_cache, monkeypatch):
    """hub_cache as huggingface_hub's cache in this process (HF_HUB_CACHE is read when it is imported) and
    in the CLI runs it starts; offline, as every test is (conftest.py)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache[0]))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache[0]))
    assert constants.HF_HUB_OFFLINE
    return hub_cache


def _run_yaml(tmp_path, source, **sections) -> str:
    """A run config that names no model: the architecture is the source's."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"train": {"init_from": str(source), "seq_len": 64},
                                    "run_dir": str(tmp_path / "run"), **sections}))
    return str(path)


@pytest.mark.slow
def test_pretraining_from_a_transformers_checkpoint_starts_at_its_loss(hf_dir, hub, tmp_path):
    """The first step's loss equals transformers' cross-entropy on the same batch (float32, 1e-5); named by
    its Hugging Face id (org/name, from the cache) the model starts at the same loss."""
    path, hf = hf_dir
    cfg = load_run_config(_run_yaml(tmp_path, path), FAST)
    assert cfg.model.vocab_size == 4096 and cfg.model.mtp.num_layers == 0 and cfg.data.tokenizer == ""
    trainer = Trainer(cfg)
    batch = trainer.batches.next()
    with trainer.dual:
        _, metrics = trainer.step_fn(trainer.state, batch)
    tokens, segments, mask = (np.asarray(batch[k])[0] for k in ("tokens", "segment_ids", "loss_mask"))
    total, count = 0.0, 0
    for row in range(tokens.shape[0]):
        for s in np.unique(segments[row][segments[row] > 0]):   # each packed document on its own
            ids, targets = tokens[row][segments[row] == s], mask[row][segments[row] == s]
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.as_tensor(ids[None])).logits[0].double(), -1).numpy()
            picked = targets[1:].astype(bool)
            total -= logp[np.arange(len(ids) - 1)[picked], ids[1:][picked]].sum()
            count += int(picked.sum())
    assert float(metrics["loss"]) == pytest.approx(total / count, rel=1e-5)
    assert trainer.batches.tokenizer.name == str(path / "tokenizer.json")   # the source's tokenizer
    trainer.checkpoints.close()

    (tmp_path / "id").mkdir()
    by_id = load_run_config(_run_yaml(tmp_path / "id", "org/name"), FAST)
    assert by_id.train.init_from == "org/name" and by_id.model == cfg.model    # recorded as written
    twin = Trainer(by_id)
    assert twin.source.path == hub[1] and twin.batches.tokenizer.name == str(hub[1] / "tokenizer.json")
    twin_batch = twin.batches.next()
    jax.tree.map(np.testing.assert_array_equal, twin_batch, batch)
    with twin.dual:   # the step compiled above (the same layout), on the state loaded from the cache
        _, twin_metrics = trainer.step_fn(twin.state, twin_batch)
    assert float(twin_metrics["loss"]) == float(metrics["loss"])
    twin.checkpoints.close()


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 0])   # 0: every stacked leaf one layer at a time
def test_streamed_weights_on_the_dual_grid_equal_from_pretrained(hf_dir, chunk_bytes):
    """Each leaf read in its devices' slices onto fsdp=4 x cp=2 / ep=8 equals transformers-checked
    `from_pretrained` bit for bit; an MTP depth the source lacks is initialised as `from_pretrained` does
    (the same initialisers and seed, jitted onto its shards: equal to float32 rounding)."""
    from flax import nnx

    from composer_jax.checkpoint.manager import abstract_like
    from composer_jax.model import CausalLM
    from composer_jax.parallel import param_shardings
    from composer_jax.source_weights import load_state
    from composer_jax.train.state import split_model

    path, _ = hf_dir
    source = open_source(path)
    cfg = config.replace(source.model, **{"mtp.num_layers": 1})
    dual = DualMesh(MeshConfig(fsdp=4, cp=2, ep=8), jax.devices(), model=cfg)
    _, params, biases, _ = split_model(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))
    params, biases = (abstract_like(t, param_shardings(t, dual)) for t in (params, biases))
    loaded = load_state(source, cfg, params, biases, seed=0, chunk_bytes=chunk_bytes)
    reference = split_model(from_pretrained(path, ["mtp.num_layers=1"]))[1:3]
    flat = jax.tree_util.tree_flatten_with_path(loaded)[0]
    for (where, ours), theirs, abstract in zip(flat, jax.tree.leaves(reference),
                                               jax.tree.leaves(params) + jax.tree.leaves(biases)):
        assert ours.sharding == abstract.sharding and ours.dtype == abstract.dtype
        if "mtp" in jax.tree_util.keystr(where):
            np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6, atol=1e-8)
        else:
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert len(jax.tree.leaves(loaded)) == len(jax.tree.leaves(reference))


def test_config_takes_the_sources_architecture_and_refuses_to_change_it(hf_dir, tmp_path, capsys):
    path, _ = hf_dir
    run = _run_yaml(tmp_path, path)
    # runtime keys change: dispatch, attention, capacity, RoPE scaling, MTP depths the source lacks
    cfg = load_run_config(run, ["model.moe.dispatch=dense", "model.rope.factor=8", "model.rope.max_position_embeddings=256",
                                "model.mtp.num_layers=1", "model.attention=blockwise"])
    assert (cfg.model.hidden_size, cfg.model.moe.dispatch, cfg.model.rope.factor, cfg.model.mtp.num_layers) == \
        (64, "dense", 8.0, 1)
    assert main(["config", "show", run]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["model"]["vocab_size"] == 4096 and shown["model"]["mla"]["kv_lora_rank"] == 32
    assert main(["config", "show", run, "model.hidden_size=128"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"composer-jax config: error: config key 'model.hidden_size': is 128, but the source {path} has 64: a run "
        "keeps its source's architecture (it may change only moe.dispatch, moe.capacity_factor, moe.bias_update_rate, "
        "moe.expert_quant, attention, layer_loop, dtype, param_dtype, mtp.num_layers, mtp.loss_weight and rope.*) (command-line override "
        "model.hidden_size=128)")


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "missing", "{src} does not exist"),
    (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty",
     "{src} is not a model: it has no config.json (a Hugging Face directory), model_config.yaml (a converted "
     "directory) or checkpoints/ (a run directory)"),
    (lambda tmp: (tmp / "r" / "checkpoints").mkdir(parents=True) or tmp / "r",
     "{src}: no complete checkpoint in {src}/checkpoints: train that run first"),
])
def test_a_source_that_is_not_a_model_is_one_line_and_writes_nothing(tmp_path, make, message):
    src = make(tmp_path)
    result = subprocess.run([sys.executable, "-m", "composer_jax.cli", "pretrain", "pretrain-tiny",
                             f"train.init_from={src}", f"run_dir={tmp_path / 'out'}"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"composer-jax pretrain: error: config key 'train.init_from': {message.format(src=src)} (command-line "
        f"override train.init_from={src})"]
    assert not (tmp_path / "out").exists()


def test_hub_ids_and_the_files_fetched_follow_huggingface_hub():
    """`is_hub_id` agrees with huggingface_hub's own check of ORG/NAME ids; the files fetched for a model
    source (chosen by huggingface_hub's own pattern filter) are those model_dirs reads: no weights but a
    lone model.safetensors for its config, every safetensors file for its weights."""
    from huggingface_hub.utils import HFValidationError, filter_repo_objects, validate_repo_id

    from composer_jax.checkpoint.hub import CONFIG_PATTERNS, WEIGHT_PATTERNS, is_hub_id
    from composer_jax.checkpoint.safetensors_io import INDEX_FILE
    from composer_jax.model_dirs import CHAT_FILE, TOKENIZER_FILES, TOKENIZER_SIDE_FILES

    def valid(spec: str) -> bool:
        try:
            validate_repo_id(spec)
        except HFValidationError:
            return False
        return spec.count("/") == 1
    specs = ["moonshotai/Kimi-K2.5", "deepseek-ai/DeepSeek-V3", "runs/sft-tiny", "_a/c.d", "x" * 96 + "/y",
             "gpt2", "/models/k25", "./org/name", "~/org/name", "a/b/c", "org--x/name", "org/na..me", "org/name.git",
             "org/na me", ".org/name", "org-/name", "org/", "x" * 97 + "/y"]
    assert [is_hub_id(s) for s in specs] == [valid(s) for s in specs] == [True] * 5 + [False] * 13
    read = ["config.json", "generation_config.json", INDEX_FILE, CHAT_FILE, *TOKENIZER_FILES, *TOKENIZER_SIDE_FILES,
            "tokenization_kimi.py", "model.safetensors"]
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    files = read + shards + ["pytorch_model.bin", "README.md", "figures/demo.png", "modeling_deepseek.py"]
    assert list(filter_repo_objects(files, allow_patterns=list(CONFIG_PATTERNS))) == read
    assert list(filter_repo_objects(files, allow_patterns=list(CONFIG_PATTERNS + WEIGHT_PATTERNS))) == read + shards


def test_a_model_id_opens_and_converts_from_the_hugging_face_cache(hf_dir, hub, tmp_path):
    """The test cache is huggingface_hub's own layout (it finds the files and scans one clean revision);
    `org/name` opens as its snapshot, `from_pretrained` and `convert` read it as they read the directory."""
    import huggingface_hub
    from flax import nnx

    from composer_jax.model_dirs import load_converted

    path, _ = hf_dir
    cache, snapshot = hub
    assert huggingface_hub.try_to_load_from_cache("org/name", "config.json") == str(snapshot / "config.json")
    scan = huggingface_hub.scan_cache_dir()
    assert scan.warnings == [] and [(r.repo_id, r.nb_files, [v.commit_hash for v in r.revisions], set(r.refs))
                                    for r in scan.repos] == [("org/name", 5, [COMMIT], {"main"})]
    source = open_source("org/name")
    assert (source.path, source.kind, source.model) == (snapshot, "hf", open_source(path).model)
    reference = jax.tree.leaves(nnx.state(from_pretrained(path), nnx.Param))
    for ours, theirs in zip(jax.tree.leaves(nnx.state(from_pretrained("org/name"), nnx.Param)), reference, strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert main(["convert", "org/name", str(tmp_path / "out"), "--quiet"]) == 0
    for ours, theirs in zip(jax.tree.leaves(nnx.state(load_converted(tmp_path / "out"), nnx.Param)), reference,
                            strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    copied = tmp_path / "out" / "hf_files" / "tokenizer.json"
    assert copied.is_file() and not copied.is_symlink()   # the file, not a link into the cache


def test_a_local_path_wins_over_a_model_id_of_the_same_spelling(hf_dir, hub, tmp_path, monkeypatch):
    """`org/name` is the cached model until a directory of that spelling exists; run configs (pretraining's
    train.init_from, RL's init_from) record the id as written, a path made absolute."""
    from composer_jax.model_dirs import source_spec
    from composer_jax.rl.run_config import load_rl_config

    def recorded() -> tuple[str, str]:
        rl = load_rl_config("rl-tiny", ["init_from=org/name", f"run_dir={tmp_path / 'rl'}", "rollout.max_len=64",
                                        "rollout.feedback_window=64"])
        return load_run_config(_run_yaml(tmp_path, "org/name")).train.init_from, rl.init_from

    monkeypatch.chdir(tmp_path)
    assert source_spec("org/name") == "org/name" and open_source("org/name").path == hub[1]
    assert recorded() == ("org/name", "org/name")
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").symlink_to(hf_dir[0])
    assert source_spec("org/name") == str(tmp_path / "org" / "name")
    assert open_source("org/name").path == tmp_path / "org" / "name"
    assert recorded() == (str(tmp_path / "org" / "name"),) * 2
    assert source_spec("") == ""


def test_a_model_ids_weights_are_fetched_only_to_be_read(hf_dir, tmp_path, monkeypatch):
    """A cached snapshot with configs and index but no weights (what loading a run config or `plan` fetches)
    opens for its architecture; opened for its weights it is incomplete (offline: an error naming the id
    and the cache) until the weight file the index names is there."""
    from huggingface_hub import constants
    from safetensors import safe_open

    from composer_jax.checkpoint.safetensors_io import CheckpointError

    monkeypatch.chdir(tmp_path)
    path, cache, shard = hf_dir[0], tmp_path / "hub", "model-00001-of-00001.safetensors"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    src = tmp_path / "src"
    src.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(path / name, src / name)
    with safe_open(path / "model.safetensors", "np") as f:
        index = {"weight_map": {key: shard for key in f.keys()}}  # noqa: SIM118 - safe_open is no mapping
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    snapshot = cache_model(cache, "org/sharded", src)
    source = open_source("org/sharded", need_weights=False)
    assert source.path == snapshot and source.model == open_source(path).model
    assert load_run_config(_run_yaml(tmp_path, "org/sharded")).train.init_from == "org/sharded"
    with pytest.raises(CheckpointError) as error:
        open_source("org/sharded")
    assert str(error.value) == (f"{tmp_path / 'org' / 'sharded'} does not exist, and the Hugging Face model "
                                f"org/sharded has no complete copy in the cache {cache} (offline: HF_HUB_OFFLINE=1)")
    shutil.copyfile(path / "model.safetensors", src / shard)
    cache_model(cache, "org/sharded", src, names=[shard])
    assert open_source("org/sharded").weights == snapshot


def test_a_model_id_missing_from_the_cache_is_downloaded_when_online(hf_dir, tmp_path, monkeypatch):
    """Online, the cache is asked first (huggingface_hub's own lookup, local files only), then
    `snapshot_download` fetches what a source reads into it; a failed download is one line naming the id,
    the cache and the Hub's reason. No network: the download is a stand-in that lays out what a download
    leaves, and huggingface_hub's endpoint is a closed local port should anything else try."""
    import huggingface_hub
    from huggingface_hub import constants

    from composer_jax.checkpoint.hub import CONFIG_PATTERNS, WEIGHT_PATTERNS
    from composer_jax.checkpoint.safetensors_io import CheckpointError

    cache, real, calls = tmp_path / "hub", huggingface_hub.snapshot_download, []

    def download(repo_id, *, allow_patterns, local_files_only=False):
        calls.append((repo_id, local_files_only, allow_patterns))
        if local_files_only:
            return real(repo_id, allow_patterns=allow_patterns, local_files_only=True)
        if repo_id == "org/name":
            return str(cache_model(cache, repo_id, hf_dir[0]))
        raise OSError("401 Client Error. (Request ID: x)\n\nRepository Not Found for url: https://huggingface.co/...")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    source = open_source("org/name")
    weights = list(CONFIG_PATTERNS + WEIGHT_PATTERNS)
    assert calls == [("org/name", True, weights), ("org/name", False, weights)]
    assert source.path == cache / "models--org--name" / "snapshots" / COMMIT
    assert source.model == open_source(hf_dir[0]).model
    calls.clear()
    assert open_source("org/name").path == source.path and calls == [("org/name", True, weights)]   # cached now
    with pytest.raises(CheckpointError) as error:
        open_source("nobody/nothing")
    assert str(error.value) == (f"{tmp_path / 'nobody' / 'nothing'} does not exist, and the Hugging Face model "
                                f"nobody/nothing is not in the cache {cache}, and it does not download: OSError: 401 "
                                "Client Error. (Request ID: x)")


def test_a_model_id_neither_local_nor_cached_offline_is_one_line_naming_it_and_the_cache(tmp_path, capsys,
                                                                                          monkeypatch):
    """HF_HUB_OFFLINE=1 with nothing cached: the run (HF_HUB_CACHE read from the environment), `convert` and
    `generate` say in one line that neither the path nor the cached model is there, and write nothing."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    missing = (f"{tmp_path / 'nobody' / 'nothing'} does not exist, and the Hugging Face model nobody/nothing is not "
               f"in the cache {cache} (offline: HF_HUB_OFFLINE=1)")
    result = subprocess.run([sys.executable, "-m", "composer_jax.cli", "pretrain", "pretrain-tiny",
                             "train.init_from=nobody/nothing", f"run_dir={tmp_path / 'out'}"], cwd=tmp_path,
                            env={**os.environ, "HF_HUB_CACHE": str(cache)}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"composer-jax pretrain: error: config key 'train.init_from': {missing} (command-line override "
        "train.init_from=nobody/nothing)"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    for command in (["convert", "nobody/nothing", str(tmp_path / "out")],
                    ["generate", "nobody/nothing", "--prompt", "x"]):
        assert main(command) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"composer-jax {command[0]}: error: {missing}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_tokenizer_or_format_the_model_cannot_take_and_another_architecture_are_errors(hf_dir, tmp_path):
    from tests.random_models import save_random_run

    path, _ = hf_dir
    byte_run = save_random_run(tmp_path / "byte-run")      # a run of another architecture: 256 ids
    with pytest.raises(ConfigError, match=f"config key 'model.vocab_size': is 4096, but the source {byte_run} has 256"):
        load_run_config("pretrain-tiny", [f"train.init_from={byte_run}"])
    byte_model = load_run_config("pretrain-tiny", FAST + ["model.vocab_size=256", f"data.tokenizer={TINY_BPE}",
                                                          f"run_dir={tmp_path / 'a'}"])
    with pytest.raises(ConfigError, match=f"config key 'data.tokenizer': tokenizer {TINY_BPE}/tokenizer.json has 4096 "
                                          "ids, more than the model's vocab_size=256"):
        Trainer(byte_model)
    kimi = load_run_config(_run_yaml(tmp_path, path), FAST + ["data.chat_format=kimi", f"run_dir={tmp_path / 'b'}"])
    with pytest.raises(ConfigError, match="config key 'data.chat_format': chat format 'kimi' needs "
                                          "<.tool_calls_section_begin.>"):
        Trainer(kimi)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_plan_reports_the_loading_peak_of_a_k25_checkpoint_from_its_config_and_index(tmp_path, capsys):
    """Kimi K2.5 in INT4 (config.json with text_config and an index, no weights) on 128 devices."""
    from composer_jax.checkpoint.hf import plan_leaves
    from composer_jax.checkpoint.hf_config import hf_config_from
    from composer_jax.model import abstract_params

    k25 = load_config("kimi-k2.5")
    text = hf_config_from(k25, "bfloat16") | {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
            "weights": {"num_bits": 4, "group_size": 32, "symmetric": True, "type": "int", "strategy": "group"},
            "targets": ["Linear"]}}, "ignore": ["lm_head"]}}
    source = tmp_path / "k25"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                    "text_config": text}))
    keys = [t.key for leaf in plan_leaves(abstract_params(k25), k25, "language_model.") for t in leaf.plan.flat]
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "x.safetensors" for k in keys}}))
    run = tmp_path / "cpt.yaml"
    run.write_text(yaml.safe_dump({"train": {"init_from": str(source), "seq_len": 32768, "batch_size": 32},
                                   "mesh": {"fsdp": 32, "cp": 4, "ep": 128}}))
    assert main(["plan", str(run), "--devices", "128", "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    loading = json.loads((tmp_path / "plan.json").read_text())["loading"]
    assert f"loading Hugging Face model {source}: peak" in out and loading["devices_per_host"] == 8
    # one layer's routed gate weights on a host of 8 devices (24 of 384 experts, bf16), and one expert's rows
    # dequantized to float32: a bounded peak, independent of the 61 layers
    assert loading["leaf"].startswith("moe_layers.mlp.")
    assert 0.5e9 < loading["bytes"] < 2e9, loading


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_quantized_sources_dequantize_into_their_shards(tmp_path, fmt):
    """K2.5-style INT4 experts and DeepSeek FP8 blocks, streamed onto fsdp=4 / ep=8 with small read blocks,
    give `from_pretrained`'s dequantized weights (the whole-tensor read) bit for bit, cast to float32."""
    from flax import nnx

    from composer_jax.checkpoint.manager import abstract_like
    from composer_jax.checkpoint.synthetic import write_synthetic_hf
    from composer_jax.model import CausalLM, abstract_params, split_model
    from composer_jax.parallel import param_shardings
    from composer_jax.source_weights import load_state

    cfg = load_config("tiny", ["mtp.num_layers=0", "hidden_size=128", "moe.moe_intermediate_size=128",
                               "intermediate_size=256"])
    write_synthetic_hf(tmp_path / "hf", cfg, fmt, params_of=abstract_params)
    source = open_source(tmp_path / "hf")
    assert source.quantized
    run_cfg = config.replace(source.model, **{"param_dtype": "float32", "dtype": "float32"})
    dual = DualMesh(MeshConfig(fsdp=4, cp=2, ep=8), jax.devices(), model=run_cfg)
    _, params, biases, _ = split_model(nnx.eval_shape(lambda: CausalLM(run_cfg, rngs=nnx.Rngs(0))))
    params, biases = (abstract_like(t, param_shardings(t, dual)) for t in (params, biases))
    loaded = load_state(source, run_cfg, params, biases, chunk_bytes=1 << 20)
    reference = split_model(from_pretrained(tmp_path / "hf", ["param_dtype=float32", "dtype=float32"]))[1:3]
    for ours, theirs in zip(jax.tree.leaves(loaded), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_rl_from_a_transformers_checkpoint_speaks_its_tokenizer(hf_dir, tmp_path):
    """`composer-jax rl init_from=<HF dir>`: the learner starts from its weights (the policy and the fixed
    teacher), its episodes are in the HF tokenizer's ids (a prompt encodes as that tokenizer encodes the
    environment's rendering) and the chat format follows the tokenizer."""
    from flax import nnx
    from tokenizers import Tokenizer

    from composer_jax.envs import TokenEpisode, ToyEnv, get_format, toy_tasks
    from composer_jax.rl.loop import RLTrainer
    from composer_jax.rl.run_config import load_rl_config
    from composer_jax.source_weights import open_model

    path, _ = hf_dir
    cfg = load_rl_config("rl-tiny", [f"init_from={path}", f"run_dir={tmp_path / 'rl'}", "rollout.max_len=64",
                                     "rollout.feedback_window=64", "rl.sd_teacher=initial", "rl.teacher_context=full",
                                     "rollout.transport=directory", "rollout.devices=0", "progress=false"])
    trainer = RLTrainer(cfg)      # the directory transport: no in-process engine to build here
    try:
        assert trainer.tokenizer.name == str(path / "tokenizer.json") and trainer.cfg.env.format == "plain"
        for ours, theirs in zip(jax.tree.leaves(trainer.learner.rl_step.teacher_params),
                                jax.tree.leaves(nnx.state(open_model(path).model, nnx.Param))):
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
        task, fmt = toy_tasks("add", 1, seed=3)[0], get_format("plain")
        prompt = TokenEpisode(ToyEnv(fmt), trainer.tokenizer).start(task)
        rendered = "".join(fmt.message(m["role"], m["content"]) for m in ToyEnv(fmt).reset(task)) + fmt.generation_prompt()
        assert prompt.tolist() == Tokenizer.from_file(str(path / "tokenizer.json")).encode(
            rendered, add_special_tokens=False).ids
    finally:
        trainer.checkpoints.close()

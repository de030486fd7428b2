"""What users meet at the command line: one-line errors that name the real culprit (never a traceback),
relative paths accepted, failed starts leaving nothing behind, `--version`, subcommand usage, the
`config` command, `info` on run configs, and run paths that do not depend on the current directory."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from composer_jax import cli
from composer_jax.config import load_config
from composer_jax.train.config import load_run_config

REPO = Path(__file__).resolve().parent.parent


def _one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("argv, line", [
    (["pretrain", "train.steps=abc"],
     "composer-jax pretrain: error: config key 'train.steps': expected an int, got 'abc' "
     "(command-line override train.steps=abc)"),
    (["pretrain", "no-such-config"],
     "composer-jax pretrain: error: config 'no-such-config' is neither a file nor a bundled run config "
     "(bundled: long-context-tiny, pretrain-small, pretrain-tiny, rl-coding-small, rl-coding-tiny, rl-tiny, sft-small, sft-tiny, sft-toy-tiny)"),
    (["pretrain", "train.steps"],
     "composer-jax pretrain: error: config 'train.steps' is neither a file nor a bundled run config "
     "(bundled: long-context-tiny, pretrain-small, pretrain-tiny, rl-coding-small, rl-coding-tiny, rl-tiny, sft-small, sft-tiny, sft-toy-tiny); to override a key write train.steps=VALUE"),
    (["convert", "/nonexistent", "/tmp/never-written"],
     "composer-jax convert: error: /nonexistent does not exist (expected a Hugging Face model directory)"),
    (["export", "/nonexistent", "/tmp/never-written"], "composer-jax export: error: /nonexistent does not exist"),
    (["info", "tiny", "moe.num_expert_per_tok=2"],
     "composer-jax info: error: config key 'moe.num_expert_per_tok': unknown key for MoEConfig; did you mean "
     "'num_experts_per_tok'? (command-line override moe.num_expert_per_tok=2)"),
])
def test_messages_are_one_line_and_name_the_real_culprit(argv, line, capsys):
    assert cli.main(argv) == 2
    assert _one_line(capsys.readouterr().err) == line


def test_export_of_a_run_directory_without_a_complete_checkpoint_is_one_line(tmp_path, capsys):
    for step in (50, 100):     # directories, but no checkpoint orbax committed
        (tmp_path / "run" / "checkpoints" / str(step)).mkdir(parents=True)
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    assert _one_line(capsys.readouterr().err) == (
        f"composer-jax export: error: {tmp_path / 'run'}: no complete checkpoint in {tmp_path / 'run' / 'checkpoints'}: "
        "train that run first")
    assert not (tmp_path / "out").exists()


def test_version_and_subcommand_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == "composer-jax 0.1.0\n"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["pretrain", "--steps", "5"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[0].startswith("usage: composer-jax pretrain [-h]")  # the subcommand's usage
    assert err.splitlines()[-1] == ("composer-jax pretrain: error: unrecognized arguments: --steps (config values are "
                                    "key=value overrides, e.g. train.steps=5)")


def test_a_failed_start_prints_one_line_and_leaves_nothing_behind(tmp_path):
    """`sft` from a directory where its init_from run does not exist (relative paths, spelled as a Hugging
    Face model id, not cached either): one line, status 2, no traceback at exit, and no directory created
    (neither the run's nor init_from's)."""
    cache = "/nonexistent/hf-cache"
    result = subprocess.run([sys.executable, "-m", "composer_jax.cli", "sft", "train.init_from=runs/long-context-tiny",
                             "run_dir=runs/sft-tiny"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "HF_HUB_CACHE": cache})
    assert result.returncode == 2
    assert _one_line(result.stderr) == (
        f"composer-jax sft: error: config key 'train.init_from': {tmp_path / 'runs' / 'long-context-tiny'} does not "
        f"exist, and the Hugging Face model runs/long-context-tiny is not in the cache {cache} (offline: "
        "HF_HUB_OFFLINE=1) (command-line override train.init_from=runs/long-context-tiny)")
    assert list(tmp_path.iterdir()) == []


def test_bundled_run_paths_do_not_depend_on_the_current_directory(tmp_path, monkeypatch):
    """The bundled recipe's run directories live under ~/.cache/composer-jax/runs whatever the current
    directory; each phase's config reads the architecture of the run before it (random runs stand in)."""
    from tests.random_models import save_random_run

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    runs = tmp_path / "home" / ".cache" / "composer-jax" / "runs"
    bpe = ["model.vocab_size=4096", "data.tokenizer=tokenizers/tiny-bpe"]
    save_random_run(runs / "pretrain-tiny", bpe)
    save_random_run(runs / "long-context-tiny", [*bpe, "model.rope.factor=32", "model.rope.max_position_embeddings=512"])
    here = load_run_config("sft-tiny")
    monkeypatch.chdir(tmp_path)
    there = load_run_config("sft-tiny")
    assert (there.run_dir, there.train.init_from) == (here.run_dir, here.train.init_from) == \
        (str(runs / "sft-tiny"), str(runs / "long-context-tiny"))
    assert there.model.vocab_size == 4096 and there.model.rope.max_position_embeddings == 2048
    assert load_run_config("long-context-tiny").train.init_from == str(runs / "pretrain-tiny") == \
        load_run_config("pretrain-tiny").run_dir
    # Paths given on the command line are relative to the current directory, made absolute at once.
    shutil.copytree(runs / "pretrain-tiny", tmp_path / "runs" / "other")
    cfg = load_run_config("pretrain-tiny", ["run_dir=runs/mine", "train.init_from=runs/other"])
    assert (cfg.run_dir, cfg.train.init_from) == (str(tmp_path / "runs" / "mine"), str(tmp_path / "runs" / "other"))


def test_config_show_prints_a_loadable_resolved_config(tmp_path, capsys):
    assert cli.main(["config", "show", "pretrain-tiny", "train.steps=7", "optimizer.on_extend=continue"]) == 0
    path = tmp_path / "run.yaml"
    path.write_text(capsys.readouterr().out)
    assert load_run_config(path) == load_run_config("pretrain-tiny", ["train.steps=7", "optimizer.on_extend=continue"])
    assert cli.main(["config", "show", "tiny", "mtp.num_layers=2"]) == 0
    path.write_text(capsys.readouterr().out)
    assert load_config(path) == load_config("tiny", ["mtp.num_layers=2"])


def test_config_keys_lists_defaults_and_the_meanings_written_in_the_source(capsys):
    """The meaning of each key is the comment beside (or above) its field in the dataclass source."""
    import re

    assert cli.main(["config", "keys"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    source = (REPO / "composer_jax" / "train" / "config.py").read_text()
    comment = re.search(r"^    batch_size: int = 16 +# (.+)$", source, re.M)[1]
    assert re.fullmatch(rf"train\.batch_size +16 +{re.escape(comment)} \[int\]", rows["train.batch_size"])
    assert re.fullmatch(r"optimizer\.on_extend +refuse +Resuming with a different train\.steps changes the schedule: "
                        r".+ \[one of 'refuse', 'continue', 'restart'\]", rows["optimizer.on_extend"])
    assert re.fullmatch(r"model\.vocab_size +\(required\) +.*\[int\]", rows["model.vocab_size"])
    assert {"data.path", "mesh.fsdp", "checkpoint.every", "run_dir", "model.moe.dispatch"} <= set(rows)
    assert cli.main(["config", "keys", "model"]) == 0
    model_rows = capsys.readouterr().out.splitlines()[1:]
    assert model_rows[0].split()[0] == "vocab_size" and not any(r.startswith("train.") for r in model_rows)


def test_info_accepts_a_run_config(capsys):
    """`info pretrain-tiny` counts the run's model (its YaRN factor, dispatch...) at its train.seq_len."""
    assert cli.main(["info", "pretrain-tiny", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert cli.main(["info", "tiny", "vocab_size=4096", "rope.factor=8", "rope.max_position_embeddings=128",
                     "moe.dispatch=dense", "--seq-len", "128", "--json"]) == 0
    model = json.loads(capsys.readouterr().out)
    assert run["flops"]["seq_len"] == 128
    for key in ("total", "active", "flops"):
        assert run[key] == model[key]


def _training_checkpoint(directory: Path, step: int) -> None:
    """A training checkpoint step (`model` and `config` items, as the loop writes them) of the tiny model."""
    from flax import nnx

    from composer_jax.checkpoint.manager import TrainCheckpointer
    from composer_jax.config import to_dict
    from composer_jax.model import CausalLM
    from composer_jax.model.layers import RouterBias

    cfg = load_config("tiny", ["mtp.num_layers=0"])
    _, params, biases, _ = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param, RouterBias, ...)
    ckpt = TrainCheckpointer(directory, array_items=("model",), json_items=("config",), async_save=False)
    ckpt.save(step, {"model": {"params": params, "biases": biases}}, {"config": {"model": to_dict(cfg)}}, force=True)
    ckpt.close()


def test_relative_convert_and_export_paths(tmp_path, monkeypatch, capsys):
    """convert and export with relative SRC and DST, and export of a training checkpoint step given as a
    relative path (orbax itself wants absolute ones): the same tensors come out."""
    from safetensors.numpy import load_file

    from composer_jax.checkpoint.synthetic import write_synthetic_hf
    from composer_jax.model import abstract_params

    def tensors(directory):
        return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}

    monkeypatch.chdir(tmp_path)
    write_synthetic_hf("hf", load_config("tiny", ["mtp.num_layers=0"]), params_of=abstract_params)
    assert cli.main(["convert", "hf", "converted", "--quiet"]) == 0, capsys.readouterr().err
    assert cli.main(["export", "converted", "exported", "--quiet"]) == 0, capsys.readouterr().err
    original, exported = tensors(tmp_path / "hf"), tensors(tmp_path / "exported")
    assert set(original) == set(exported) and all(np.array_equal(original[k], exported[k]) for k in original)

    _training_checkpoint(Path("run") / "checkpoints", step=3)
    assert cli.main(["export", "run/checkpoints/3", "from_run", "--quiet"]) == 0, capsys.readouterr().err
    assert set(tensors(tmp_path / "from_run")) == set(original)
    assert json.loads((tmp_path / "from_run" / "config.json").read_text())["model_type"] == "deepseek_v3"


def test_ctrl_c_outside_the_training_loop_is_one_line_and_status_130(monkeypatch, capsys):
    """E.g. while a run is still being set up (the loop itself saves and says so: test_train_resume)."""
    from composer_jax.train import loop

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "train", interrupted)
    assert cli.main(["pretrain", "train.steps=3"]) == 130
    assert _one_line(capsys.readouterr().err) == "composer-jax pretrain: interrupted"


def test_output_piped_into_head_ends_quietly():
    """`composer-jax config keys | head -1`: no BrokenPipeError traceback, exit 0."""
    proc = subprocess.run(f"{sys.executable} -m composer_jax.cli config keys run | head -1", shell=True,
                          capture_output=True, text=True, timeout=120, executable="/bin/bash",
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.stdout.startswith("key") and proc.stderr == "", proc.stderr

"""The coding study (tools/experiment_coding.py, tools/study_report.py, docs/coding-study.md): its
pretraining corpus, its report's numbers against hand counts, and the whole study at its smoke size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from composer_jax.data.sources import list_files
from composer_jax.eval.store import AttemptRecord, transcript_path
from composer_jax.train.config import load_run_config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import study_report  # noqa: E402


def test_the_small_pretraining_corpus_takes_installed_packages_but_not_the_gym_templates(tmp_path):
    """pretrain-small reads the stdlib directory with site-packages in it; the one component it leaves
    out is the project's package, where the gym's templates live (an installed, non-editable copy)."""
    cfg = load_run_config("pretrain-small")
    assert cfg.model.vocab_size == 4096 and cfg.data.path == "stdlib"
    for rel in ("json/decoder.py", "site-packages/numpy/core/fromnumeric.py",
                "site-packages/composer_jax/tasks/gym_templates.py", "site-packages/composer_jax/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    _, files = list_files(str(tmp_path), cfg.data.glob, cfg.data.exclude_parts)
    assert files == ["json/decoder.py", "site-packages/numpy/core/fromnumeric.py"]


def _task(root: Path, name: str, family: str, difficulty: dict) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "task.json").write_text(json.dumps({"id": name, "family": family, "difficulty": difficulty}))


def test_pass_at_1_by_level_and_flag_slopes_match_hand_counts(tmp_path):
    tasks, run = tmp_path / "tasks", tmp_path / "eval"
    _task(tasks, "b1", "bug_injection", {"mutation": "comparison"})
    _task(tasks, "b2", "bug_injection", {"mutation": "comparison"})
    _task(tasks, "d1", "feature_deletion", {"deleted_lines": 2})
    _task(tasks, "d2", "feature_deletion", {"deleted_lines": 7})
    solved = {"b1": [1, 1, 0, 0], "b2": [0, 0, 0, 1], "d1": [0, 0, 0, 0], "d2": [1, 0, 0, 0]}
    run.mkdir()
    with open(run / "attempts.jsonl", "w") as f:
        for task, outcomes in solved.items():
            for sample, s in enumerate(outcomes):
                record = AttemptRecord(task, sample, sample, float(s), bool(s), 3, 50, 3, 0, 0, "ok", 1.0,
                                       transcript_path(task, sample))
                f.write(json.dumps(record.to_json()) + "\n")
    by_level = study_report.pass_at_1_by_level(run, tasks)
    assert {k: (v["tasks"], v["pass@1"]) for k, v in by_level.items()} == {
        "bug: comparison": (2, (2 / 4 + 1 / 4) / 2), "body: 1-3 lines": (1, 0.0), "body: 6+ lines": (1, 0.25)}
    steps, rates = [1, 2, 3, 4], [0.5, 0.4, 0.35, 0.1]
    assert study_report.slope(steps, rates) == pytest.approx(np.polyfit(steps, rates, 1)[0])
    assert study_report.slope([1], [0.5]) is None


@pytest.mark.slow
def test_the_study_runs_phase_to_phase_at_its_smoke_size_and_resumes(tmp_path):
    """Every phase at its smallest size (a gym of 4 tasks, 2 pretraining and SFT steps, one RL step per
    arm, one sample per held-out task), then the same command again: nothing reruns."""
    out = tmp_path / "study"
    cmd = [sys.executable, str(REPO / "tools" / "experiment_coding.py"), str(out), "--scale", "smoke", "--seeds", "1"]
    env = {**os.environ, "HOME": str(tmp_path / "home"), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                 if "xla_force_host_platform_device_count" not in f)}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    phases = [json.loads(line)["phase"] for line in (out / "phases.jsonl").read_text().splitlines()]
    assert phases == ["gym", "pretrain", "demos", "sft", "copy-probe", "eval-sft", "eval-sft-train", "rl-0-sd",
                      "rl-0-nosd", "eval-rl-0"]
    study = json.loads((out / "study.json").read_text())
    held_out = {p.name for p in (out / "gym" / "held-out").iterdir() if (p / "task.json").is_file()}
    assert study["eval"]["sft"]["tasks"] == study["eval"]["rl-0"]["tasks"] == len(held_out) > 0
    assert sum(v["tasks"] for v in study["by_level"]["sft"].values()) == len(held_out)
    assert set(study["paired"]["rl-0"]) >= {"pass@1", "solved_only_by_sft", "solved_only_by_rl"}
    for arm in ("sd", "nosd"):
        assert study["curves"][f"rl-0-{arm}"]["step"] == [1]
    assert "eval_bpb" in study["pretrain"]
    assert [c["model"].split(",")[0] for c in study["copy"]] == [f"training run {out / 'runs' / r}" for r in ("pretrain", "sft")]
    assert all(c["second_nll"] > 0 for c in study["copy"])
    assert (out / "plots" / "pass_by_level.png").stat().st_size and (out / "study.md").read_text().startswith("#")
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len((out / "phases.jsonl").read_text().splitlines()) == len(phases)


def test_turn_fit_finds_each_assistant_turn_as_the_renderer_marks_it():
    """tools/sft_turn_fit.py scores each assistant turn: its spans of trained tokens decode to the
    renderer's trained pieces (each turn's call and end marker), in order."""
    from composer_jax.data.chat import render, tokenize_conversation
    from composer_jax.data.tokenizer import load_tokenizer

    import sft_turn_fit

    tokenizer = load_tokenizer(str(REPO / "configs" / "tokenizers" / "tiny-bpe"))
    call = lambda name, args: {"role": "assistant", "content": "", "tool_calls": [  # noqa: E731
        {"id": f"c{name}", "type": "function", "function": {"name": name, "arguments": args}}]}
    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix it."},
                call("run", {"command": "pytest -q"}), {"role": "tool", "content": "1 failed"},
                call("read_file", {"path": "util_42frvn.py"}), {"role": "tool", "content": "1| x = 1"},
                {"role": "assistant", "content": "Done.", "tool_calls": [
                    {"id": "cs", "type": "function", "function": {"name": "submit", "arguments": {}}}]}]
    tokens, mask = tokenize_conversation(messages, lambda t: np.asarray(tokenizer.encode(t)))
    spans = sft_turn_fit.turn_spans(mask)
    assert [tokenizer.decode(tokens[s].tolist()) for s in spans] == [t for t, trained in render(messages) if trained]
    assert len(spans) == 3 and sft_turn_fit.turn_spans(np.zeros(4, np.int32)) == []


def test_a_relative_out_links_its_training_sample_to_tasks_that_resolve(tmp_path, monkeypatch):
    """`experiment_coding.py study` (a relative OUT): the training sample's links lead to the gym's tasks."""
    import experiment_coding

    monkeypatch.chdir(tmp_path)
    for name in ("held-out/h1", "t1", "t2"):
        (tmp_path / "study" / "gym" / name).mkdir(parents=True)
        (tmp_path / "study" / "gym" / name / "task.json").write_text("{}")
    study = experiment_coding.Study(Path("study"), experiment_coding.SCALES["smoke"], 1, quiet=True)
    sample = study.train_sample()
    assert [p.name for p in sample.iterdir()] == ["t1"] and (sample / "t1" / "task.json").is_file()


def test_copy_probe_scores_a_copier_near_zero_on_the_second_reading_and_a_uniform_model_at_ln_v():
    """tools/copy_probe.py against two models whose scores are known: one that predicts each token of the
    second reading from the first (an ideal induction head) and one uniform over the vocabulary."""
    import copy_probe

    vocab, length = 50, 12
    tokens = copy_probe.probe_tokens(np.arange(3, vocab), length, sequences=4, seed=1)
    assert tokens.shape == (4, 2 * length) and (tokens[:, :length] == tokens[:, length:]).all()
    assert tokens.min() >= 3
    uniform = np.full((*tokens.shape, vocab), -np.log(vocab))
    s = copy_probe.copy_scores(uniform, tokens)
    assert s["first_nll"] == pytest.approx(np.log(vocab)) and s["second_nll"] == pytest.approx(np.log(vocab))
    copier = uniform.copy()
    for j in range(length - 1, 2 * length - 1):          # position j predicts token j + 1 = token j + 1 - length
        copier[:, j] = np.log(0.01 / (vocab - 1))
        copier[np.arange(4), j, tokens[:, j + 1 - length]] = np.log(0.99)
    s = copy_probe.copy_scores(copier, tokens)
    assert s["first_nll"] == pytest.approx(np.log(vocab)) and s["second_nll"] == pytest.approx(-np.log(0.99))
    assert s["second_greedy"] == 1.0
    shifted = np.roll(copier, 1, axis=1)                  # one position late: a copier misaligned by one
    assert copy_probe.copy_scores(shifted, tokens)["second_greedy"] < 0.2

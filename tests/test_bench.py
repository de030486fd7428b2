"""`composer-jax bench`: the quick CPU run writes every section with finite, positive measurements
whose ratios follow from the measured numbers; the loop-aware FLOP count against closed forms; bad
arguments are one-line errors."""

import json
import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import cli
from composer_jax.bench.suite import SECTIONS
from composer_jax.bench.timing import _python_scan, flops_of, unrolled_loops
from composer_jax.cpu_devices import count_for


def _close(a, b, rel=1e-9):
    assert math.isclose(a, b, rel_tol=rel), (a, b)


def _positive(*values):
    for v in values:
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, v


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    assert cli.main(["bench", "--json", str(path), "--quick", "--decode-run", str(path.parent / "no-run")]) == 0
    return json.loads(path.read_text())


@pytest.mark.slow
def test_quick_bench_has_every_section(quick):
    assert set(SECTIONS) <= set(quick) and quick["environment"]["quick"] and quick["environment"]["preset"] == "cpu"

    def walk(x, path="results"):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}.{k}")
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")
        elif isinstance(x, float):
            assert math.isfinite(x), path
    walk(quick)
    for name in SECTIONS:
        _positive(quick[name]["wall_s"])


@pytest.mark.slow
def test_train_step_ratios_follow_the_measurements(quick):
    r = quick["train_step"]
    _positive(r["step_s"], r["tokens_per_s"], r["model_flops_per_token"], r["compiled_flops_per_token"],
              r["peak_flops"], r["mfu"])
    _close(r["tokens_per_s"], r["batch_size"] * r["seq_len"] / r["step_s"])
    _close(r["compiled_over_model_flops"], r["compiled_flops_per_token"] / r["model_flops_per_token"])
    _close(r["mfu"], r["tokens_per_s"] * r["model_flops_per_token"] / r["peak_flops"])
    # Every layer of the scanned stacks is counted: the compiled program does at least the model's matmuls.
    assert r["compiled_over_model_flops"] >= 1.0


@pytest.mark.slow
def test_comparison_ratios_follow_the_measurements(quick):
    for row in quick["attention"]["kernel"]:
        _positive(row["reference_s"], row["blockwise_s"])
        _close(row["blockwise_over_reference"], row["blockwise_s"] / row["reference_s"])
    # The quick run leaves out the step-memory growth (compiles 2 steps per length; tests/test_attention_memory.py).
    assert quick["sizes"]["memory_lengths"] == [] and "memory" not in quick["attention"]
    d = quick["dispatch"]
    assert set(d["median_ms"]) == {"dense", "ragged", "ep_a2a"} and "ep_ragged" in d["skipped"]
    for kind, ms in d["median_ms"].items():
        _positive(ms)
        _close(d["over_dense"][kind], ms / d["median_ms"]["dense"])
        assert d["rel_error_vs_dense"][kind] < 2e-2, kind
    t = quick["rl_teacher"]
    _positive(t["prefix"]["teacher_flops"], t["full"]["teacher_flops"], t["prefix"]["share_of_step"])
    _close(t["naive_over_ours"], t["full"]["teacher_flops"] / t["prefix"]["teacher_flops"])
    assert t["naive_over_ours"] > 1   # the naive teacher reruns the whole context
    assert set(t["per_slot_over_one"]) == {"2"} and all(0.8 < v < 1.5 for v in t["per_slot_over_one"].values())
    g = quick["decode"]["greedy"]
    _positive(g["plain_tokens_per_s"], g["speculative_tokens_per_s"])
    assert g["same_tokens"]
    paired = statistics.median(s / p for p, s in zip(g["plain_runs_tokens_per_s"], g["speculative_runs_tokens_per_s"]))
    assert abs(g["speedup"] - paired) <= 0.01 * paired + 1e-3
    m = quick["muon"]
    _positive(m["ours_s"], m["optax_s"], m["ns_flops_per_device_ours"], m["ns_flops_per_device_optax"])
    _close(m["speedup"], m["optax_s"] / m["ours_s"])
    _close(m["ns_share_ours"], m["ns_flops_per_device_ours"] / m["ns_flops_per_device_ideal"])
    assert m["max_rel_error_vs_optax"] < 1e-3


@pytest.mark.slow
def test_decode_peer_rows_follow_the_measurements(quick):
    """Both engines decode the same checkpoint to the same greedy tokens; ratios, roofline and the
    dispatch choice follow from the recorded measurements."""
    from composer_jax.model.dispatch import BACKENDS, inference_backend

    r = quick["decode_peer"]
    _positive(r["copy_bandwidth_bytes_per_s"], r["sizes"]["tiny"]["weight_bytes"])
    rows = r["sizes"]["tiny"]["rows"]
    assert [row["batch"] for row in rows] == [1, 8]
    for row in rows:
        _positive(row["ours_tokens_per_s"], row["transformers_tokens_per_s"], row["ours_decode_tokens_per_s"],
                  row["transformers_decode_tokens_per_s"], row["roofline_tokens_per_s"])
        _close(row["ratio"], row["ours_tokens_per_s"] / row["transformers_tokens_per_s"], rel=2e-3)
        b = row["step_bytes"]
        assert b["weights"] + b["cache"] == pytest.approx(b["total"], abs=2) and b["total"] < b["all_weights"]
        _close(row["roofline_tokens_per_s"], row["batch"] * r["copy_bandwidth_bytes_per_s"] / b["total"], rel=1e-3)
        _close(row["ours_roofline_fraction"], row["ours_decode_tokens_per_s"] / row["roofline_tokens_per_s"], rel=1e-2)
        assert row["same_greedy_rows"] == 1.0
        d = row["dispatch"]
        assert set(d["median_ms"]) == set(BACKENDS) and d["fastest"] == min(d["median_ms"], key=d["median_ms"].get)
        assert d["chosen"] == inference_backend("cpu", row["batch"], 4, 16, "ragged", 256 * 128 * 4)
    assert rows[1]["step_bytes"]["weights"] > rows[0]["step_bytes"]["weights"]   # 8 rows touch more experts


@pytest.mark.slow
def test_train_peer_matches_torch_on_the_first_step(quick):
    """Our step (pretrain's defaults: a device per core, the recipe's dispatch) and the PyTorch loop over
    transformers' model start from one checkpoint on one batch: their first losses agree to fp32
    rounding (the independent check), their second ones nearly, and the ratios follow from the
    recorded times."""
    r = quick["train_peer"]["shapes"]["tiny_quick"]
    (row,) = r["rows"]
    assert row["name"] == "ours" and row["devices"] == count_for(r["batch_size"]) and row["dispatch"] == "ragged"
    assert r["torch"]["threads"] == quick["train_peer"]["cpus"]
    assert abs(row["first_loss"] - r["torch"]["first_loss"]) < 1e-4 * r["torch"]["first_loss"]
    assert r["first_loss_abs_diff"] == abs(row["first_loss"] - r["torch"]["first_loss"])
    assert abs(r["torch"]["first_loss"] - math.log(4096)) < 0.5   # random weights: near-uniform predictions
    # The first update alike: the second losses differ by a small part of the change it makes (Adam's first
    # step moves each weight by +-lr, so a gradient near 0 whose sign the two sides round apart, and our
    # router-bias update, leave a little; a peer at the unwarmed rate, 20x ours, would change the loss ~20x).
    change = abs(row["first_loss"] - row["second_loss"])
    assert change > 1e-3 and r["second_loss_abs_diff"] < 0.1 * change
    tokens = r["batch_size"] * r["seq_len"]
    _positive(row["step_s"], r["torch"]["step_s"], r["model_flops_per_token"])
    _close(row["tokens_per_s"], tokens / row["step_s"])
    _close(row["over_torch"], row["tokens_per_s"] / r["torch"]["tokens_per_s"])
    _close(r["compiled_over_model_flops"], r["compiled_flops_per_token"] / r["model_flops_per_token"])
    # One-layer stacks: the program that ran counts every matmul once, at least the model's.
    assert r["compiled_flops_counted"] == "as run" and r["compiled_over_model_flops"] >= 1.0


def test_peer_sections_without_torch(tmp_path, capsys, monkeypatch):
    """Without torch: naming train_peer is a one-line error; the default run leaves it out, saying why."""
    from composer_jax.cli import bench as cli_bench

    real = cli_bench.importlib.util.find_spec
    monkeypatch.setattr(cli_bench.importlib.util, "find_spec", lambda name: None if name == "torch" else real(name))
    assert cli.main(["bench", "--json", str(tmp_path / "b.json"), "--sections", "train_peer"]) == 2
    assert capsys.readouterr().err.strip() == (
        "composer-jax bench: error: --sections: train_peer runs a PyTorch loop over transformers' "
        "DeepseekV3ForCausalLM and needs torch (pip install 'composer-jax[test]')")
    monkeypatch.setattr(cli_bench, "use_cpu_devices", lambda n: (_ for _ in ()).throw(SystemExit(7)))
    with pytest.raises(SystemExit):          # stops right after choosing the sections
        cli.main(["bench", "--json", str(tmp_path / "b.json")])
    err = capsys.readouterr().err
    assert "leaving out decode_peer runs transformers' generate and needs torch" in err
    assert "leaving out train_peer runs a PyTorch loop" in err


def test_unrolled_flops_count_every_iteration():
    """XLA's cost analysis counts a loop body once; unrolled, a scan of L matmuls and a map over rows
    count 2 n^3 L + the map's matmuls, the closed form."""
    n, layers = 64, 6
    x = jnp.ones((n, n))

    def make():
        def f(x):
            y = jax.lax.scan(lambda c, _: (c @ x, None), x, None, length=layers)[0]
            return jax.lax.map(lambda row: row @ x, y.reshape(2, n // 2, n))
        return f

    looped = flops_of(jax.jit(make()).lower(x))
    with unrolled_loops():
        unrolled = flops_of(jax.jit(make()).lower(x))
    assert unrolled == 2 * n ** 3 * layers + 2 * n ** 3
    assert looped < unrolled / 3
    assert jax.lax.scan is not _python_scan   # restored


def test_python_scan_matches_lax_scan():
    rng = np.random.default_rng(0)
    xs = {"a": jnp.asarray(rng.normal(size=(5, 3))), "b": jnp.asarray(rng.normal(size=(5,)))}

    def body(carry, x):
        carry = carry * 0.5 + x["a"] * x["b"]
        return carry, (carry.sum(), x["b"] * 2)

    for reverse in (False, True):
        expected = jax.lax.scan(body, jnp.zeros(3), xs, reverse=reverse)
        got = _python_scan(body, jnp.zeros(3), xs, reverse=reverse)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12), got, expected)


@pytest.mark.parametrize("argv, line", [
    (["--sections", "train_step,trian_step"],
     "composer-jax bench: error: --sections: unknown section 'trian_step' (expected some of "
     f"{', '.join(SECTIONS)}); did you mean 'train_step'?"),
    (["--sections", ","], f"composer-jax bench: error: --sections: no section named (expected some of {', '.join(SECTIONS)})"),
    (["--preset", "gpu"], "composer-jax bench: error: --preset gpu: the proxy MoE needs a GPU (the backend here is "
                          "cpu); use --preset cpu"),
])
def test_bad_arguments_are_one_line_errors(argv, line, tmp_path, capsys):
    assert cli.main(["bench", "--json", str(tmp_path / "b.json"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err == line
    assert not (tmp_path / "b.json").exists()


def test_missing_json_directory_is_a_one_line_error(tmp_path, capsys):
    target = tmp_path / "missing" / "b.json"
    assert cli.main(["bench", "--json", str(target), "--quick"]) == 2
    assert capsys.readouterr().err.strip() == (f"composer-jax bench: error: --json {target}: the directory "
                                               f"{target.parent} does not exist")


@pytest.mark.slow
def test_fitting_batch_fits_the_budget():
    """The GPU preset's batch: the chosen batch's compiled step (state + temporaries) is within budget,
    and the budget admits more rows the larger it is."""
    from composer_jax import load_config
    from composer_jax.bench.train_step import fitting_batch, one_device, run_config
    from composer_jax.train.step import lower_train_step

    def memory(batch):
        return lower_train_step(run_config(model, batch, 64), one_device()).compile().memory_analysis()

    def peak(mem):
        return mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes

    model = load_config("tiny", ["num_layers=2"])
    at_one = memory(1)                 # compiled once, shared by every call below
    budget = 4 * peak(at_one)
    batch = fitting_batch(model, 64, budget, memory=at_one)
    assert batch > 1 and peak(memory(batch)) <= budget
    assert fitting_batch(model, 64, 2 * budget, memory=at_one) > batch
    with pytest.raises(ValueError, match="one row of 64 tokens needs"):
        fitting_batch(model, 64, peak(at_one) / 2, memory=at_one)


def test_non_finite_results_are_named():
    from composer_jax.bench.suite import non_finite

    results = {"train_step": {"mfu": 0.3, "rows": [{"s": 1.0}, {"s": float("nan")}]}, "muon": {"speedup": float("inf")}}
    assert non_finite(results) == ["train_step.rows[1].s", "muon.speedup"]
    assert non_finite({"a": {"b": [1.0, 2]}, "c": "text"}) == []

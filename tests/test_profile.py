"""tools/profile_train_step.py's parsing (composer_jax/bench/profile.py): self times of nested trace
events against a hand computation, components from a hand-written HLO text's stack tables, and one
profiled training step whose component rows sum to its op time."""

import gzip
import json
import math
import os

import pytest

from composer_jax.bench import profile

HLO = """HloModule jit_step, entry_computation_layout={()->f32[]}

ENTRY %main () -> f32[] {
  %dot.1 = f32[4,4]{1,0} dot(f32[4,4]{1,0} %a, f32[4,4]{1,0} %b), metadata={op_name="jit(step)/jvp()/td,edf->etf/dot_general" stack_frame_id=3}
  %fusion.2 = f32[4]{0} fusion(f32[4,4]{1,0} %dot.1), kind=kLoop, metadata={op_name="jit(step)/jvp()/top_k" stack_frame_id=4}
  %all-reduce.3 = f32[4]{0} all-reduce(f32[4]{0} %fusion.2), metadata={op_name="jit(step)/jvp()/td,edf->etf/dot_general" stack_frame_id=3}
  %while.4 = (f32[4]{0}, s32[]) while((f32[4]{0}, s32[]) %t), condition=%cond, body=%body, metadata={op_name="jit(step)/while" stack_frame_id=5}
  ROOT %copy.5 = f32[] copy(f32[] %c)
}

FileNames
1 "/x/composer_jax/train/step.py"
2 "/x/composer_jax/model/dispatch.py"
3 "/x/composer_jax/model/router.py"
4 "/x/composer_jax/model/layers.py"

FunctionNames
1 "step"
2 "dense"
3 "route"
4 "weight"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=1}
2 {file_name_id=2 function_name_id=2 line=20 end_line=20 column=1 end_column=1}
3 {file_name_id=3 function_name_id=3 line=30 end_line=30 column=1 end_column=1}
4 {file_name_id=4 function_name_id=4 line=40 end_line=40 column=1 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=4 parent_frame_id=3}
4 {file_location_id=3 parent_frame_id=2}
5 {file_location_id=1 parent_frame_id=1}
"""


def test_components_walk_the_stack_outward():
    """dot.1: layers.py (no component) called from dispatch.py (frame 3 -> 2): a dispatch matmul, so the
    experts; fusion.2: router.py called from step.py; the all-reduce is a collective whatever its
    metadata; the while's only frame is step.py (no component); copy.5 has no metadata."""
    sources = profile.hlo_sources(HLO)
    assert sources["dot.1"].frames == (("/x/composer_jax/model/layers.py", "weight"),
                                       ("/x/composer_jax/model/dispatch.py", "dense"),
                                       ("/x/composer_jax/train/step.py", "step"))
    assert sources["dot.1"].opcode == "dot" and sources["while.4"].opcode == "while"
    assert {op: profile.component(sources.get(op)) for op in ("dot.1", "fusion.2", "all-reduce.3", "while.4",
                                                               "copy.5")} == {
        "dot.1": profile.EXPERTS, "fusion.2": "router", "all-reduce.3": profile.COLLECTIVES,
        "while.4": profile.NO_SOURCE, "copy.5": profile.NO_SOURCE}
    assert profile.module_name(HLO) == "jit_step"


def test_self_times_subtract_nested_ops(tmp_path):
    """A while of 100 µs holding dot.1 (30) and fusion.2 (20) on one thread: the while's self time is 50;
    a second device's dot.1 (40) adds to it; another module's op and a non-op event are left out."""
    def op(name, ts, dur, tid, module="jit_step"):
        return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name,
                "args": {"hlo_op": name, "hlo_module": module}}

    events = [op("while.4", 0, 100, 1), op("dot.1", 10, 30, 1), op("fusion.2", 50, 20, 1), op("dot.1", 5, 40, 2),
              op("dot.1", 0, 500, 3, module="jit_other"), {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 900,
                                                           "name": "PjitFunction(step)"}]
    trace = tmp_path / "plugins" / "profile" / "run" / "host.trace.json.gz"
    trace.parent.mkdir(parents=True)
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    assert profile.trace_file(tmp_path) == trace
    times = profile.op_self_times(trace, "jit_step")
    assert times == {"while.4": 50.0, "dot.1": 70.0, "fusion.2": 20.0}
    result = profile.breakdown(times, profile.hlo_sources(HLO), steps=2)
    assert result["total_ms_per_step"] == pytest.approx(0.07)
    assert {n: ms for n, ms, _ in result["components"]} == pytest.approx(
        {profile.EXPERTS: 0.035, profile.NO_SOURCE: 0.025, "router": 0.01})
    assert "| moe experts | 0.035 | 50.0 |" in profile.markdown(result, top=2)


def test_a_profiled_step_sums_to_its_op_time(tmp_path):
    """The smoke shape's step on one device: the component shares sum to 100%, the attention and the
    routed experts are among them, and the op time is a real share of the wall time."""
    from composer_jax.bench.train_peer import SHAPES, Ours, one_document_rows, shape_config

    shape = SHAPES["tiny_quick"]
    cfg = shape_config(shape, tmp_path, settings=("train.num_devices=1",))
    ours = Ours(cfg, one_document_rows(shape.batch_size, shape.seq_len, cfg.model.vocab_size))
    try:
        ours()
        result = profile.profile(ours, ours.compiled().as_text(), 2, tmp_path / "trace")
    finally:
        ours.close()
    shares = {n: share for n, _, share in result["components"]}
    assert math.isclose(sum(shares.values()), 1.0, rel_tol=1e-9)
    assert shares["attention"] > 0 and shares[profile.EXPERTS] > 0 and shares["optimizer"] > 0
    assert shares.get(profile.NO_SOURCE, 0) < 0.5
    # XLA:CPU runs independent ops of a step at once, one per thread of its pool (one per core): their summed
    # time may exceed the step's wall time (147 ms against 137 once, on 2 cores), not the cores' time.
    cores = len(os.sched_getaffinity(0))
    assert 0.1 * result["wall_ms_per_step"] < result["total_ms_per_step"] <= 1.05 * cores * result["wall_ms_per_step"]

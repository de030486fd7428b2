"""Where a compiled program's time goes: XLA operations by self time from a `jax.profiler` trace,
grouped into model components by the Python source the HLO metadata records.

On CPU, jax writes `plugins/profile/<run>/<host>.trace.json.gz` beside the xplane; each executed
thunk is a complete event whose args name its `hlo_op` and `hlo_module`. An op's self time is its
duration less that of the op events nested in it on the same thread (a while loop's body). The
compiled HLO text maps each instruction to its `op_name` and a `stack_frame_id`, whose frames
(the text's FileNames / FunctionNames / FileLocations / StackFrames tables) are walked from the
innermost outward: the first function or file with a known component names it.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import re
import time
from pathlib import Path

import jax

# (component, function names, file name endings); the first match walking a stack outward wins.
COMPONENTS = (
    ("router", ("Router.__call__", "route", "update_biases", "updated_bias"), ("model/router.py",)),
    ("moe dispatch", (), ("model/dispatch.py", "model/expert_parallel.py")),
    ("mlp (dense layers, shared expert)", ("MLP.__call__",), ()),
    ("moe combine", ("MoE.__call__",), ("model/moe.py",)),
    ("attention", (), ("model/attention.py", "model/attention_ops.py", "model/attention_mask.py",
                       "model/rope.py", "model/blockwise.py")),
    ("norm", ("RMSNorm.__call__",), ()),
    ("embedding", ("Embed.__call__",), ()),
    ("cross-entropy (head + loss)", (), ("train/losses.py",)),
    ("optimizer", (), ("train/update.py", "train/optimizer.py", "parallel/leafwise.py")),
    ("resharding", (), ("parallel/mesh.py", "parallel/partitioning.py", "model/sequence.py")),
)
# The matmuls of the dispatch modules: the routed experts' weights (under `dense` dispatch also its
# one-hot combine, an einsum too).
EXPERTS = "moe experts"
# Cross-device operations, most inserted by the partitioner with a neighbour's metadata: their own group.
COLLECTIVES = "collectives"
COLLECTIVE_OPCODES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
                      "ragged-all-to-all")
NO_SOURCE = "other (no source)"

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"([a-z][\w\-]*)\(")     # the first `name(` after the shape
_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")


@dataclasses.dataclass(frozen=True)
class Source:
    op_name: str
    opcode: str
    frames: tuple        # ((file, function), ...) innermost first


def _tables(text: str) -> dict[str, dict[int, str]]:
    """The HLO text's source tables: {"FileNames": {id: row}, ...}."""
    tables, current = {}, None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and (m := _TABLE_ROW.match(line)):
            current[int(m.group(1))] = m.group(2)
        elif line.strip() == "":
            continue
        else:
            current = None
    return tables


def _field(row: str, key: str) -> int:
    return int(re.search(rf"{key}=(\d+)", row).group(1))


def stack_of(tables: dict, frame: int) -> tuple:
    """((file, function), ...) from `frame` outward. The text (jax 0.10.2's XLA) writes each frame's
    parent as its id + 1 (1: no parent): so read, the frames of a step chain from the model's innermost
    function out to the script that called the step."""
    files, functions = tables.get("FileNames", {}), tables.get("FunctionNames", {})
    locations, frames = tables.get("FileLocations", {}), tables.get("StackFrames", {})
    out, seen = [], set()
    while frame in frames and frame not in seen:
        seen.add(frame)
        location = locations[_field(frames[frame], "file_location_id")]
        out.append((files[_field(location, "file_name_id")].strip('"'),
                    functions[_field(location, "function_name_id")].strip('"')))
        frame = _field(frames[frame], "parent_frame_id") - 1
    return tuple(out)


def hlo_sources(text: str) -> dict[str, Source]:
    """{instruction name: its Source} for every instruction of the HLO text with metadata."""
    tables, out = _tables(text), {}
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m or "metadata={" not in line:
            continue
        meta = line[line.index("metadata={"):]
        op_name = re.search(r'op_name="([^"]*)"', meta)
        frame = re.search(r"stack_frame_id=(\d+)", meta)
        opcode = _OPCODE.search(m.group(2))
        out[m.group(1)] = Source(op_name.group(1) if op_name else "", opcode.group(1) if opcode else "",
                                 stack_of(tables, int(frame.group(1))) if frame else ())
    return out


def component(source: Source | None) -> str:
    """The model component an op belongs to (see COMPONENTS); the matmuls of the dispatch are EXPERTS."""
    if source is None:
        return NO_SOURCE
    if source.opcode.startswith(COLLECTIVE_OPCODES):
        return COLLECTIVES
    for file, function in source.frames:
        for name, functions, files in COMPONENTS:
            if function in functions or file.endswith(files):
                if name == "moe dispatch" and ("dot" in source.opcode or "dot_general" in source.op_name):
                    return EXPERTS
                return name
    return NO_SOURCE


def op_self_times(trace_file: Path, module: str) -> dict[str, float]:
    """{hlo op: self time in µs summed over all its executions (all devices)} of `module`'s ops."""
    with gzip.open(trace_file) as f:
        events = json.load(f)["traceEvents"]
    by_thread = collections.defaultdict(list)
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and args.get("hlo_module") == module and "hlo_op" in args:
            by_thread[(e["pid"], e["tid"])].append((float(e["ts"]), float(e.get("dur", 0.0)), args["hlo_op"]))
    totals = collections.Counter()
    for spans in by_thread.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_spans = []        # [end, name, nested ops' time, duration] of the enclosing ops
        for start, dur, name in spans:
            while open_spans and open_spans[-1][0] <= start:
                _close(open_spans.pop(), totals)
            if open_spans:
                open_spans[-1][2] += dur
            open_spans.append([start + dur, name, 0.0, dur])
        while open_spans:
            _close(open_spans.pop(), totals)
    return dict(totals)


def _close(span: list, totals: collections.Counter) -> None:
    _, name, children, dur = span
    totals[name] += max(dur - children, 0.0)


def module_name(text: str) -> str:
    """The HLO module's name (`HloModule jit_step, ...`): what the trace's events call it."""
    return re.match(r"HloModule ([\w.\-]+)", text).group(1)


def profile(step, compiled_text: str, steps: int, log_dir: Path) -> dict:
    """`breakdown` of `steps` calls of `step` (compiled already; each call's outputs waited for) traced
    into `log_dir`, with the median wall time of a step."""
    walls = []
    with jax.profiler.trace(str(log_dir)):
        for _ in range(steps):
            start = time.perf_counter()
            jax.block_until_ready(step())
            walls.append(time.perf_counter() - start)
    times = op_self_times(trace_file(log_dir), module_name(compiled_text))
    return {"steps": steps, "wall_ms_per_step": 1e3 * sorted(walls)[len(walls) // 2],
            **breakdown(times, hlo_sources(compiled_text), steps)}


def trace_file(log_dir: Path) -> Path:
    """The `.trace.json.gz` jax.profiler wrote under `log_dir` (the newest)."""
    found = sorted(Path(log_dir).glob("plugins/profile/*/*.trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"no plugins/profile/*/*.trace.json.gz under {log_dir}: did the profiler run?")
    return found[-1]


def breakdown(times: dict[str, float], sources: dict[str, Source], steps: int) -> dict:
    """{"components": [(name, ms per step, share)], "ops": [(op, component, ms per step, share, op_name)]},
    largest first; shares of the summed op self time."""
    total = sum(times.values()) or 1.0
    by_component = collections.Counter()
    ops = []
    for op, us in times.items():
        name = component(sources.get(op))
        by_component[name] += us
        ops.append((op, name, us / 1e3 / steps, us / total, sources[op].op_name if op in sources else ""))
    return {"total_ms_per_step": total / 1e3 / steps,
            "components": [(n, us / 1e3 / steps, us / total) for n, us in by_component.most_common()],
            "ops": sorted(ops, key=lambda o: -o[2])}


def markdown(result: dict, top: int) -> str:
    """The component table and the top-`top` ops table."""
    lines = ["| component | ms/step | % of op time |", "|---|---:|---:|"]
    lines += [f"| {n} | {ms:.3f} | {100 * share:.1f} |" for n, ms, share in result["components"]]
    lines += ["", "| op | component | ms/step | % | op_name |", "|---|---|---:|---:|---|"]
    for op, name, ms, share, op_name in result["ops"][:top]:
        shown = op_name if len(op_name) <= 90 else "..." + op_name[-87:]
        lines.append(f"| {op} | {name} | {ms:.3f} | {100 * share:.1f} | `{shown}` |")
    return "\n".join(lines)

"""What a compiled program's HLO text holds: its collectives (count and bytes per step, by kind and by the
mesh axes their device groups span) and its custom calls. Text only: the same reading for a CPU compile
and a deviceless GPU compile (`plan.gpu_compile`).

Per step: an instruction inside a while loop's body counts once per iteration where XLA knows the trip
count (`known_trip_count` in the loop's backend config; else once). Bytes are the collective's result
(per device: an all-gather's gathered output, a reduce-scatter's scattered one). Asynchronous pairs
count once, at their `-done` (whose result is the output); operations wrapped in an `async-start`
count in the computation it calls.

Device groups come in three spellings, all read: explicit (`{{0,1},{2,3}}`), iota
(`[2,4]<=[4,2]T(1,0)`) and named mesh axes (`mesh['a'=2,'b'=4] {'b'}`, with `device_ids=(...)`). A
group's span is named by the axes of a grid (`Grid`: axis names and sizes over the flat device order)
that vary inside it when the group is exactly one slice along them.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) \(")
_INSTR = re.compile(r"^\s+(?:ROOT )?%\S+ = (.+?) ([a-z][a-z0-9-]*)\(")
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_CALLED = re.compile(r"\b(?:body|calls|branch_computations|true_computation|false_computation)=\{?([^,}]+(?:,\s*%[^,}]+)*)\}?")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CUSTOM = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_KIND = re.compile(r'"kind":"(__[^"]+)"')


@dataclasses.dataclass(frozen=True)
class Grid:
    """A mesh over the program's devices in flat order (partition ids): `axes` and their `sizes`."""

    name: str
    axes: tuple[str, ...]
    sizes: tuple[int, ...]

    def span(self, group: np.ndarray) -> str | None:
        """'+'-joined axes that vary inside `group` (device ids) when it is one slice along them; None
        when it is no such slice. A group of one device spans ''."""
        coords = np.stack(np.unravel_index(np.asarray(group), self.sizes), axis=1)
        varying = [i for i in range(len(self.axes)) if len(set(coords[:, i])) > 1]
        if len(group) != math.prod(self.sizes[i] for i in varying):
            return None
        return "+".join(self.axes[i] for i in varying)


@dataclasses.dataclass
class Collective:
    count: float = 0          # per step
    bytes: float = 0          # per step and device


@dataclasses.dataclass
class HloSummary:
    """collectives[(kind, span)]: a Collective; custom_calls[target]: count in the program text."""

    collectives: dict[tuple[str, str], Collective]
    custom_calls: dict[str, int]

    def total(self, kind: str) -> Collective:
        out = Collective()
        for (k, _), c in self.collectives.items():
            if k == kind:
                out.count += c.count
                out.bytes += c.bytes
        return out


def shape_bytes(text: str) -> int:
    """Bytes of an HLO result shape (a tuple's leaves summed), e.g. '(f32[2,3]{1,0}, bf16[4])' -> 32."""
    return sum(DTYPE_BYTES.get(dtype, 0) * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in _SHAPE.findall(text))


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def device_groups(line: str, devices: int) -> np.ndarray:
    """int[groups, size]: the device groups of the collective on HLO `line` (all devices when none given)."""
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if m:                       # a permute: each pair is a group (the axes its hops cross)
        return np.array([[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", m[1] + "}")])
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        return _iota(m[3], m[4]).reshape(int(m[1]), int(m[2]))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}", line)
    if m:
        names = re.findall(r"'([^']+)'=(\d+)", m[1])
        shape = [int(s) for _, s in names]
        ids = (_iota(m[2], m[3]) if m[2] else np.arange(math.prod(shape))).reshape(shape)
        chosen = [i for i, (name, _) in enumerate(names) if f"'{name}'" in m[4]]
        rest = [i for i in range(len(shape)) if i not in chosen]
        return ids.transpose(rest + chosen).reshape(-1, math.prod(shape[i] for i in chosen))
    m = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)
    if m:
        return np.array([[int(x) for x in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", m[1])])
    return np.arange(devices)[None]


def _span(groups: np.ndarray, grids: tuple[Grid, ...]) -> str:
    """'grid:axes' of the first grid every group is a slice of, '|'-joined when several grids agree."""
    names = []
    for grid in grids:
        spans = {grid.span(g) for g in groups}
        if len(spans) == 1 and None not in spans:
            names.append(f"{grid.name}:{spans.pop() or '-'}")
    return "|".join(names) or "other"


def _computations(text: str) -> dict[str, list[str]]:
    out, name = {}, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            name = header[1]
            out[name] = []
        elif name is not None and line.startswith("  "):
            out[name].append(line)
    return out


def _multipliers(comps: dict[str, list[str]], entry: str) -> dict[str, float]:
    """Times each computation runs per execution of `entry` (loop bodies times their trip counts)."""
    times = {entry: 1.0}
    stack = [entry]
    while stack:
        name = stack.pop()
        for line in comps.get(name, ()):
            trip = _TRIP.search(line) if " while(" in line else None
            for called in _CALLED.findall(line):
                for callee in re.findall(r"%?([\w.\-]+)", called):
                    if callee in comps and callee not in times:
                        times[callee] = times[name] * (int(trip[1]) if trip else 1)
                        stack.append(callee)
    return times


def summarize(text: str, devices: int, grids: tuple[Grid, ...]) -> HloSummary:
    """Collectives and custom calls of the compiled HLO `text` of a program over `devices` partitions."""
    comps = _computations(text)
    entry = re.search(r"^ENTRY %(\S+) \(", text, re.M)
    times = _multipliers(comps, entry[1]) if entry else {}
    collectives: dict[tuple[str, str], Collective] = collections.defaultdict(Collective)
    custom = collections.Counter(_CUSTOM.findall(text)) + collections.Counter(_FUSION_KIND.findall(text))
    starts: dict[str, str] = {}
    for name, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            op = m[2]
            if op.endswith("-start") and op[:-6] in KINDS:
                starts[line.split("=")[0].strip().removeprefix("ROOT ").strip()] = line
                continue
            base = op[:-5] if op.endswith("-done") else op
            if base not in KINDS:
                continue
            source = line
            if op.endswith("-done"):   # its groups are on the matching start
                operand = re.search(r"-done\((%[^)\s,]+)", line)
                source = starts.get(operand[1], line) if operand else line
            entry_ = collectives[(base, _span(device_groups(source, devices), grids))]
            entry_.count += times.get(name, 1.0)
            entry_.bytes += times.get(name, 1.0) * shape_bytes(m[1])
    return HloSummary(dict(collectives), dict(custom))

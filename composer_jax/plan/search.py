"""The layout search of `composer-jax plan --search`: every combination of the dense grid (replica x fsdp x
cp), the expert grid (ereplica x efsdp x ep), the MoE dispatch, the remat policy, the micro-batches and
Muon's Newton-Schulz dtype that the run can take, planned (`plan_train`) and timed (`plan.timing`);
keys set on the command line stay as they are. Layouts that fit rank by their estimated step time."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

from composer_jax.config import ConfigError, MeshConfig
from composer_jax.parallel.mesh import resolve_sizes
from composer_jax.plan.memory import MemoryPlan, plan_train
from composer_jax.plan.report import fits
from composer_jax.plan.timing import Hardware, StepTime, step_time
from composer_jax.train.config import RunConfig

MESH_KEYS = ("mesh.replica", "mesh.fsdp", "mesh.cp", "mesh.ereplica", "mesh.efsdp", "mesh.ep")
SEARCH_KEYS = (*MESH_KEYS, "model.moe.dispatch", "train.remat", "train.grad_accum", "optimizer.ns_dtype")
EFSDP = (1, 2, 4, 8)             # expert-FSDP sizes tried (beyond these the gathers dominate)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One searched layout: its settings (dotted keys), its plan and its estimated step time."""

    settings: dict[str, object]
    plan: MemoryPlan
    time: StepTime
    fits: bool

    def overrides(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.settings.items())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _grids(cfg: RunConfig, devices: int, fixed: set[str]) -> Iterator[dict[str, int]]:
    """Resolved axis sizes of every dense x expert grid over `devices` consistent with the `fixed` mesh
    keys (those keep the config's values), the sequence (cp) and the experts (ep) allow."""
    experts, seq = cfg.model.moe.n_routed_experts, cfg.train.seq_len
    seen = set()
    for cp in _divisors(devices):
        if cp > 1 and seq % (2 * cp):
            continue
        for replica, ep in itertools.product(_divisors(devices // cp), _divisors(devices)):
            if experts % ep:
                continue
            for efsdp in EFSDP:
                if (devices // ep) % efsdp or cfg.model.hidden_size % efsdp:
                    continue
                free = {"replica": replica, "fsdp": devices // (replica * cp), "cp": cp,
                        "ereplica": devices // (ep * efsdp), "efsdp": efsdp, "ep": ep}
                mesh = {a: getattr(cfg.mesh, a) if f"mesh.{a}" in fixed else v for a, v in free.items()}
                try:
                    sizes = resolve_sizes(MeshConfig(**mesh), devices, experts)
                except ConfigError:
                    continue
                key = tuple(sizes.values())
                if key not in seen and experts % sizes["ep"] == 0:
                    seen.add(key)
                    yield sizes


def candidate_settings(cfg: RunConfig, devices: int, fixed: set[str], platform: str) -> Iterator[dict[str, object]]:
    """Every setting of SEARCH_KEYS the run can take on `devices` (module docstring); a key in `fixed`
    keeps the config's value."""
    batch = cfg.train.batch_size
    for sizes in _grids(cfg, devices, fixed):
        ep = sizes["ep"]
        dispatches = ["ragged"] + (["ep_a2a"] + (["ep_ragged"] if platform == "gpu" else []) if ep > 1 else [])
        data = sizes["replica"] * sizes["fsdp"]
        accums = [g for g in _divisors(batch) if (batch // g) % data == 0]
        options = {
            "model.moe.dispatch": dispatches,
            "train.remat": ["none", "dots", "full"],
            "train.grad_accum": accums,
        }
        if cfg.optimizer.name == "muon":    # Newton-Schulz runs only under Muon
            options["optimizer.ns_dtype"] = ["float32", "bfloat16"]
        current = {"model.moe.dispatch": cfg.model.moe.dispatch, "train.remat": cfg.train.remat,
                   "train.grad_accum": cfg.train.grad_accum, "optimizer.ns_dtype": cfg.optimizer.ns_dtype}
        choices = [[current[k]] if k in fixed else v for k, v in options.items()]
        for values in itertools.product(*choices):
            yield {**{f"mesh.{a}": sizes[a] for a in ("replica", "fsdp", "cp", "ereplica", "efsdp", "ep")},
                   **dict(zip(options, values))}


def with_settings(cfg: RunConfig, settings: dict[str, object]) -> RunConfig:
    """`cfg` with a candidate's settings (SEARCH_KEYS, each valid by construction: no re-validation)."""
    mesh = MeshConfig(**{k.removeprefix("mesh."): settings[k] for k in MESH_KEYS})
    moe = dataclasses.replace(cfg.model.moe, dispatch=settings["model.moe.dispatch"])
    train = dataclasses.replace(cfg.train, remat=settings["train.remat"], grad_accum=settings["train.grad_accum"])
    optimizer = dataclasses.replace(cfg.optimizer, ns_dtype=settings.get("optimizer.ns_dtype", cfg.optimizer.ns_dtype))
    return dataclasses.replace(cfg, mesh=mesh, model=dataclasses.replace(cfg.model, moe=moe), train=train,
                               optimizer=optimizer)


def search(cfg: RunConfig, devices: int, hw: Hardware, *, fixed: set[str] = frozenset(), platform: str = "gpu",
           attention: str | None = None, grouped_matmul: str | None = None) -> list[Candidate]:
    """Every candidate layout planned and timed: those that fit first, fastest first, then the rest by
    memory. `fixed`: dotted keys that keep the config's value."""
    out = []
    for settings in candidate_settings(cfg, devices, set(fixed), platform):
        try:
            layout = with_settings(cfg, settings)
            plan = plan_train(layout, devices, attention=attention, grouped_matmul=grouped_matmul, platform=platform)
        except ConfigError:      # a combination the run cannot take (e.g. the micro-batch over the data axes)
            continue
        time = step_time(layout, plan, hw)
        out.append(Candidate(settings, plan, time, fits(plan.total, hw.hbm_gb)))
    return sorted(out, key=lambda c: (not c.fits, c.time.total_s if c.fits else c.plan.total, c.plan.total))


def changed(cfg: RunConfig, candidate: Candidate) -> dict[str, object]:
    """The candidate's settings that differ from `cfg`'s on the same devices (what to pass on the command
    line to get it)."""
    try:
        sizes = resolve_sizes(cfg.mesh, candidate.plan.devices, cfg.model.moe.n_routed_experts)
    except ConfigError:
        sizes = {key.removeprefix("mesh."): getattr(cfg.mesh, key.removeprefix("mesh.")) for key in MESH_KEYS}
    now = {**{f"mesh.{a}": v for a, v in sizes.items()}, "model.moe.dispatch": cfg.model.moe.dispatch,
           "train.remat": cfg.train.remat, "train.grad_accum": cfg.train.grad_accum,
           "optimizer.ns_dtype": cfg.optimizer.ns_dtype}
    return {k: v for k, v in candidate.settings.items() if now[k] != v}


def best_fitting(cfg: RunConfig, devices: int, hw: Hardware, fixed: set[str], searched: list[Candidate] | None = None,
                 **options) -> tuple[Candidate | None, list[Candidate]]:
    """(the fastest layout that fits, keeping the `fixed` keys, else keeping none; or None) and the
    candidates searched last (the smallest first when none fits). `searched`: the search keeping `fixed`,
    when it has run already."""
    candidates = search(cfg, devices, hw, fixed=fixed, **options) if searched is None else searched
    if fixed and not any(c.fits for c in candidates):
        candidates = search(cfg, devices, hw, **options)
    return (candidates[0] if candidates and candidates[0].fits else None), candidates


def largest_term(plan: MemoryPlan) -> tuple[str, int]:
    """The plan's largest part and its bytes: a state term, or the tensor that dominates the activations or
    temporaries (plan.where)."""
    terms = {"parameters": plan.params, "optimizer state": plan.optimizer, "gradients": plan.gradients}
    for kind in ("activations", "temporaries"):
        for name, size in plan.where[kind].items():
            terms[f"{kind}: {name}"] = size
    name = max(terms, key=terms.get)
    return name, terms[name]

"""What `composer-jax plan` reports for a run config on N devices: the training and RL steps' plans, the
host peak of loading train.init_from, Muon's Newton-Schulz share, and verdicts per layout and sequence
length against a device's memory. All from the config: no devices, nothing allocated."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from composer_jax.config import ConfigError, MeshConfig
from composer_jax.parallel.mesh import largest_ep
from composer_jax.plan.loading import LoadingPeak, loading_peak
from composer_jax.plan.memory import MemoryPlan, layout_sizes, plan_train
from composer_jax.plan.muon import NSShare, ns_share
from composer_jax.plan.rl import plan_rl
from composer_jax.rl.config import RLConfig
from composer_jax.train.config import RunConfig

MEM_FRACTION = 0.9        # XLA_PYTHON_CLIENT_MEM_FRACTION: what JAX may take (shared/reference/performance.md 3)
CONTEXT_PARALLEL = (1, 2, 4, 8, 16, 32, 64)     # the context-parallel sizes of the candidate layouts


def fits(total: float, hbm_gb: float) -> bool:
    """`total` bytes fit in the share of `hbm_gb` GB that JAX may take."""
    return total <= hbm_gb * 1e9 * MEM_FRACTION


def load_plan_config(name: str, overrides) -> RunConfig:
    """A RunConfig: a run config with overrides, or a model config with default run settings (then the
    overrides are run-config keys: model.moe.dispatch=ep_a2a, train.remat=full, mesh.cp=2)."""
    from composer_jax.config import (
        apply_overrides,
        command_line_overrides,
        from_dict,
        override_origin,
        read_yaml,
        resolve_config_path,
    )
    from composer_jax.train.config import is_run_config, load_run_config

    if is_run_config(name):
        return load_run_config(name, overrides)
    path = resolve_config_path(name, kind="model")
    try:
        return from_dict(RunConfig, apply_overrides(RunConfig, {"model": read_yaml(path)}, overrides))
    except ConfigError as e:
        raise override_origin(e, path, command_line_overrides(overrides)) from None


def candidate_layouts(cfg: RunConfig, devices: int) -> list[MeshConfig]:
    """Layouts to judge when none is given: context parallelism 1, 2, 4, ... 64 with FSDP over the rest
    of the devices, experts on the widest expert-parallel axis that divides both the experts and the
    devices (replicated over the remainder)."""
    ep = largest_ep(devices, cfg.model.moe.n_routed_experts)
    return [MeshConfig(fsdp=devices // cp, cp=cp, ereplica=devices // ep, ep=ep)
            for cp in CONTEXT_PARALLEL if cp <= devices and devices % cp == 0]


def run_rl_config(cfg: RunConfig) -> RLConfig:
    """The RL step with the run's optimizer, remat policy, loss chunk and micro-batches."""
    tc = cfg.train
    return RLConfig(optimizer=cfg.optimizer, remat=tc.remat, loss_chunk=tc.loss_chunk,
                    micro_batch=tc.batch_size // tc.grad_accum if tc.grad_accum > 1 else 0)


@dataclasses.dataclass(frozen=True)
class Loading:
    """The host peak of streaming train.init_from's weights onto the layout."""

    source: str
    description: str
    quantized: bool           # INT4 / FP8 blocks, dequantized to float32 as read
    devices_per_host: int
    peak: LoadingPeak

    def to_dict(self) -> dict:
        return {"source": self.source, "devices_per_host": self.devices_per_host, **self.peak.to_dict()}


def plan_loading(cfg: RunConfig, sizes: dict, devices_per_host: int) -> Loading:
    import numpy as np

    from composer_jax.model_dirs import open_source

    source = open_source(cfg.train.init_from, need_weights=False)    # its config and index: nothing is read
    itemsize = 4 if source.quantized else np.dtype(source.model.param_dtype).itemsize
    return Loading(str(source.path), source.description, source.quantized, devices_per_host,
                   loading_peak(cfg.model, sizes, devices_per_host, itemsize))


@dataclasses.dataclass(frozen=True)
class LayoutVerdicts:
    """One layout's training step per sequence length (`plans[i]` for seq_lens[i]: a plan, or the reason it
    has none); `error`: why the layout itself does not apply (then no plans)."""

    mesh: MeshConfig
    sizes: dict | None
    plans: list[MemoryPlan | str]
    error: str | None = None


def layout_verdicts(cfg: RunConfig, devices: int, seq_lens: Sequence[int], layouts: Sequence[MeshConfig],
                    **options) -> list[LayoutVerdicts]:
    """The training step per layout and sequence length: one sequence per data-parallel shard, no
    gradient accumulation; `options` as `plan_train` takes them."""
    out = []
    for mesh in layouts:
        layout_cfg = dataclasses.replace(cfg, mesh=mesh)
        try:
            sizes = layout_sizes(layout_cfg, devices)
        except ConfigError as e:
            out.append(LayoutVerdicts(mesh, None, [], str(e)))
            continue
        plans = []
        for seq in seq_lens:
            try:
                train = dataclasses.replace(cfg.train, batch_size=sizes["replica"] * sizes["fsdp"], grad_accum=1,
                                            seq_len=seq)
                plans.append(plan_train(dataclasses.replace(layout_cfg, train=train), devices, **options))
            except ConfigError as e:
                plans.append(str(e))
        out.append(LayoutVerdicts(mesh, sizes, plans))
    return out


@dataclasses.dataclass(frozen=True)
class PlanReport:
    train: MemoryPlan
    rl: MemoryPlan | None
    rl_error: str | None                # why the RL step has no plan on this layout
    loading: Loading | None             # with train.init_from
    muon: NSShare | None                # with the Muon optimizer
    seq_lens: list[int]
    verdicts: list[LayoutVerdicts]      # with seq_lens or layouts asked for

    def to_dict(self, hbm_gb: float) -> dict:
        out = {"hbm_gb": hbm_gb, "mem_fraction": MEM_FRACTION,
               "plans": [p.to_dict() for p in (self.train, self.rl) if p is not None]}
        if self.loading is not None:
            out["loading"] = self.loading.to_dict()
        if self.muon is not None:
            out["muon_ns"] = dataclasses.asdict(self.muon) | {"ratio": self.muon.ratio}
        if self.verdicts:
            out["verdicts"] = [
                {"layout": v.sizes, "seq": seq, "error": p} if isinstance(p, str) else
                {"layout": v.sizes, "seq": seq, "total": p.total, "fits": fits(p.total, hbm_gb), "plan": p.to_dict()}
                for v in self.verdicts if v.error is None for seq, p in zip(self.seq_lens, v.plans)]
        return out


def plan_report(cfg: RunConfig, devices: int, *, rl_slots: int, rl_window: int, devices_per_host: int,
                seq_lens: Sequence[int] = (), layouts: Sequence[MeshConfig] = (), **options) -> PlanReport:
    """Everything `composer-jax plan` shows (see the module docstring). The RL step: cfg.train's rows and
    sequence length with `rl_slots` feedback windows of `rl_window` tokens (at most the sequence length);
    verdicts (with `seq_lens` or `layouts`): per layout (default: `candidate_layouts`) and sequence length
    (default: train.seq_len); `options` as `plan_train` takes them."""
    train = plan_train(cfg, devices, **options)
    try:
        rl, rl_error = plan_rl(cfg, run_rl_config(cfg), devices, rows=cfg.train.batch_size, seq=cfg.train.seq_len,
                               slots=rl_slots, window=min(rl_window, cfg.train.seq_len), **options), None
    except ConfigError as e:   # a layout the RL step cannot take: the training plan stands alone
        rl, rl_error = None, str(e)
    loading = plan_loading(cfg, train.sizes, min(devices, devices_per_host)) if cfg.train.init_from else None
    muon = (ns_share(cfg.model, train.sizes, ns_dtype=cfg.optimizer.ns_dtype) if cfg.optimizer.name == "muon"
            else None)
    judged = list(seq_lens or [cfg.train.seq_len])
    verdicts = []
    if seq_lens or layouts:
        verdicts = layout_verdicts(cfg, devices, judged, layouts or candidate_layouts(cfg, devices), **options)
    return PlanReport(train, rl, rl_error, loading, muon, judged, verdicts)

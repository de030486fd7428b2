"""The training and RL steps compiled (never run) for a GPU cluster on a machine without a GPU: XLA's GPU
compiler builds them for a topology of H100s or H200s described by a target config (deviceless AOT),
and each program's memory analysis is set beside the planner's estimate, with its collectives (count
and bytes per step, by the grid axes they span: `plan.hlo`) and custom calls (cuDNN attention, ...).

Needs the `cuda12` extra (the CUDA PJRT plugin, whose compiler this is, and cuDNN, whose attention
custom calls JAX checks for while tracing); the process itself stays on CPU (JAX_PLATFORMS=cpu) and
the plugin's driver check is skipped (there is no driver). XLA's cost analysis gives no FLOPs for a
deviceless GPU compile (None on jax 0.10.2), so the FLOPs column is the model's alone.

The target configs (`GpuTargetConfig` protos as text): the H100's is the one published in jax issue
28376 (an H100 80GB HBM3's `xc.get_topology_for_devices(...).target_config`); the H200's is that with
the H200's memory (143771 MiB, as nvidia-smi reports it) and bandwidth (4.8 TB/s, the datasheet's):
both chips are compute capability 9.0 with 132 SMs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

from composer_jax.config import ConfigError
from composer_jax.plan import hlo
from composer_jax.plan.memory import MemoryPlan, plan_train
from composer_jax.plan.report import run_rl_config
from composer_jax.plan.rl import plan_rl
from composer_jax.train.config import RunConfig

EXTRA = "pip install -e '.[cuda12]'"
_H100 = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth} l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }} registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
device_description_str: "{name}"
"""
GPUS = {   # name -> (device_memory_size bytes, memory_bandwidth bytes/s, device description)
    "h100": (84929347584, 3352320000000, "NVIDIA H100 80GB HBM3"),
    "h200": (143771 * 2**20, 4800000000000, "NVIDIA H200"),
}


def target_config(gpu: str) -> str:
    """The GpuTargetConfig text of `gpu` (h100 or h200)."""
    if gpu not in GPUS:
        raise ConfigError("--compile-for", f"unknown GPU {gpu!r}; expected one of {', '.join(GPUS)}")
    memory, bandwidth, name = GPUS[gpu]
    return _H100.format(memory=memory, bandwidth=bandwidth, name=name)


def gpu_devices(gpu: str, hosts: int, per_host: int) -> list:
    """The compile-only devices of `hosts` hosts of `per_host` GPUs each (no GPU needed). ConfigError
    naming the extra when the CUDA plugin is not installed."""
    if importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        raise ConfigError("--compile-for", f"compiling for {gpu} needs the CUDA compiler plugin: {EXTRA}")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")   # its check calls cuInit: no driver here
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=target_config(gpu),
                                            topology=f"{hosts}x1x{per_host}")
    return sorted(topology.devices, key=lambda d: d.id)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One program built for the topology: XLA's per-device memory, the planner's, and its HLO summary."""

    name: str
    argument: int
    output: int
    alias: int
    temp: int
    plans: dict[str, MemoryPlan]       # grouped matmul ('expanded', 'kernel') -> the planner's estimate
    summary: hlo.HloSummary
    model_flops: float                 # per device and step (model_info's count)
    note: str = ""                     # how the build departs from XLA's defaults ('' when it does not)

    @property
    def total(self) -> int:
        return self.argument + self.output - self.alias + self.temp

    def ratios(self) -> dict[str, float]:
        """Planner / compiled, per way ragged_dot may run."""
        return {how: plan.total / self.total for how, plan in self.plans.items()}


def grids(dual) -> tuple[hlo.Grid, ...]:
    """The dense and expert meshes as `hlo.Grid`s over the flat device order (partition ids)."""
    return tuple(hlo.Grid(name, tuple(mesh.axis_names), tuple(mesh.devices.shape))
                 for name, mesh in (("dense", dual.dense), ("expert", dual.expert)))


def _build(lowered):
    """(XLA's executable, a note). XLA's GPU compiler tiles its Triton GEMM fusions by autotuning on the
    device; deviceless it takes default tilings, and for some small GEMMs it finds none that fits
    ("Couldn't find output tile sizes", seen with cuDNN attention and the dense dispatch): such a
    program is built with cuBLAS for its GEMMs instead, and the note says so."""
    import jax

    try:
        return lowered.compile(), ""
    except jax.errors.JaxRuntimeError as e:
        if "tile sizes" not in str(e):
            raise
        return (lowered.compile(compiler_options={"xla_gpu_enable_triton_gemm": False}),
                "GEMMs by cuBLAS: XLA found no default Triton tiling for one without a device to autotune on")


def _compile(name: str, lowered, dual, plans: dict, model_flops: float) -> Compiled:
    compiled, note = _build(lowered)
    m = compiled.memory_analysis()
    summary = hlo.summarize(compiled.as_text(), dual.dense.devices.size, grids(dual))
    return Compiled(name, m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                    m.temp_size_in_bytes, plans, summary, model_flops, note)


def _model_flops(cfg: RunConfig, rows: int, seq: int, devices: int) -> float:
    from composer_jax.model.accounting import model_info

    return model_info(cfg.model, seq).flops.total * rows * seq / devices


def compile_train(cfg: RunConfig, devices: list) -> Compiled:
    """The training step of `cfg` on the dual grid over `devices` (a GPU topology's)."""
    from composer_jax.train.loop import make_mesh
    from composer_jax.train.step import lower_train_step

    dual = make_mesh(cfg, devices)
    lowered = lower_train_step(cfg, dual)
    n = len(devices)
    plans = {how: plan_train(cfg, n, grouped_matmul=how, platform="gpu") for how in ("expanded", "kernel")}
    return _compile("train", lowered, dual, plans, _model_flops(cfg, cfg.train.batch_size, cfg.train.seq_len, n))


def rl_batch(dual, rows: int, seq: int, slots: int, window: int):
    """The RL step's batch as ShapeDtypeStructs, rows over the dense mesh's data axes (rl/ingest.py)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from composer_jax.parallel.mesh import BATCH_AXES
    from composer_jax.rl.batch import RolloutBatch

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(dual.dense, P(BATCH_AXES, *[None] * (len(shape) - 1))))

    per_token = lambda dtype: spec((rows, seq), dtype)  # noqa: E731
    teacher = (spec((rows, slots, window), jnp.int32), spec((rows, slots, window), jnp.int32)) if slots else (None, None)
    return RolloutBatch(per_token(jnp.int32), per_token(jnp.int32), per_token(jnp.int32), per_token(jnp.bool_),
                        per_token(jnp.float32), spec((rows,), jnp.float32), spec((rows,), jnp.int32), None, *teacher)


def compile_rl(cfg: RunConfig, devices: list, slots: int, window: int) -> Compiled:
    """The fused RL step (the run's optimizer, remat, micro-batches; `slots` feedback windows of `window`
    tokens per row) over cfg.train's rows and sequence length on `devices`."""
    import jax

    from composer_jax.rl.step import make_step
    from composer_jax.train.loop import make_mesh
    from composer_jax.train.state import StateLayout

    rows, seq, n = cfg.train.batch_size, cfg.train.seq_len, len(devices)
    rl = run_rl_config(cfg)
    rl = dataclasses.replace(rl, group_size=max(2, math.gcd(rows, rl.group_size)))
    plans = {how: plan_rl(cfg, rl, n, rows=rows, seq=seq, slots=slots, window=window, grouped_matmul=how)
             for how in ("expanded", "kernel")}
    dual = make_mesh(cfg, devices)
    layout = StateLayout(cfg, dual)
    with dual:
        step = jax.jit(make_step(layout.graphdef, layout.rest, rl, layout.opt), donate_argnums=0)
        lowered = step.lower(layout.abstract, rl_batch(dual, rows, seq, slots, window))
    return _compile("rl", lowered, dual, plans, _model_flops(cfg, rows, seq, n))


def _engine_inputs(cfg: RunConfig, dual, slots: int, max_len: int):
    """ShapeDtypeStructs of the engine's graphdef and parameters (the inference placement), its cache and
    a function placing per-slot arrays (infer/engine.py's placement)."""
    import jax
    from flax import nnx

    from composer_jax.infer.cache import cache_shapes
    from composer_jax.model.transformer import CausalLM
    from composer_jax.parallel.partitioning import inference_batch_sharding, param_shardings

    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg.model, rngs=nnx.Rngs(0), mesh=dual)))
    placed = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          nnx.to_pure_dict(state), nnx.to_pure_dict(param_shardings(state, dual)))
    nnx.replace_by_pure_dict(state, placed)

    def per_slot(shape, dtype, batch_dim: int = 0):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=inference_batch_sharding(dual, shape, batch_dim))

    cache = jax.tree.map(lambda x: per_slot(x.shape, x.dtype, int(x.ndim == 4)), cache_shapes(cfg.model, slots, max_len))
    return graphdef, state, cache, per_slot


def compile_engine(cfg: RunConfig, devices: list, *, slots: int, max_len: int, chunk: int,
                   steps: int) -> list[Compiled]:
    """The engine's programs (infer/programs.py, plain decoding) on `devices` with the inference
    placement: one prefill chunk of `chunk` tokens per slot and one call of `steps` decode steps, for
    `slots` slots of `max_len` cached positions, attending to all of them."""
    import jax.numpy as jnp

    from composer_jax.infer import programs
    from composer_jax.infer.sampling import SlotSampling
    from composer_jax.train.loop import make_mesh

    dual = make_mesh(cfg, devices).for_inference()
    graphdef, state, cache, per_slot = _engine_inputs(cfg, dual, slots, max_len)
    vector = lambda dtype: per_slot((slots,), dtype)  # noqa: E731
    sampling = SlotSampling(vector(jnp.float32), vector(jnp.float32), vector(jnp.int32), vector(jnp.uint32))
    built = programs.for_platform("gpu")
    with dual:
        prefill = built.prefill.lower(graphdef, state, cache, vector(jnp.int32), per_slot((slots, chunk), jnp.int32),
                                      vector(jnp.int32), per_slot((slots, 1), jnp.int32), vector(jnp.bool_),
                                      sampling, max_len)
        decode = built.decode.lower(graphdef, state, cache, programs.Slots(
            vector(jnp.int32), vector(jnp.int32), vector(jnp.bool_), vector(jnp.int32),
            per_slot((slots, 8), jnp.int32), sampling), steps, max_len)
    from composer_jax.model.accounting import model_info

    # the main model's forward (a third of its training FLOPs per token) at the attended length
    forward = model_info(cfg.model, max_len).flops.main / 3 / len(devices)
    return [_compile(f"prefill ({slots} slots x {chunk} tokens)", prefill, dual, {}, forward * slots * chunk),
            _compile(f"decode ({slots} slots, {steps} steps)", decode, dual, {}, forward * slots * steps)]


def compile_for(cfg: RunConfig, gpu: str, devices: int, hosts: int, *, slots: int, window: int,
                engine: dict | None = None) -> list[Compiled | str]:
    """The training and RL steps of `cfg` built for `hosts` hosts of `gpu`s, `devices` in all, and with
    `engine` (compile_engine's keywords) the engine's prefill and decode; a program the layout cannot
    take is the reason it has none (a string)."""
    if devices % hosts:
        raise ConfigError("--hosts", f"{hosts} hosts do not split {devices} devices evenly")
    topology = gpu_devices(gpu, hosts, devices // hosts)
    out: list[Compiled | str] = [compile_train(cfg, topology)]
    try:
        out.append(compile_rl(cfg, topology, slots, min(window, cfg.train.seq_len)))
    except ConfigError as e:
        out.append(f"rl: {e}")
    if engine is not None:
        try:
            out.extend(compile_engine(cfg, topology, **engine))
        except ConfigError as e:
            out.append(f"engine: {e}")
    return out

"""The plan of an RL deployment: a learner on N devices (its RL step: `plan.rl`) and `engines` rollout
engines of M devices each, with the memory of an engine and the traffic of each weight version. From
the config alone: no devices, nothing allocated.

An engine, per device (the inference placement, `parallel.partitioning.spec_for(inference=True)`, on the
default grid of its M devices: dense weights replicated, routed experts over ep):
- parameters: each leaf's shard in the model's parameter dtype; with INT4 engines the routed experts as
  K2.5 stores them (`model.quant.Int4Matrix`: 4 bits a weight in int32 words, a bfloat16 scale per 32
  inputs: 9/16 byte a weight);
- the latent cache: slots x max_len x latent bytes per token, the slots split over the devices where
  they divide;
- with INT4, one layer's local expert stack dequantized for the expert-parallel dispatch (the only
  temporary counted: a decode step's activations are small beside it).
An engine process starts over an abstract model and drops the version it serves before it reads the
next (`Engine.release_weights`, between batches), so its parameters count once; an in-process engine
(`rollout.transport=thread`) holds the learner's snapshot beside them (`swapping`).

A version (`rl.engines.offered_weights`): the learner's parameters, with INT4 engines the routed experts
quantized learner-side on the learner's own shards, so a version moves as INT4. Every engine reads all of
it; each learner process writes or serves only its own shards (`rollout.weight_transfer=file`: a host
buffers at most its devices' shards of the version on their way to the files; `device`: a learner device
holds a copy of its share of the newest KEEP_VERSIONS versions, and while engines pull a version the
transfer server may copy what it sends, one share more). Seconds per version at a
stated bandwidth per device: an engine takes it in over its M devices' links while the learner sends it
`engines` times over its N devices' links; the slower side sets the time.
"""

from __future__ import annotations

import dataclasses
import math

from composer_jax.config import INT4_GROUP, MeshConfig, ModelConfig
from composer_jax.infer.cache import latent_bytes_per_token
from composer_jax.model.moe import ROUTED_EXPERTS
from composer_jax.parallel.mesh import check_model, resolve_sizes
from composer_jax.parallel.partitioning import spec_for
from composer_jax.plan.state import described_leaves, shard_shape
from composer_jax.rl.exchange.transport_device import KEEP_VERSIONS

INT4_BYTES_PER_WEIGHT = 0.5 + 2 / INT4_GROUP    # a nibble, and a bfloat16 scale per group


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """One engine's bytes per device."""

    devices: int
    weights: str                  # 'int4' or the parameter dtype
    sizes: dict[str, int]         # the engine's grid
    dense_params: int             # replicated weights (and router biases)
    routed_params: int            # this device's routed experts
    cache: int
    dequantized_layer: int        # INT4: one layer's local experts in the compute dtype

    @property
    def params(self) -> int:
        return self.dense_params + self.routed_params

    @property
    def total(self) -> int:
        """An engine process at its peak: the parameters, the cache and the dequantized layer."""
        return self.params + self.cache + self.dequantized_layer

    @property
    def swapping(self) -> int:
        """An in-process engine taking a version: a second copy of the parameters beside `total`."""
        return self.total + self.params


@dataclasses.dataclass(frozen=True)
class VersionTraffic:
    """What one weight version moves."""

    bytes: int                    # the whole version, as offered (each engine reads all of it)
    routed_bytes: int             # of which the routed experts
    learner_host_buffer: int      # a learner host's share of the version (its devices' shards)
    learner_device_held: int      # weight_transfer=device: a learner device's copies of its share, while one is sent
    bandwidth: float              # bytes/s per device and direction
    engine_s: float               # an engine taking it in over its devices' links
    learner_s: float              # the learner sending it to every engine over its devices' links

    @property
    def seconds(self) -> float:
        return max(self.engine_s, self.learner_s)


@dataclasses.dataclass(frozen=True)
class Deployment:
    engine: EnginePlan
    engines: int
    traffic: VersionTraffic

    def to_dict(self) -> dict:
        return {"engines": self.engines, "engine": {**dataclasses.asdict(self.engine), "params": self.engine.params,
                                                    "total": self.engine.total, "swapping": self.engine.swapping},
                "version": {**dataclasses.asdict(self.traffic), "seconds": self.traffic.seconds}}


def _bytes(elements: int, itemsize: int, int4: bool) -> int:
    """Bytes of `elements` weights of a routed expert stack: INT4 (words and scales) or `itemsize` each."""
    return math.ceil(elements * (INT4_BYTES_PER_WEIGHT if int4 else itemsize))


def _routed(leaf, axes: tuple[str, ...]) -> bool:
    """A MoE layer's routed expert stack (not the router, its bias or the shared expert)."""
    return leaf.path[-1] in ROUTED_EXPERTS and "experts" in axes


def plan_engine(model: ModelConfig, devices: int, *, int4: bool, slots: int, max_len: int) -> EnginePlan:
    """Bytes per device of an engine of `model` on `devices` devices serving `slots` sequences of `max_len`."""
    sizes = resolve_sizes(MeshConfig(), devices, model.moe.n_routed_experts)
    check_model(sizes, model)
    dense = routed = layer_experts = 0
    for leaf, itemsize, axes, _, _ in described_leaves(model):
        local = shard_shape(leaf.shape, spec_for(axes, leaf.shape, sizes, inference=True), sizes)
        if _routed(leaf, axes):
            routed += _bytes(math.prod(local), itemsize, int4)
            if leaf.path[0] == "moe_layers":       # [layers, local experts, in, out]: one layer's
                layer_experts += math.prod(local[1:])
        else:
            dense += math.prod(local) * itemsize
    data = sizes["replica"] * sizes["fsdp"]           # the slots split over the data axes where they divide
    cache = slots * max_len * latent_bytes_per_token(model) // (data if slots % data == 0 else 1)
    compute = 4 if model.dtype == "float32" else 2
    dequantized = layer_experts * compute if int4 else 0
    return EnginePlan(devices, "int4" if int4 else model.param_dtype, sizes, dense, routed, cache, dequantized)


def version_traffic(model: ModelConfig, *, int4: bool, learner_devices: int, devices_per_host: int, engines: int,
                    engine_devices: int, bandwidth: float) -> VersionTraffic:
    """The bytes of one version as offered, a learner host's share, and the seconds it takes to move."""
    total = routed = 0
    for leaf, itemsize, axes, _, _ in described_leaves(model):
        size = math.prod(leaf.shape)
        if _routed(leaf, axes):
            part = _bytes(size, itemsize, int4)
            routed += part
            total += part
        else:
            total += size * itemsize
    host_share = total * min(devices_per_host, learner_devices) // learner_devices
    held = (KEEP_VERSIONS + 1) * math.ceil(total / learner_devices)
    return VersionTraffic(total, routed, host_share, held, bandwidth, total / (engine_devices * bandwidth),
                          engines * total / (learner_devices * bandwidth))


def learner_quantizing(model: ModelConfig, sizes: dict[str, int]) -> int:
    """Bytes a learner device adds while it quantizes a version for INT4 engines (between steps): the INT4
    copy of its routed expert shards, and one expert stack's shard in float32 (the quantizer's working
    copy, one stack at a time)."""
    held = largest = 0
    for leaf, _, axes, _, _ in described_leaves(model):
        if _routed(leaf, axes):
            elements = math.prod(shard_shape(leaf.shape, spec_for(axes, leaf.shape, sizes), sizes))
            held += _bytes(elements, 0, True)
            largest = max(largest, 4 * elements)
    return held + largest


def plan_deployment(model: ModelConfig, *, learner_devices: int, devices_per_host: int, engines: int,
                    engine_devices: int, int4: bool, slots: int, max_len: int, bandwidth: float) -> Deployment:
    engine = plan_engine(model, engine_devices, int4=int4, slots=slots, max_len=max_len)
    traffic = version_traffic(model, int4=int4, learner_devices=learner_devices, devices_per_host=devices_per_host,
                              engines=engines, engine_devices=engine_devices, bandwidth=bandwidth)
    return Deployment(engine, engines, traffic)

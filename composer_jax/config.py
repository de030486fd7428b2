"""Typed, frozen configs loaded from YAML plus `a.b=value` overrides, validated at load.

Every config is a frozen dataclass. `load_config(path, overrides)` reads a YAML file, applies dotted
overrides, converts each value to its field's type and runs each dataclass's own checks. Anything
wrong raises `ConfigError` naming the full dotted key: an unknown key also suggests the nearest valid
one, a bad type names the expected type, an impossible value names the constraint.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import io
import math
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

DType = Literal["float32", "bfloat16"]


class ConfigError(ValueError):
    """A config value or key is invalid. `key` is the dotted path of the culprit."""

    def __init__(self, key: str, message: str):
        self.key, self.detail = key, message
        super().__init__(f"config key '{key}': {message}" if key else message)


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V3 / Kimi K2 naming)."""

    num_heads: int                  # attention heads
    q_lora_rank: int                # the query's low-rank compression
    kv_lora_rank: int               # the compressed key-value latent (what the inference cache holds)
    qk_nope_head_dim: int           # per-head query/key dims without rotary embedding
    qk_rope_head_dim: int           # the decoupled rotary key dims, shared by all heads (even)
    v_head_dim: int                 # per-head value dims
    latent_norm_eps: float = 1e-6  # HF builds q_a/kv_a norms without eps: their default 1e-6

    def __post_init__(self):
        for name in ("num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            _check(getattr(self, name) > 0, name, "must be > 0")
        _check(self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
               f"must be a positive even number (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        _check(self.latent_norm_eps > 0, "latent_norm_eps", "must be > 0")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """YaRN rotary embedding on the decoupled rope dims (interleaved pairs, as in the HF checkpoints)."""

    theta: float                    # rotary base frequency
    factor: float = 1.0  # 1.0 = plain RoPE, no YaRN
    original_max_position_embeddings: int = 4096   # the context YaRN extends from
    max_position_embeddings: int = 4096            # the longest sequence the model runs
    beta_fast: float = 32.0         # YaRN: rotations per context above which dims keep their frequency
    beta_slow: float = 1.0          # YaRN: rotations per context below which dims are interpolated fully
    mscale: float = 1.0             # YaRN: cos/sin scale by mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    mscale_all_dim: float = 1.0     # YaRN: the softmax scale is multiplied by mscale(factor, mscale_all_dim)^2

    def __post_init__(self):
        _check(self.theta > 1, "theta", f"must be > 1, got {self.theta}")
        _check(self.factor >= 1, "factor", f"must be >= 1 (1 disables YaRN), got {self.factor}")
        _check(self.original_max_position_embeddings > 0, "original_max_position_embeddings", "must be > 0")
        _check(self.max_position_embeddings >= self.original_max_position_embeddings, "max_position_embeddings",
               f"must be >= original_max_position_embeddings ({self.original_max_position_embeddings}), "
               f"got {self.max_position_embeddings}")
        _check(self.beta_fast > self.beta_slow > 0, "beta_fast",
               f"need beta_fast > beta_slow > 0, got {self.beta_fast} and {self.beta_slow}")


# Kimi K2.5's INT4 routed experts (compressed-tensors, symmetric groups): inputs per scale, and the
# symmetric scale's divisor max |w| / ((q_max - q_min) / 2) for q in [-8, 7].
INT4_GROUP = 32
INT4_MAX_ABS = 7.5


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sigmoid-routed MoE with selection-only correction bias and a shared expert."""

    n_routed_experts: int           # routed experts per MoE layer
    num_experts_per_tok: int        # experts each token is routed to (k)
    moe_intermediate_size: int      # each expert's SwiGLU width
    n_shared_experts: int = 1       # experts every token passes through
    n_group: int = 1                # expert groups for group-limited routing
    topk_group: int = 1             # groups a token may route into
    routed_scaling_factor: float = 1.0   # multiplies the routed experts' combined output
    norm_topk_prob: bool = True     # normalise the k selected weights to sum to 1
    # how tokens reach experts: dense / ragged / gather / blocked (experts on every device), ep_a2a
    # (all_to_all over `ep`), ep_ragged (ragged_all_to_all, GPU/TPU only)
    dispatch: Literal["dense", "ragged", "gather", "blocked", "ep_a2a", "ep_ragged"] = "ragged"
    # ep_a2a / ep_ragged exchange buffers per device, as a multiple of its expected expert assignments
    # (local tokens x k); copies beyond them are dropped and counted. 0 = dropless (worst-case buffers:
    # ep x tokens x min(k, experts per device) rows, 48x the assignments at Kimi K2.5 scale)
    capacity_factor: float = 2.0
    bias_update_rate: float = 1e-3  # aux-loss-free balancing step (DeepSeek-V3's gamma)
    # int4: every forward uses the routed experts through K2.5's INT4 quantizer (groups of INT4_GROUP inputs)
    # with a straight-through gradient: quantization-aware training, and the policy an INT4 engine serves
    # (an engine of such a model holds the experts as INT4)
    expert_quant: Literal["none", "int4"] = "none"

    def __post_init__(self):
        _check(self.n_routed_experts > 0, "n_routed_experts", "must be > 0")
        _check(0 < self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
               f"must be in [1, n_routed_experts={self.n_routed_experts}], got {self.num_experts_per_tok}")
        _check(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be > 0")
        _check(self.n_shared_experts >= 0, "n_shared_experts", "must be >= 0")
        _check(self.n_group > 0 and self.n_routed_experts % self.n_group == 0, "n_group",
               f"must divide n_routed_experts={self.n_routed_experts}, got {self.n_group}")
        _check(0 < self.topk_group <= self.n_group, "topk_group",
               f"must be in [1, n_group={self.n_group}], got {self.topk_group}")
        per_group = self.n_routed_experts // self.n_group
        if self.n_group > 1:
            _check(per_group >= 2, "n_group", "group-limited routing scores each group by its top-2 experts: "
                   f"need >= 2 experts per group, got {per_group}")
        _check(self.topk_group * per_group >= self.num_experts_per_tok, "num_experts_per_tok",
               f"the {self.topk_group} kept groups hold only {self.topk_group * per_group} experts, "
               f"fewer than num_experts_per_tok={self.num_experts_per_tok}")
        _check(self.routed_scaling_factor > 0, "routed_scaling_factor", "must be > 0")
        _check(self.bias_update_rate >= 0, "bias_update_rate", "must be >= 0")
        _check(self.capacity_factor >= 0, "capacity_factor", "must be >= 0 (0 = dropless)")


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """DeepSeek-V3 multi-token prediction: `num_layers` sequential depths sharing embedding and head."""

    num_layers: int = 0             # MTP depths (0: none)
    loss_weight: float = 0.1        # weight of the MTP cross-entropy in the training loss

    def __post_init__(self):
        _check(self.num_layers >= 0, "num_layers", "must be >= 0")
        _check(self.loss_weight >= 0, "loss_weight", "must be >= 0")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V3-architecture causal LM (Kimi K2 / K2.5 text model)."""

    vocab_size: int                 # embedding and output-head rows
    hidden_size: int                # the residual stream's width
    num_layers: int                 # decoder layers
    num_dense_layers: int  # HF first_k_dense_replace: the first layers use a dense SwiGLU FFN
    intermediate_size: int          # the dense layers' SwiGLU width
    mla: MLAConfig
    rope: RopeConfig
    moe: MoEConfig
    mtp: MTPConfig = MTPConfig()
    rms_norm_eps: float = 1e-6  # residual-stream norms (input, post-attention, final, MTP)
    dtype: DType = "float32"  # activation / matmul compute dtype
    param_dtype: DType = "float32"  # parameter storage dtype
    # Attention implementation for training and prefill (composer_jax.model.attention_ops): reference
    # (dense scores), blockwise (memory linear in the sequence), cudnn (NVIDIA GPUs, bfloat16), auto.
    attention: Literal["auto", "reference", "blockwise", "cudnn"] = "auto"
    # How a stack of layers runs (composer_jax.model.decoder.unrolls): scan (a lax.scan: compile time flat
    # in the depth), unroll (one layer after another), auto (unroll on CPU up to 8 layers, else scan).
    layer_loop: Literal["auto", "scan", "unroll"] = "auto"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "intermediate_size"):
            _check(getattr(self, name) > 0, name, "must be > 0")
        _check(self.attention != "cudnn" or self.dtype == "bfloat16", "attention",
               f"cudnn attention runs in bfloat16: needs dtype=bfloat16, got dtype={self.dtype}")
        _check(0 <= self.num_dense_layers <= self.num_layers, "num_dense_layers",
               f"must be in [0, num_layers={self.num_layers}], got {self.num_dense_layers}")
        _check(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        if self.moe.expert_quant == "int4":   # groups along each expert matrix's inputs
            for key, width in (("hidden_size", self.hidden_size),
                               ("moe.moe_intermediate_size", self.moe.moe_intermediate_size)):
                _check(width % INT4_GROUP == 0, key, f"moe.expert_quant=int4 quantizes groups of {INT4_GROUP} inputs: "
                                                    f"needs a multiple of {INT4_GROUP}, got {width}")

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Dual-grid HSDP layout over one device list (see composer_jax.parallel.mesh).

    Dense mesh `(replica, fsdp, cp)`: dense weights sharded on `fsdp`, replicated over `replica` and
    `cp`; activations batch-sharded on `(replica, fsdp)`, sequence-sharded on `cp`.
    Expert mesh `(ereplica, efsdp, ep)`: routed-expert weights sharded on `ep` (experts) and `efsdp`
    (their embed dim). Each grid's sizes multiply to the device count; one size per grid may be -1
    (the rest of the devices), except that `ep` and `ereplica` may both be: then `ep` is the largest
    size dividing both the routed experts and the devices `efsdp` leaves, and `ereplica` the rest.
    """

    replica: int = 1                # dense mesh: replicas of the sharded weights (HSDP; across hosts)
    fsdp: int = -1                  # dense mesh: weight and batch shards
    cp: int = 1                     # dense mesh: context parallelism (sequence shards)
    ereplica: int = -1              # expert mesh: replicas of the routed experts (-1: the devices ep leaves)
    efsdp: int = 1                  # expert mesh: shards of each expert's embed dim
    # expert mesh: expert parallelism (experts per device = experts / ep); -1: the largest size that divides
    # the routed experts and the devices (with ereplica=-1), else the rest of the devices
    ep: int = -1

    def __post_init__(self):
        for grid in (("replica", "fsdp", "cp"), ("ereplica", "efsdp", "ep")):
            fills = [a for a in grid if getattr(self, a) == -1]
            for axis in grid:
                size = getattr(self, axis)
                _check(size == -1 or size > 0, axis, f"must be a positive size or -1 (fill), got {size}")
            if len(fills) > 1 and set(fills) != {"ereplica", "ep"}:
                raise ConfigError(fills[0], f"at most one of {grid} may be -1 (only ereplica and ep both)")


def check_fits_model(key: str, length: int, model: ModelConfig) -> None:
    """A run's row length `length` (config key `key`) within the positions `model` supports."""
    limit = model.rope.max_position_embeddings
    if length > limit:
        raise ConfigError(key, f"{length} is longer than the model supports "
                               f"(model.rope.max_position_embeddings={limit})")


# Model keys a run may set differently from the source it starts from (`train.init_from`, RL's
# `init_from`): how the model runs, or what a phase changes on purpose (RoPE scaling extends the context;
# MTP depths the source lacks are initialised fresh). Every other key is the source's architecture.
RUNTIME_KEYS = ("moe.dispatch", "moe.capacity_factor", "moe.bias_update_rate", "moe.expert_quant", "attention",
                "layer_loop", "dtype", "param_dtype", "mtp.num_layers", "mtp.loss_weight", "rope.")


def flat_dict(data: dict, prefix: str = "") -> dict:
    """{'a.b': value} of a nested dict."""
    out = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(flat_dict(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_architecture(cfg: ModelConfig, source: ModelConfig, key_prefix: str = "model", where: str = "") -> None:
    """ConfigError naming the first architecture key (not RUNTIME_KEYS) where `cfg` differs from `source`."""
    have, want = flat_dict(dataclasses.asdict(cfg)), flat_dict(dataclasses.asdict(source))
    for key, value in have.items():
        if key.startswith(RUNTIME_KEYS) or value == want.get(key):
            continue
        raise ConfigError(f"{key_prefix}.{key}" if key_prefix else key,
                          f"is {value!r}, but the source{' ' + where if where else ''} has {want.get(key)!r}: a run "
                          f"keeps its source's architecture (it may change only {', '.join(RUNTIME_KEYS[:-1])} "
                          "and rope.*)")


# ----------------------------------------------------------------------------------------------------
# Loading


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Convert one YAML/CLI value to field type `tp`, or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if hasattr(tp, "from_config"):  # a type that parses its own config form (e.g. envs.rewards.Schedule)
        return tp.from_config(value, key)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _convert(value, args[0], key)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if origin is tuple and typing.get_args(tp)[1:] == (Ellipsis,):   # tuple[X, ...] from a YAML list
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected a list, got {value!r}")
        return tuple(_convert(v, typing.get_args(tp)[0], f"{key}[{i}]") for i, v in enumerate(value))
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            near = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(key, f"expected {_type_name(tp)}, got {value!r}{hint}")
        return value
    if tp is str and value is None:   # `key=` on the command line: empty
        return ""
    if tp in (bool, str):
        if isinstance(value, tp):
            return value
        raise ConfigError(key, f"expected {'a bool (true/false)' if tp is bool else 'a string'}, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(key, f"expected an int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads `1e-5` as a string
            try:
                out = float(value)
            except ValueError:
                raise ConfigError(key, f"expected a float, got {value!r}") from None
        else:
            raise ConfigError(key, f"expected a float, got {value!r}")
        if not math.isfinite(out):
            raise ConfigError(key, f"must be finite, got {value!r}")
        return out
    raise TypeError(f"unsupported config field type {tp!r} for '{key}'")


def _unknown_key(cls: type, name: str, key: str) -> ConfigError:
    fields = [f.name for f in dataclasses.fields(cls)]
    near = difflib.get_close_matches(name, fields, n=1, cutoff=0.5)
    hint = f"did you mean '{near[0]}'?" if near else f"valid keys: {', '.join(fields)}"
    return ConfigError(key, f"unknown key for {cls.__name__}; {hint}")


def from_dict(cls: type, data: dict, prefix: str = ""):
    """Build dataclass `cls` from a plain dict, converting and validating every value."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    join = (lambda k: f"{prefix}.{k}") if prefix else (lambda k: k)
    kwargs = {}
    for name, value in data.items():
        if name not in fields:
            raise _unknown_key(cls, str(name), join(str(name)))
        kwargs[name] = _convert(value, hints[name], join(name))
    missing = [n for n, f in fields.items() if n not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(join(missing[0]), f"required key is missing (required: {', '.join(missing)})")
    try:
        return cls(**kwargs)
    except ConfigError as e:  # re-raise with the full dotted path
        raise ConfigError(join(e.key), e.detail) from None


def to_dict(cfg) -> dict:
    """The plain-dict form of a config (what `from_dict` reads back)."""
    return dataclasses.asdict(cfg)


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` -> ('a.b', parsed YAML value)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError("", f"override {text!r} is not of the form key.path=value")
    return key.strip(), yaml.safe_load(raw) if raw.strip() else None


def _set_dotted(cls: type, data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node, node_cls = data, cls
    for i, part in enumerate(parts):
        path = ".".join(parts[: i + 1])
        fields = {f.name for f in dataclasses.fields(node_cls)}
        if part not in fields:
            raise _unknown_key(node_cls, part, path)
        if i == len(parts) - 1:
            node[part] = value
            return
        node_cls = typing.get_type_hints(node_cls)[part]
        if not dataclasses.is_dataclass(node_cls):
            raise ConfigError(path, f"is a {_type_name(node_cls)}, not a section; cannot set '{key}'")
        node = node.setdefault(part, {})


def apply_overrides(cls: type, data: dict, overrides) -> dict:
    """Apply `a.b=value` strings (or a {dotted: value} mapping) to the raw dict `data` in place."""
    items = overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides)
    for key, value in items:
        _set_dotted(cls, data, key, value)
    return data


CONFIG_KINDS = {"model": CONFIG_DIR / "model", "run": CONFIG_DIR}  # where each kind's bundled configs live


def bundled_configs(kind: str) -> list[str]:
    """Names of the bundled configs of `kind` ('model' or 'run')."""
    return sorted(p.stem for p in CONFIG_KINDS[kind].glob("*.yaml"))


def resolve_config_path(path_or_name: str | Path, kind: str = "model") -> Path:
    """A YAML path, or the name of a bundled config of `kind` ('model': configs/model/tiny.yaml for
    `tiny`; 'run': configs/pretrain-tiny.yaml for `pretrain-tiny`)."""
    path = Path(path_or_name).expanduser()
    if path.is_file():
        return path
    bundled = CONFIG_KINDS[kind] / f"{path_or_name}.yaml"
    if bundled.is_file():
        return bundled
    text = str(path_or_name)
    hint = ""
    if "." in text and "/" not in text and not text.endswith((".yaml", ".yml")):
        hint = f"; to override a key write {text}=VALUE"
    raise FileNotFoundError(f"config {text!r} is neither a file nor a bundled {kind} config "
                            f"(bundled: {', '.join(bundled_configs(kind))}){hint}")


def shipped_path(value: str) -> str:
    """A path from a config, absolute (`~` expanded, relative to the current directory), or one shipped with
    the configs (configs/repos/textkit, configs/tokenizers/tiny-bpe) when only that exists; "" and
    `byte` stay as they are."""
    if not value or value == "byte":
        return value
    path = Path(value).expanduser()
    if not path.is_absolute() and not path.exists() and (CONFIG_DIR / value).exists():
        path = CONFIG_DIR / value
    return str(path.absolute())


def read_yaml(path: Path) -> dict:
    """A YAML file's top-level mapping, or a ConfigError naming the file."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError("", f"{path}: malformed YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError("", f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def override_origin(error: ConfigError, path: Path, command_line) -> ConfigError:
    """`error` with where its key was set: `command_line` ({dotted key: 'key=value' text}) or file `path`."""
    if not error.key:  # not about a key (a malformed override): says what it is already
        return error
    for key, text in command_line.items():
        if error.key == key or key.startswith(error.key + ".") or error.key.startswith(key + "."):
            return ConfigError(error.key, f"{error.detail} (command-line override {text})")
    return ConfigError(error.key, f"{error.detail} (in {path})")


def command_line_overrides(overrides) -> dict[str, str]:
    """{dotted key: its text} of `key=value` strings (other items, already parsed, are left out)."""
    return {o.partition("=")[0].strip(): o for o in overrides if isinstance(o, str)}


def load_config(path_or_name: str | Path, overrides=(), cls: type = ModelConfig):
    """Read a YAML config, apply overrides, and return the validated, frozen `cls` instance."""
    path = resolve_config_path(path_or_name)
    data = read_yaml(path)
    try:
        return from_dict(cls, apply_overrides(cls, data, overrides))
    except ConfigError as e:
        raise override_origin(e, path, command_line_overrides(overrides)) from None


# ----------------------------------------------------------------------------------------------------
# Describing keys: each field's meaning is the comment written beside it (or just above it) in the source.


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: meaning} of dataclass `cls`, read from its source: the comment that ends the field's
    line, or the comment lines right above the field. Fields without a comment are left out."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    docs = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        above, n = [], node.lineno - 1
        while n in comments and lines[n - 1].lstrip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        if trailing or above:
            docs[node.target.id] = " ".join(trailing or above)
    return docs


@dataclasses.dataclass(frozen=True)
class KeyInfo:
    key: str          # dotted path
    type: str         # the field's type in words
    default: str      # its default as YAML would write it, or "(required)"
    meaning: str      # the field's comment ("" if none)


def describe_keys(cls: type, prefix: str = "") -> list[KeyInfo]:
    """Every leaf key of dataclass `cls` (nested sections expanded), with type, default and meaning (a
    field's comment in the class that declares it last: a subclass may redeclare a base's field)."""
    hints, docs = typing.get_type_hints(cls), {}
    for c in reversed(cls.__mro__):
        if dataclasses.is_dataclass(c):
            docs.update(field_docs(c))
    out = []
    for f in dataclasses.fields(cls):
        key, tp = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += describe_keys(tp, key + ".")
            continue
        default = "(required)"
        if f.default is not dataclasses.MISSING:   # one line, also for a list (its table row stays one row)
            default = yaml.safe_dump(f.default, default_flow_style=True, width=1 << 16).strip()
            default = default.removesuffix("\n...").removesuffix("...").strip()
        out.append(KeyInfo(key, _type_name(tp), default, docs.get(f.name, "")))
    return out


def replace(cfg, **dotted):
    """A copy of `cfg` with dotted-key changes, re-validated: `replace(cfg, **{"moe.dispatch": "dense"})`."""
    return from_dict(type(cfg), apply_overrides(type(cfg), to_dict(cfg), dotted))

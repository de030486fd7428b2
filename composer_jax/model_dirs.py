"""Model sources: what one phase hands the next. A source is a directory holding a model's weights, its
architecture, its tokenizer and its chat format:

- a Hugging Face directory (config.json + safetensors: DeepSeek-V3, Kimi K2, Kimi K2.5's `text_config`;
  bf16, FP8 blocks and INT4 experts dequantized on read), with its tokenizer files; or a Hugging Face
  model id (`moonshotai/Kimi-K2.5`): its snapshot in the local Hugging Face cache, downloaded when missing
  (`checkpoint.hub.local_model`; a local path of the same spelling wins);
- a converted directory (`composer-jax convert`: model_config.yaml + orbax params; the source's small
  files, tokenizer included, in hf_files/);
- a run directory of any phase (pretrain, sft, rl): its latest checkpoint, its `tokenizer/` and
  `chat.json`.

`open_source(path)` reads only configs and indexes (it never starts JAX's backend, so run configs can
name a source); `load_state` streams the weights into their shards on a run's layout
(checkpoint/stream.py: host memory bounded by one stack index of one leaf); `open_model` is the same for
`generate` and `eval` on one device.

What travels besides the weights (`Chat`, written by every run as RUN_DIR/tokenizer/ and
RUN_DIR/chat.json, and by `export` beside the weights): the tokenizer files, the chat / tool-call format,
and the agent settings the model was trained with (declared tools, tool-output limit, turns, sampling).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from composer_jax import config as config_lib
from composer_jax.checkpoint.hub import is_hub_id, local_model
from composer_jax.checkpoint.safetensors_io import INDEX_FILE, CheckpointError
from composer_jax.config import ConfigError, ModelConfig
from composer_jax.data.chat import format_for
from composer_jax.data.tokenizer import Tokenizer, TokenizerError, load_tokenizer

CHAT_FILE = "chat.json"              # {"tokenizer": "byte" | file in TOKENIZER_DIR, "format", "agent"}
TOKENIZER_DIR = "tokenizer"          # a run's copy of its tokenizer files
TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model")
# Files that belong with a tokenizer (its special tokens, its chat template, a remote-code class).
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")
AGENT_KEYS = ("tools", "max_output_chars", "max_turns", "temperature", "top_p", "top_k", "max_new_tokens")


@dataclasses.dataclass(frozen=True)
class Chat:
    """A model's tokenizer and chat: `tokenizer` is "byte", the path of its tokenizer file (its side files
    beside it) or "" (a directory that ships none); `format` "" means chosen from the tokenizer (kimi with Kimi's markers, else plain);
    `agent` the agent settings it was trained with (AGENT_KEYS; {} when none)."""

    tokenizer: str = "byte"
    format: str = ""
    agent: dict = dataclasses.field(default_factory=dict)

    def load_tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.tokenizer)

    def resolved_format(self, tokenizer: Tokenizer | None = None) -> str:
        return format_for(tokenizer or self.load_tokenizer(), self.format)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    path: Path
    kind: str                     # "hf", "converted" or "run"
    model: ModelConfig            # the architecture as the source stores it
    stored_mtp: int               # MTP depths its weights hold
    chat: Chat
    eos_ids: tuple[int, ...]      # default stop tokens
    weights: Path                 # hf: the directory; converted: its params/; run: checkpoints/STEP/model
    step: int | None = None       # run: the checkpoint step
    hf_prefix: str = ""           # hf: the text model's tensor prefix (K2.5: language_model.)
    quantized: bool = False       # hf: INT4 / FP8 weights (dequantized to float32 on read)

    @property
    def description(self) -> str:
        return {"hf": f"Hugging Face model {self.path}", "converted": f"converted model {self.path}",
                "run": f"training run {self.path}, step {self.step}"}[self.kind]


def _complete_steps(checkpoints: Path) -> list[int]:
    """Committed orbax checkpoint steps (a step directory is renamed into place once complete)."""
    if not checkpoints.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints.iterdir()
                  if p.name.isdigit() and (p / "_CHECKPOINT_METADATA").is_file())


def _tokenizer_file(directory: Path) -> str:
    """The tokenizer file in `directory`, or "" when there is none."""
    for name in TOKENIZER_FILES:
        if (directory / name).is_file():
            return str(directory / name)
    return ""


def read_chat(directory: Path, tokenizer_dir: Path) -> Chat | None:
    """The Chat recorded in `directory`/chat.json (tokenizer files in `tokenizer_dir`), or None."""
    file = directory / CHAT_FILE
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
        name = data.get("tokenizer", "byte")
        tokenizer = "byte" if name == "byte" else str(tokenizer_dir / name)
        agent = {k: v for k, v in (data.get("agent") or {}).items() if k in AGENT_KEYS}
        return Chat(tokenizer, data.get("format", ""), agent)
    except (json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{file}: not a readable chat record: {e}") from None


def _hf_stored_mtp(path: Path, text: dict, prefix: str, need_weights: bool) -> int:
    """MTP layers stored past the last decoder layer, from the tensor index (or the headers)."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            keys = list(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: corrupt index: {e!r}") from None
    elif need_weights or list(path.glob("*.safetensors")):
        from composer_jax.checkpoint.safetensors_io import SafetensorsDir

        keys = SafetensorsDir(path).keys()
    else:
        raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_FILE}")
    layers = {k[len(prefix):].split(".")[2] for k in keys if k.startswith(f"{prefix}model.layers.")}
    depth, first = 0, text["num_hidden_layers"]
    while str(first + depth) in layers:
        depth += 1
    return depth


def _open_hf(path: Path, need_weights: bool) -> ModelSource:
    from composer_jax.checkpoint.hf_config import config_from_hf, eos_token_ids, read_hf_config

    _, text, prefix = read_hf_config(path)
    try:
        stored = _hf_stored_mtp(path, text, prefix, need_weights)
        model = config_lib.from_dict(ModelConfig, config_from_hf(text, stored))
    except KeyError as e:
        raise CheckpointError(f"{path / 'config.json'}: missing required key {e}") from None
    except ConfigError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
    chat = read_chat(path, path) or Chat(_tokenizer_file(path))
    return ModelSource(path, "hf", model, stored, chat, eos_token_ids(path), path, hf_prefix=prefix,
                       quantized=bool(text.get("quantization_config")))


def _open_converted(path: Path) -> ModelSource:
    from composer_jax.checkpoint.hf_config import eos_token_ids
    from composer_jax.checkpoint.orbax_io import HF_FILES, PARAMS_DIR, model_config

    model = model_config(path)
    if not (path / PARAMS_DIR / "_METADATA").is_file():
        raise CheckpointError(f"{path}: no {PARAMS_DIR}/_METADATA (an incomplete converted directory)")
    files = path / HF_FILES
    chat = read_chat(files, files) or Chat(_tokenizer_file(files))
    return ModelSource(path, "converted", model, model.mtp.num_layers, chat,
                       eos_token_ids(files) if files.is_dir() else (), path / PARAMS_DIR)


def _open_run(path: Path) -> ModelSource:
    steps = _complete_steps(path / "checkpoints")
    if not steps:
        raise CheckpointError(f"{path}: no complete checkpoint in {path / 'checkpoints'}: train that run first")
    step = steps[-1]
    config_file = path / "checkpoints" / str(step) / "config" / "metadata"
    try:
        saved = json.loads(config_file.read_text())
        model = config_lib.from_dict(ModelConfig, saved["model"], prefix="model")
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{config_file}: no readable run config ({e!r})") from None
    # Runs from before chat records: a pretraining / SFT run's data.tokenizer, an RL run's bytes.
    chat = read_chat(path, path / TOKENIZER_DIR) or Chat(
        "byte" if "rl" in saved else saved.get("data", {}).get("tokenizer", "byte") or "byte")
    eos = ()
    if chat.tokenizer != "byte":
        eos_id = chat.load_tokenizer().eos_id
        eos = () if eos_id is None else (eos_id,)
    return ModelSource(path, "run", model, model.mtp.num_layers, chat, eos,
                       path / "checkpoints" / str(step) / "model", step)


def open_source(path: str | Path, need_weights: bool = True) -> ModelSource:
    """The model source at `path` (a Hugging Face, converted or run directory, or a Hugging Face model id:
    its snapshot in the local cache, downloaded when missing, `checkpoint.hub.local_model`), configs only; a
    CheckpointError naming what is missing otherwise. `need_weights=False` accepts a Hugging Face
    directory whose index lists weights that are not there (planning from the config and index), and
    downloads no weights for an id."""
    path = local_model(path, weights=need_weights)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory (a model source is a Hugging Face, converted or run "
                              "directory)")
    if (path / "checkpoints").is_dir() or (path / "config.yaml").is_file():
        return _open_run(path)
    if (path / "model_config.yaml").is_file():
        return _open_converted(path)
    if (path / "config.json").is_file():
        return _open_hf(path, need_weights)
    raise CheckpointError(f"{path} is not a model: it has no config.json (a Hugging Face directory), "
                          "model_config.yaml (a converted directory) or checkpoints/ (a run directory)")


def source_spec(value: str) -> str:
    """A model source as a run config records it: a local path absolute (`config.shipped_path`), or a
    Hugging Face model id as written when no local path of that spelling exists ("" stays "")."""
    path = config_lib.shipped_path(value)
    return value if is_hub_id(value) and not Path(path).exists() else path


def source_for(path: str | Path, key: str, hint: str = "", need_weights: bool = True) -> ModelSource:
    """`open_source(path, need_weights)`, or a ConfigError(`key`) naming what is wrong when it is not a
    usable source (with `hint`, e.g. how to make it, when it does not exist)."""
    try:
        return open_source(path, need_weights)
    except (CheckpointError, TokenizerError, OSError) as e:
        message = str(e).splitlines()[0]
        missing = not Path(path).expanduser().exists()
        raise ConfigError(key, f"{message}: {hint}" if hint and missing else message) from None


def source_model(path: str | Path, key: str, hint: str = "") -> tuple[dict, ModelSource]:
    """(the source's model config as a raw dict, the source) for config loading (see `source_for`): its
    config and index only (a Hugging Face id's weights download when a run loads them)."""
    source = source_for(path, key, hint, need_weights=False)
    return config_lib.to_dict(source.model), source


# -- a run's record of its tokenizer and chat ------------------------------------------------------------


def resolve_chat(tokenizer: str, fmt: str, agent: dict, source: ModelSource | None, key: str = "tokenizer") -> Chat:
    """The Chat a run uses: `tokenizer` ("" = the source's, else bytes), `fmt` ("" = the source's, else by
    the tokenizer), agent settings given over the source's (values of None are not given). A source
    without tokenizer files needs `tokenizer` (ConfigError naming `key`)."""
    base = source.chat if source is not None else Chat()
    spec = tokenizer or base.tokenizer
    if not spec:
        raise ConfigError(key, f"{source.path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): name the "
                               "tokenizer the model was trained with (or byte)")
    if spec != "byte":
        spec = str(Path(spec).expanduser().absolute())
        if Path(spec).is_dir():
            spec = _tokenizer_file(Path(spec)) or spec     # a directory without one: load_tokenizer says so
    given = {k: v for k, v in agent.items() if v is not None}
    return Chat(spec, fmt or base.format, {**base.agent, **given})


def run_chat_setup(resumed: Path | None, source: ModelSource | None, tokenizer: str, fmt: str, agent: dict,
                   vocab_size: int, keys: tuple[str, str]):
    """(Chat, Tokenizer, ChatFormat) of a run: a resumed run's own record (`resumed`: its directory), else
    `resolve_chat`. Errors name the config key (`keys`: the tokenizer's and the format's): a tokenizer
    with more ids than the model's vocabulary, a format the tokenizer cannot express."""
    from composer_jax.data.chat import get_chat_format

    chat = run_chat(resumed) if resumed is not None else None
    chat = chat or resolve_chat(tokenizer, fmt, agent, source, keys[0])
    loaded = chat.load_tokenizer()
    if loaded.vocab_size > vocab_size:
        raise ConfigError(keys[0], f"tokenizer {loaded.name} has {loaded.vocab_size} ids, more than the model's "
                                   f"vocab_size={vocab_size}")
    try:
        chat = dataclasses.replace(chat, format=chat.resolved_format(loaded))
    except ValueError as e:
        raise ConfigError(keys[1], str(e)) from None
    return chat, loaded, get_chat_format(chat.format)


def write_chat(directory: Path, chat: Chat, tokenizer: Tokenizer | None = None, files_dir: Path | None = None) -> None:
    """Record `chat` in `directory`: its tokenizer files copied into `files_dir` (default
    directory/tokenizer) and chat.json, the format resolved (so a reader needs no tokenizer to know it)."""
    files_dir = files_dir or directory / TOKENIZER_DIR
    record = {"tokenizer": "byte", "format": chat.resolved_format(tokenizer), "agent": chat.agent}
    if chat.tokenizer != "byte":
        copy_tokenizer_files(Path(chat.tokenizer), files_dir)
        record["tokenizer"] = Path(chat.tokenizer).name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CHAT_FILE).write_text(json.dumps(record, indent=2) + "\n")


def write_hf_chat(directory: Path, chat: Chat) -> Tokenizer:
    """Beside exported weights: the tokenizer files (a byte-level model's as a tokenizer.json of its 256
    bytes) with the chat template of the model's format in tokenizer_config.json and chat_template.jinja,
    so transformers' `AutoTokenizer` loads them and `apply_chat_template` renders as composer_jax does; and
    chat.json (format, agent settings), so the directory opens as a source with them. Returns the tokenizer."""
    from composer_jax.data.chat import get_chat_format
    from composer_jax.data.tokenizer import byte_tokenizer_json

    tokenizer = chat.load_tokenizer()
    fmt = get_chat_format(chat.resolved_format(tokenizer))
    if chat.tokenizer == "byte":
        (directory / "tokenizer.json").write_text(byte_tokenizer_json())
        byte_chat = dataclasses.replace(chat, tokenizer=str(directory / "tokenizer.json"))
        write_chat(directory, byte_chat, tokenizer, files_dir=directory)
    else:
        write_chat(directory, chat, tokenizer, files_dir=directory)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if (directory / "tokenizer.json").is_file():
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    if tokenizer.eos_id is not None:
        config.setdefault("eos_token", tokenizer.decode([tokenizer.eos_id]))
    config["chat_template"] = fmt.chat_template()
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (directory / "chat_template.jinja").write_text(fmt.chat_template())   # transformers prefers this file
    return tokenizer


def copy_tokenizer_files(file: Path, dst: Path) -> list[Path]:
    """Copy tokenizer file `file` and the side files beside it (TOKENIZER_SIDE_FILES, a remote-code
    tokenizer class) into `dst`; returns the files written."""
    dst.mkdir(parents=True, exist_ok=True)
    names = [file.name, *TOKENIZER_SIDE_FILES, *(p.name for p in file.parent.glob("tokenization_*.py"))]
    written = []
    for name in dict.fromkeys(names):
        if (file.parent / name).is_file() and (file.parent / name).resolve() != (dst / name).resolve():
            shutil.copyfile(file.parent / name, dst / name)
            written.append(dst / name)
    return written


def run_chat(run_dir: str | Path) -> Chat | None:
    """The Chat a run directory recorded (None for runs from before chat records)."""
    run_dir = Path(run_dir)
    return read_chat(run_dir, run_dir / TOKENIZER_DIR)


def export_model(src: str | Path, dst: str | Path, **options) -> dict:
    """`checkpoint.export.export` of any model to export: a run directory (its latest checkpoint), a
    checkpoint step of one, a converted directory or a bare orbax checkpoint (`cfg=` given), with the
    model's tokenizer files and chat template beside the weights (`write_hf_chat`)."""
    from composer_jax.checkpoint.export import export
    from composer_jax.checkpoint.orbax_io import MODEL_CONFIG
    from composer_jax.model import abstract_params

    src = Path(src).expanduser().absolute()
    chat, params = None, src
    if (src / "checkpoints").is_dir() or (src / MODEL_CONFIG).is_file():
        source = open_source(src)
        chat, params = source.chat, source.weights.parent if source.kind == "run" else src
        options["cfg"] = options.get("cfg") or source.model
    elif src.parent.name == "checkpoints" and (src.parent.parent / "config.yaml").is_file():
        chat = run_chat(src.parent.parent) or open_source(src.parent.parent).chat
    beside = (lambda directory: write_hf_chat(directory, chat).eos_id) if chat is not None and chat.tokenizer else None
    return export(params, dst, params_of=abstract_params, beside=beside, **options)


def load_converted(directory: str | Path, overrides=(), *, shardings=None):
    """A converted model directory restored into `CausalLM` with orbax (`checkpoint.orbax_io.restore_params`).

    `overrides`: ModelConfig changes that keep parameter shapes (e.g. `moe.dispatch=dense`).
    `shardings`: None (first device), or an nnx.State / nested dict of shardings, or a function of the
    abstract nnx.State returning one (e.g. `lambda s: parallel.param_shardings(s, dual_mesh)`).
    """
    from flax import nnx

    from composer_jax.checkpoint.hf_config import eos_token_ids
    from composer_jax.checkpoint.orbax_io import HF_FILES, model_config, restore_params
    from composer_jax.model import CausalLM

    cfg = model_config(directory, overrides)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, restore_params(directory, nnx.to_pure_dict(state),
                                                   shardings(state) if callable(shardings) else shardings))
    model = nnx.merge(graphdef, state)
    if (Path(directory) / HF_FILES).is_dir():  # the source checkpoint's EOS ids, as from_pretrained sets them
        model.eos_token_ids = eos_token_ids(Path(directory) / HF_FILES)
    return model

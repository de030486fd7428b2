"""Model sources named by Hugging Face id (`moonshotai/Kimi-K2.5`), as the ecosystem names them: resolved
through huggingface_hub's local cache (HF_HUB_CACHE, else HF_HOME/hub), looked up there first and
downloaded into it when missing and online. A local path that exists always wins over an id of the same
spelling. Only what a model source reads is fetched: configs and indexes, tokenizer files, chat records,
and the safetensors when the weights are wanted.

`local_model` is the one resolver: every entry point reaches it through `checkpoint.hf.open_hf`
(`from_pretrained`, `convert`) or `model_dirs.open_source` (`init_from`, `generate`, `eval`, `plan`).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from composer_jax.checkpoint.safetensors_io import INDEX_FILE, CheckpointError

log = logging.getLogger(__name__)

_PART = r"\w(?:[\w.-]{0,94}\w)?"   # 1-96 of letters, digits, _ - ., starting and ending with no - or .
_HUB_ID = re.compile(f"{_PART}/{_PART}")
# Configs and indexes (config.json, generation_config.json, the safetensors index, chat.json), tokenizer
# files and their side files (model_dirs.TOKENIZER_FILES, TOKENIZER_SIDE_FILES, a remote-code class), and
# a lone model.safetensors: an unsharded (small) checkpoint has no index, so its tensor names are read
# from that file's header.
CONFIG_PATTERNS = ("*.json", "*.jinja", "tiktoken.model", "tokenization_*.py", "model.safetensors")
WEIGHT_PATTERNS = ("*.safetensors",)


def is_hub_id(spec: str) -> bool:
    """Whether `spec` is spelled as a Hugging Face model id ORG/NAME (huggingface_hub's rules: each side 1-96
    letters, digits, `_`, `-`, `.`, not starting or ending with `-` or `.`; no `--` or `..`)."""
    return _HUB_ID.fullmatch(spec) is not None and "--" not in spec and ".." not in spec and not spec.endswith(".git")


def local_model(spec: str | Path, weights: bool = True) -> Path:
    """The local directory of model source `spec`: the path itself (`~` expanded, absolute) when it exists
    or is not spelled as a Hugging Face id; else the id's snapshot in the Hugging Face cache, downloaded
    when it is not there and huggingface_hub is online. `weights=False` fetches no weights but a lone
    model.safetensors (configs and the index tell the architecture). A CheckpointError, one line naming
    the id and the cache directory, when the id is neither cached nor downloadable."""
    path = Path(spec).expanduser()
    if path.exists() or not is_hub_id(str(spec)):
        return path.absolute()
    return _snapshot(str(spec), weights, path.absolute())


def _has_weights(folder: Path) -> bool:
    """Whether every weight file the index of `folder` lists is there (without an index: any safetensors)."""
    index = folder / INDEX_FILE
    if not index.is_file():
        return any(folder.glob("*.safetensors"))
    try:
        files = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError):
        return True   # a corrupt index: the reader names it
    return all((folder / name).is_file() for name in files)


def _snapshot(repo_id: str, weights: bool, path: Path) -> Path:
    """`repo_id`'s snapshot directory (see `local_model`; `path`: the local path of the same spelling): the
    cache's copy when it is complete, else a download (`allow_patterns`: what a model source reads)."""
    from huggingface_hub import constants, snapshot_download

    patterns = list(CONFIG_PATTERNS + (WEIGHT_PATTERNS if weights else ()))
    held = "is not in"
    try:
        cached = Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
        if not weights or _has_weights(cached):
            return cached
        held = "has no complete copy in"   # its configs, fetched for a config, but not all its weights
    except OSError:   # LocalEntryNotFoundError: not cached, or only in part
        pass
    where = f"{path} does not exist, and the Hugging Face model {repo_id} {held} the cache {constants.HF_HUB_CACHE}"
    if constants.HF_HUB_OFFLINE:
        raise CheckpointError(f"{where} (offline: HF_HUB_OFFLINE=1)")
    log.info("downloading %s%s into %s", repo_id, "" if weights else " (configs and tokenizer)", constants.HF_HUB_CACHE)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:   # noqa: BLE001 - the Hub's errors (HTTP, connection; classes vary by version): one line
        detail = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{where}, and it does not download: {type(e).__name__}: {detail}") from None

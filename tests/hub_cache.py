"""A Hugging Face cache laid out as huggingface_hub's downloads lay it out, from a local model directory
(tests never reach the Hub: HF_HUB_OFFLINE=1, tests/conftest.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from huggingface_hub.file_download import repo_folder_name

COMMIT = "0123456789abcdef0123456789abcdef01234567"   # a snapshot's commit hash (40 hex digits)


def _blob_name(data: bytes, lfs: bool) -> str:
    """The blob's file name in the cache: an LFS file's sha256, a git file's blob sha1 (its etag)."""
    if lfs:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def cache_model(cache: Path, repo_id: str, src: Path, names=None, commit: str = COMMIT) -> Path:
    """The files of directory `src` (or only `names`) in the cache `cache` as model `repo_id`:
    models--ORG--NAME/blobs/HASH, snapshots/COMMIT/NAME relative symlinks to them, refs/main naming the
    commit. Returns the snapshot directory."""
    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in names if names is not None else sorted(p.name for p in src.iterdir() if p.is_file()):
        data = (src / name).read_bytes()
        blob = repo / "blobs" / _blob_name(data, lfs=name.endswith(".safetensors"))
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)   # huggingface_hub writes the hash with no newline
    return snapshot

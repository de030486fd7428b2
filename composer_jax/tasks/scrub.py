"""Leak-free workspaces: nothing of the deleted code may be recoverable from a task's directory.

1. The clean copy (`clean_copy`) leaves out history, caches, bytecode and build output: `.git` and
   other VCS data, `__pycache__`/`*.pyc`, type-checker and linter caches (`.mypy_cache`, `.pytype`,
   `.pyright`, `.ruff_cache`), `.pytest_cache`, `.tox`, `.nox`, virtual environments, and
   `build/`, `dist/`, `*.egg-info`, wheels and eggs: a type-checker cache holds signatures, bytecode
   decompiles, an sdist or a build directory holds the whole module.
2. Per task, at every level (levels.py), `leak_needles` are the deleted code's lines (stripped),
   string constants and removed helper names that occur nowhere in the code that stays (the
   repository's Python files after the deletion, and its test files); `scrub_leaks` deletes every
   other file that contains one (docs, changelogs or READMEs quoting the code, anything else) and
   symlinks that point out of the workspace; `find_leaks` scans every file's bytes (binary ones
   included) for them. An injected bug's needles are the original lines it changed (`line_needles`).
3. `installed_copies`: the repository's packages must not be importable in the sandbox without the
   workspace (an installed copy would hand the agent the deleted code, and shadow its work).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from composer_jax.sandbox import Sandbox
from composer_jax.tasks.features import Deletion, FileEdit
from composer_jax.tasks.tracing import FeatureDeletionError
from composer_jax.tasks.workspace import NEVER_COPIED, TEST_DIRS, copy_repo, is_test_file

SCRUBBED = (*NEVER_COPIED, ".pytype", ".pyright", ".dmypy.json", "*.egg-info", "*.dist-info", ".eggs", "*.egg",
            "*.whl", ".venv", "site-packages", ".ipynb_checkpoints", "htmlcov", ".coverage.*")
SCRUBBED_AT_ROOT = ("build", "dist", "venv", "PKG-INFO")   # deeper down, such names may be the package's own
MIN_NEEDLE_CHARS = 10     # shorter lines and strings ('return x') are too common to tell anything
MIN_NAME_CHARS = 6


def clean_copy(src: Path, dst: Path) -> Path:
    """Copy a repository without history, caches, bytecode, environments or build output."""
    return copy_repo(src, dst, exclude=SCRUBBED, exclude_at_root=SCRUBBED_AT_ROOT)


def _files(root: Path) -> Iterable[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            yield Path(dirpath) / name


def repo_texts(repo: Path) -> dict[str, str]:
    """{relative path: text} of the code an agent may legitimately see in a clean copy: every Python
    file and every test file (symlinks aside)."""
    texts = {}
    for path in _files(repo):
        rel = path.relative_to(repo).as_posix()
        if not path.is_symlink() and (rel.endswith(".py") or is_test_file(rel)):
            texts[rel] = path.read_text(encoding="utf-8", errors="replace")
    return texts


def kept_code(texts: dict[str, str], files: Iterable[FileEdit]) -> list[str]:
    """repo_texts with the changed modules as they are after the edits `files` (a deleted one left out)."""
    edited = {f.path: f.modified for f in files}
    after = (edited.get(rel, text) for rel, text in texts.items())
    return [text for text in after if text is not None]


def leak_needles(deletion: Deletion, kept: list[str]) -> set[str]:
    """What must not appear anywhere in a task directory but solution.patch: the deleted lines, string
    constants and helper names that the kept code does not contain (see the module docstring)."""
    more = {s for s in deletion.strings if len(s.strip()) >= MIN_NEEDLE_CHARS and "\n" not in s.strip()}
    # names of removed private helpers; not the feature's own (the instruction names it), nor dunders
    more |= {h.name for h in deletion.helpers if len(h.name) >= MIN_NAME_CHARS and h is not deletion.feature
             and not (h.name.startswith("__") and h.name.endswith("__"))}
    return line_needles(deletion.removed, kept, more)


def line_needles(lines: Iterable[str], kept: list[str], more: Iterable[str] = ()) -> set[str]:
    """The `lines` (stripped, at least MIN_NEEDLE_CHARS long) and `more` strings that the kept code
    (kept_code) does not contain: what a task directory must not hold."""
    blob = "\n".join(kept)
    found = {line.strip() for line in lines if len(line.strip()) >= MIN_NEEDLE_CHARS} | set(more)
    return {n for n in found if n not in blob}


def _escapes(root: Path, link: Path) -> bool:
    target = os.path.normpath(os.path.join(link.parent, os.readlink(link)))
    return not (target + os.sep).startswith(str(root) + os.sep)


def find_leaks(root: Path, needles: set[str], *, skip: Iterable[Path] = ()) -> dict[str, str]:
    """{path relative to root: why} for every file under `root` (hidden, binary, in caches: all of
    them; symlinks are judged by where they point) holding a needle, and every symlink that leaves
    root. `skip`: files not to scan (solution.patch)."""
    root = Path(os.path.abspath(root))
    skipped = {Path(os.path.abspath(p)) for p in skip}
    encoded = sorted((n.encode("utf-8"), n) for n in needles)
    leaks = {}
    for path in _files(root):
        rel = path.relative_to(root).as_posix()
        if path in skipped:
            continue
        if path.is_symlink():
            if _escapes(root, path):
                leaks[rel] = f"a symlink out of the workspace ({os.readlink(path)})"
            continue
        data = path.read_bytes()
        hit = next((text for needle, text in encoded if needle in data), None)
        if hit is not None:
            leaks[rel] = f"holds deleted code: {hit[:60]!r}"
    return leaks


def scrub_leaks(repo: Path, needles: set[str]) -> dict[str, str]:
    """Delete from `repo` every file that leaks (find_leaks); returns {path: why} of what went."""
    leaks = find_leaks(repo, needles)
    for rel in leaks:
        (repo / rel).unlink()
    return leaks


def top_level_names(repo: Path) -> list[str]:
    """The importable names the repository provides: packages (directories with __init__.py) and
    modules at its root or under src/, not tests, setup.py or conftest.py."""
    names = set()
    for base in (repo, repo / "src"):
        for entry in base.iterdir() if base.is_dir() else ():
            if entry.is_dir():
                if entry.name.isidentifier() and entry.name not in TEST_DIRS and (entry / "__init__.py").is_file():
                    names.add(entry.name)
            elif (entry.suffix == ".py" and entry.stem.isidentifier() and entry.stem not in ("setup", "noxfile")
                  and not is_test_file(entry.name)):
                names.add(entry.stem)
    return sorted(names)


_FIND = ("import importlib.util, json, sys\n"
         "found = {}\n"
         "for name in sys.argv[1:]:\n"
         "    try:\n"
         "        spec = importlib.util.find_spec(name)\n"
         "    except Exception:\n"
         "        spec = None\n"
         "    if spec is not None:\n"
         "        found[name] = spec.origin or ', '.join(spec.submodule_search_locations or []) or '?'\n"
         "print(json.dumps(found))\n")


def installed_copies(sandbox: Sandbox, names: list[str]) -> dict[str, str]:
    """{name: where} for each of `names` that the sandbox's Python imports from outside the workspace
    (run from an empty directory)."""
    if not names:
        return {}
    with tempfile.TemporaryDirectory(prefix="composer_jax-imports-") as empty:
        result = sandbox.run(["python", "-I", "-c", _FIND, *names], empty)
    if not result.ok:
        raise FeatureDeletionError(f"cannot look for installed copies of {', '.join(names)} in the sandbox: "
                                   f"{result.describe()}: {result.stderr.strip()[-300:]}")
    return json.loads(result.stdout)

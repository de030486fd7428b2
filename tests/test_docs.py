"""The documentation: the MkDocs site builds with --strict (no broken link or anchor, no page missing or
left out of nav), the config-key reference is the output of the command that generates it, and the
README's links and test command hold."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from composer_jax import cli

REPO = Path(__file__).resolve().parents[1]


def test_the_site_builds_strict_without_a_warning(tmp_path):
    pytest.importorskip("mkdocs")   # a test dependency: missing under CI fails the run (conftest.py)
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "WARNING" not in proc.stderr + proc.stdout, proc.stderr + proc.stdout
    pages = {p.relative_to(REPO / "docs").with_suffix("").as_posix() for p in (REPO / "docs").rglob("*.md")}
    built = {p.parent.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    assert pages - {"index"} <= built, pages - built


def test_a_broken_link_fails_the_build(tmp_path):
    """The check above can fail: the same build of a copy of the docs with one link to a missing page."""
    pytest.importorskip("mkdocs")
    docs = tmp_path / "docs"
    subprocess.run(["cp", "-r", str(REPO / "docs"), str(docs)], check=True)
    (docs / "testing.md").write_text((docs / "testing.md").read_text() + "\n[gone](no-such-page.md)\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text((REPO / "mkdocs.yml").read_text())
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(tmp_path / "site")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no-such-page.md" in proc.stderr, proc.stderr


def test_the_config_keys_page_is_the_commands_output(capsys):
    """Regenerate with `composer-jax config keys --markdown > docs/config-keys.md`."""
    assert cli.main(["config", "keys", "--markdown"]) == 0
    page = capsys.readouterr().out
    assert page == (REPO / "docs" / "config-keys.md").read_text(), (
        "docs/config-keys.md is stale: run `composer-jax config keys --markdown > docs/config-keys.md`")
    source = (REPO / "composer_jax" / "rl" / "run_config.py").read_text()
    comment = re.search(r"^    batch_size: int = 16 +# (.+)$", source, re.M)[1]
    assert f"| `rollout.batch_size` | int | `16` | {comment} |" in page
    for kind in ("run", "rl", "model", "generate", "eval"):
        assert f"\n## {kind}\n" in page
    assert "| `model.vocab_size` |" not in page and "| `vocab_size` | int | `(required)` |" in page


def test_the_readme_links_exist_and_its_test_command_is_ci():
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme)
    assert links and all((REPO / link).exists() for link in links), [k for k in links if not (REPO / k).exists()]
    assert "python -m pytest -q -n 2" in readme and "python -m pytest -q -n 2" in (REPO / ".ci" / "run").read_text()
    assert len(readme.splitlines()) <= 250

"""The manual builds as a site in MkDocs' strict mode: a broken link, a link to an
anchor that is not there, a page missing from the navigation or a missing snippet
fails `make test` (and so CI), as it fails `make docs`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    # from the root: the changelog snippet's base path is the checkout
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
         "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def test_the_manual_builds_strict(tmp_path: Path) -> None:
    done = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    home = (tmp_path / "site" / "index.html").read_text()
    assert "exactly-once" in home
    # the root CHANGELOG.md is a page of the site
    changelog = (tmp_path / "site" / "changelog" / "index.html").read_text()
    assert "Unreleased" in changelog and "0.1.0" in changelog


def _copy(tmp_path: Path) -> tuple[Path, Path]:
    """The manual's config and pages copied, so a test can break a page."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    path = tmp_path / "mkdocs.yml"  # the manual's own settings, over the copied pages
    path.write_text(yaml.safe_dump({"INHERIT": str(ROOT / "mkdocs.yml"), "docs_dir": str(docs)}))
    return path, docs


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    config, docs = _copy(tmp_path)
    page = docs / "getting-started.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    done = _build(config, tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stdout + done.stderr


def test_a_page_left_out_of_the_navigation_fails_the_build(tmp_path: Path) -> None:
    config, docs = _copy(tmp_path)
    (docs / "orphan.md").write_text("# Orphan\n")
    done = _build(config, tmp_path / "site")
    assert done.returncode != 0
    assert "orphan.md" in done.stdout + done.stderr


def test_a_link_out_of_the_manual_fails_the_build(tmp_path: Path) -> None:
    # README.md and the design notes are not pages: a link to them is broken on the site
    config, docs = _copy(tmp_path)
    page = docs / "concepts.md"
    page.write_text(page.read_text() + "\nSee [the README](../README.md).\n")
    done = _build(config, tmp_path / "site")
    assert done.returncode != 0
    assert "README.md" in done.stdout + done.stderr

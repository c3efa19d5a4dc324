"""The documentation site (mkdocs.yml over docs/) builds with ``mkdocs build --strict``: every page is in the nav,
every link between pages and to a heading resolves, every link to a repository file names a file; and the README's
own relative links land on a file, and on a heading of the page they name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--quiet",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}\n{build.stderr}"
    return out


def test_the_site_builds_strict_with_every_page(site: Path) -> None:
    """mkdocs build --strict succeeds (no broken link or anchor, no page left out of the nav) and renders each page."""
    for page in (ROOT / "docs").glob("*.md"):
        built = site / "index.html" if page.stem == "index" else site / page.stem / "index.html"
        assert built.is_file(), f"docs/{page.name} was not rendered"


def test_readme_links_resolve(site: Path) -> None:
    """Each relative link of the README names an existing file, and each #anchor into docs/ a heading of that page."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert len(relative) > 20
    for link in relative:
        assert not link.startswith("#"), f"README links {link}, a section that moved to docs/: link the page"
        path, _, anchor = link.partition("#")
        assert (ROOT / path).exists(), f"README links {link}: no such file"
        if anchor:
            assert path.startswith("docs/") and path.endswith(".md"), link
            built = site / Path(path).stem / "index.html"
            assert f'id="{anchor}"' in built.read_text(), f"README links {link}: no such heading"

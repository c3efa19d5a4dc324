"""MkDocs hook (mkdocs.yml ``hooks:``): links from docs/ to the repository's other files become GitHub links.

A page links ``../examples/leader_election.py`` so that the link works where the Markdown is read on GitHub. The site
has no such file, so the build turns the link into one to the file on GitHub, and fails (one line naming the page and
the link) when the file does not exist in the repository: under ``--strict`` every link is checked.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

# ](target) or ](target#anchor): a Markdown link or image whose target leaves docs/ (starts with ../).
_OUTSIDE = re.compile(r"\]\((\.\./[^)\s#]*)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    root = docs_dir.parent
    page_dir = (docs_dir / page.file.src_uri).parent
    blob = str(config["repo_url"]).rstrip("/") + "/blob/main/"
    tree = str(config["repo_url"]).rstrip("/") + "/tree/main/"

    def rewrite(match: re.Match[str]) -> str:
        target = (page_dir / match.group(1)).resolve()
        if target.is_relative_to(docs_dir):
            return match.group(0)  # a page or an image: MkDocs checks it itself
        if not target.is_relative_to(root) or not target.exists():
            raise PluginError(f"{page.file.src_uri}: the link {match.group(1)} names no file of the repository")
        path = target.relative_to(root).as_posix()
        return f"]({(tree if target.is_dir() else blob) + path}{match.group(2) or ''})"

    return _OUTSIDE.sub(rewrite, markdown)

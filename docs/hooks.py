"""mkdocs hook: pages link the repository's own files (scripts, their results, the package's modules) with paths
that work on GitHub (`../scripts/benchmark/benchmark.py` from `docs/performance.md`); the site gets copies of those
files and the links are pointed at them, so `mkdocs build --strict` checks that every linked file exists.

Not a page of the site: `exclude_docs` in mkdocs.yml leaves it out.
"""

from __future__ import annotations

import os
import re

from mkdocs.structure.files import File, Files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Folders of the repository whose files pages may link; each is copied into the site under the same path.
LINKED = ("scripts", "hf_fsdp2", "recipes", "tests")
LINK = re.compile(r"\]\((?P<up>(?:\.\./)+)(?P<path>(?:" + "|".join(LINKED) + r")/[^)#\s]*)")


def on_files(files: Files, config) -> Files:
    """Add the repository files the pages link to."""
    for page in [f for f in files if f.src_uri.endswith(".md")]:
        with open(page.abs_src_path, encoding="utf-8") as f:
            text = f.read()
        for match in LINK.finditer(text):
            path = match["path"]
            if files.get_file_from_path(path) is None and os.path.isfile(os.path.join(ROOT, path)):
                files.append(File(path, ROOT, config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """Point a link that leaves docs/ for a repository file at the site's copy of it (one `../` less)."""
    depth = page.file.src_uri.count("/")

    def relink(match: re.Match) -> str:
        if len(match["up"]) // 3 != depth + 1:
            return match[0]
        return "](" + "../" * depth + match["path"]

    return LINK.sub(relink, markdown)

"""The generated parts of the docs pages: text between `<!-- NAME:begin -->` and `<!-- NAME:end -->`, which tests
compare with what a script renders from its committed results."""

from __future__ import annotations

import os

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def marked_block(page: str, name: str) -> str:
    """The text of docs/`page` between <!-- NAME:begin --> (and its newline) and <!-- NAME:end -->."""
    with open(os.path.join(DOCS, page)) as f:
        text = f.read()
    begin, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
    return text[text.index(begin) + len(begin) : text.index(end)]

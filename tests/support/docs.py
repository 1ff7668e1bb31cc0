"""The documented commands and scripts, found where they are written.

Every command and script in the README and in ``docs/`` sits in a fenced block between
``<!-- NAME:start -->`` and ``<!-- NAME:end -->``; a test runs it. A block's name is
unique across the README and the docs, so a guide can move between pages without its
test noticing, and a block that disappears fails its test by name.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"


def pages() -> list[Path]:
    """The README and every page of the docs site."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def text() -> str:
    """Everything the README and the docs say, one page after another."""
    return "\n".join(p.read_text() for p in pages())


def block(name: str, lang: str = r"\w+") -> str:
    """The body of the fenced block marked ``name`` (exactly one, in any page)."""
    pattern = re.compile(
        rf"<!-- {re.escape(name)}:start -->\s*```{lang}\n(.*?)```\s*<!-- {re.escape(name)}:end -->",
        re.S,
    )
    found = [(p, m.group(1)) for p in pages() for m in pattern.finditer(p.read_text())]
    if len(found) != 1:
        where = ", ".join(str(p.relative_to(REPO)) for p, _ in found) or "nowhere"
        raise AssertionError(f"the docs should hold one {name!r} block ({lang}); found: {where}")
    return found[0][1]


def marked_blocks() -> dict[str, str]:
    """Every marked block's name, by page (to check none is left unrun)."""
    out = {}
    for p in pages():
        for m in re.finditer(r"<!-- ([a-z0-9-]+):start -->", p.read_text()):
            out[m.group(1)] = str(p.relative_to(REPO))
    return out

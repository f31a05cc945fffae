"""The README and docs/ stay inside the repository: every relative link names a file or folder of
this checkout, and no page points at a path above it (a clone has nothing there)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if not re.match(r"^(https?:|mailto:|#)", t)]


def broken(page: Path) -> list[str]:
    out = []
    for target in relative_links(page.read_text()):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            out.append(target)
    return out


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves_inside_the_repository(page):
    assert broken(page) == []


def test_the_checker_catches_a_missing_file_and_a_path_outside(tmp_path):
    page = ROOT / "docs" / "architecture.md"
    fake = tmp_path / "page.md"
    fake.write_text(page.read_text() + "\n[gone](nope.md) [out](../../shared/ARCHITECTURE.md)\n")
    assert relative_links(fake.read_text())[-2:] == ["nope.md", "../../shared/ARCHITECTURE.md"]
    assert {"nope.md", "../../shared/ARCHITECTURE.md"} <= set(broken(fake))

"""MkDocs hook: pages under docs/<section>/ that mkdocs.yml's nav does not name are added to
their section (so a page another change adds shows without editing the nav), and nav
entries whose page is neither on disk nor generated are dropped with a warning (which
`mkdocs build --strict` turns into a failure)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.nav")

#: docs/<folder>/ -> the nav section its unlisted pages join
SECTIONS = {"concepts": "Concepts", "guides": "Guides", "design": "Design", "results": "Results"}


def _listed(items: list[Any], out: set[str]) -> None:
    for item in items:
        if isinstance(item, str):
            out.add(item)
        elif isinstance(item, dict):
            for value in item.values():
                if isinstance(value, str):
                    out.add(value)
                elif isinstance(value, list):
                    _listed(value, out)


def _section(nav: list[Any], title: str) -> list[Any] | None:
    for item in nav:
        if isinstance(item, dict) and isinstance(item.get(title), list):
            return item[title]  # type: ignore[no-any-return]
    return None


def _title(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem.replace("-", " ").capitalize()


def on_config(config: Any) -> Any:
    docs = Path(config["docs_dir"])
    nav = config["nav"]
    listed: set[str] = set()
    _listed(nav, listed)
    for page in sorted(docs.rglob("*.md")):
        rel = page.relative_to(docs).as_posix()
        top = rel.split("/", 1)[0]
        if rel in listed or top not in SECTIONS:
            continue
        section = _section(nav, SECTIONS[top])
        if section is None:
            continue
        section.append({_title(page): rel})
        log.info("nav: %s added to %s", rel, SECTIONS[top])
    return config

"""MkDocs hooks of the documentation site (mkdocs.yml names this file).

* `<!-- generated: config -->` and `<!-- generated: cli -->` in a page become the
  config fields (from the pydantic models) and every command's help
  (scripts/docs_reference.py): the reference is built from the code.
* Pages that other work adds (`OPTIONAL` below) have their places in the nav
  already. Until such a page exists, its nav entry is left out, and a link to it
  reads as plain text with "(to come)", so that the strict build passes.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any


def _reference() -> Any:
    """scripts/docs_reference.py, loaded by its path (this folder is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "docs_reference", Path(__file__).resolve().parent / "docs_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


OPTIONAL = ("privacy.md", "operations.md", "architecture-server.md", "problems-authoring.md")


def _present(docs_dir: str, page: str) -> bool:
    return (Path(docs_dir) / page).is_file()


def _prune(nav: Any, docs_dir: str) -> Any:
    if isinstance(nav, list):
        kept = [_prune(item, docs_dir) for item in nav]
        return [item for item in kept if item is not None]
    if isinstance(nav, dict):
        ((title, target),) = nav.items()
        pruned = _prune(target, docs_dir)
        return None if pruned is None else {title: pruned}
    if isinstance(nav, str) and nav in OPTIONAL and not _present(docs_dir, nav):
        return None
    return nav


def on_config(config: Any) -> Any:
    config["nav"] = _prune(config["nav"], config["docs_dir"])
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if "<!-- generated: " in markdown:
        reference = _reference()
        markdown = markdown.replace("<!-- generated: config -->", reference.config_reference())
        markdown = markdown.replace("<!-- generated: cli -->", reference.cli_reference())
    for optional in OPTIONAL:
        if not _present(config["docs_dir"], optional):
            pattern = r"\[([^\]]+)\]\((?:\.\./)*" + re.escape(optional) + r"(#[^)]*)?\)"
            markdown = re.sub(pattern, r"\1 (to come)", markdown)
    return markdown

"""The documentation: README.md's links all resolve (its length: tests/test_docs_hygiene.py), and the MkDocs site
under docs/ (mkdocs.yml) builds with `mkdocs build --strict`: no broken link or anchor, no page
missing from the navigation, no docstring that mkdocstrings cannot render."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

_IMG_SRC = re.compile(r"<img\s[^>]*\bsrc\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)  # raw HTML images


def _tokens(text: str):
    """The Markdown's inline tokens, parsed by markdown-it-py (CommonMark: code blocks hold no links)."""
    from markdown_it import MarkdownIt

    for block in MarkdownIt("commonmark").parse(text):
        if block.type == "html_block":
            yield block
        for child in block.children or ():
            yield child


def _links(text: str) -> list[str]:
    """Every link and image target, raw HTML <img> included, in document order."""
    out = []
    for tok in _tokens(text):
        if tok.type == "link_open":
            out.append(str(tok.attrs["href"]))
        elif tok.type == "image":
            out.append(str(tok.attrs["src"]))
        elif tok.type in ("html_inline", "html_block"):
            out += _IMG_SRC.findall(tok.content)
    return out


def _relative_targets(text: str) -> list[str]:
    return [t for t in _links(text) if not re.match(r"^(https?:|mailto:|#)", t)]


def test_mkdocs_build_strict(tmp_path):
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        pytest.skip("mkdocs is not installed: the `docs` extra (pip install -e '.[docs]', part of `make test`)")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    if proc.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "encoder" / "index.html").is_file()


def _anchors(md_file: Path) -> set[str]:
    """The anchors MkDocs' toc gives the file's headings (Python-Markdown's slugify, as GitHub for these)."""
    from markdown.extensions.toc import slugify
    from markdown_it import MarkdownIt

    blocks = MarkdownIt("commonmark").parse(md_file.read_text(encoding="utf-8"))
    return {slugify("".join(c.content for c in inline.children), "-")
            for opening, inline in zip(blocks, blocks[1:]) if opening.type == "heading_open"}


def test_readme_relative_links_resolve():
    text = README.read_text(encoding="utf-8")
    targets = _relative_targets(text)
    assert targets, "README.md links to no docs page"
    missing = [t for t in targets if t.split("#", 1)[0] and not (REPO / t.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
    # Anchors: into a Markdown file (README's own "#..." links included).
    linked = [t for t in targets if "#" in t and t.split("#", 1)[0].endswith(".md")]
    linked += [f"README.md{t}" for t in _links(text) if t.startswith("#")]
    bad = [t for t in linked if t.split("#", 1)[1] not in _anchors(REPO / t.split("#", 1)[0])]
    assert not bad, f"README.md links to anchors that do not exist: {bad}"


def test_link_parser_sees_links_and_images():
    sample = ('See [docs](docs/cli.md#x), ![pic](docs/a.png "t") and <img src="docs/b.png" width=3>, '
              "[web](https://example.org), [anchor](#here).\n```\n[not](a/link.md)\n```\n")
    assert _relative_targets(sample) == ["docs/cli.md#x", "docs/a.png", "docs/b.png"]
    assert {"what-encoder-picks", "set-up-from-a-checkout-two-commands"} <= _anchors(REPO / "docs" / "which-file.md") \
        | _anchors(REPO / "docs" / "install.md")

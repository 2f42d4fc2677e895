"""Prose extraction and sentence splitting for building position-labelled sets from real documents.

`prose_blocks` keeps the paragraphs of a plain-text or Markdown document that
read as prose and drops what does not (code, grammar rules, tables, headings),
because a query drawn from a code block says little about how an encoder reads
prose.  `split_sentences` returns sentence spans as character offsets, so a
query can always be traced back to the exact place it came from.

The splitter is a small rule set (sentence-final punctuation followed by a
capitalised word, with common abbreviations and initials protected) rather
than a trained model: it is deterministic, has no data files to download and
is good enough for choosing query sentences, which only need to be whole
sentences, not a perfect segmentation.
"""

from __future__ import annotations

import re

# Words ending in "." that do not end a sentence (lower-cased, without the final dot).
ABBREVIATIONS = frozenset(
    "e.g i.e etc vs cf al approx ca dr mr mrs ms prof st no nos fig figs eq eqs sec vol pp p ed eds jr sr inc ltd "
    "co corp dept est min max resp viz incl".split()
)
_FENCE = re.compile(r"^\s*(```|~~~)")
_UNDERLINE = re.compile(r"^\s*([=*\-~^#+`\"'.:_])\1{2,}\s*$")
_ATX_HEADING = re.compile(r"^\s{0,3}#{1,6}\s")
_TABLE = re.compile(r"^\s*(\||\+[-=+])")
_MD_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_HTML_TAG = re.compile(r"</?[A-Za-z][^>]*>")
_WORD = re.compile(r"[A-Za-z][A-Za-z'’-]*")
# A candidate boundary: ., ! or ? (maybe followed by closing quotes/brackets), whitespace, then an opener.
_BOUNDARY = re.compile(r"([.!?])([\"'”’)\]]*)(\s+)(?=[\"'“‘(\[]?[A-Z0-9])")


def _prose_like(text: str, was_indented: bool) -> bool:
    """True for running text: mostly words, no prompt or grammar markers, ending a sentence.

    A non-indented block may also end in ":" (it introduces a list or an
    example); a block ending mid-sentence is what is left around a dropped
    code example, and is dropped too.
    """
    if ">>>" in text or "::=" in text:
        return False
    tokens = text.split()
    if len(tokens) < 4:
        return False
    words = sum(1 for t in tokens if _WORD.fullmatch(t.strip(".,;:!?()\"'“”‘’*")))
    if words / len(tokens) < 0.6:
        return False
    end = text.rstrip("\"'”’)*")
    return end.endswith((".", "!", "?")) or (not was_indented and end.endswith(":"))


def prose_blocks(text: str, markdown: bool = False) -> list[str]:
    """The prose paragraphs of a document, each joined to one line with single spaces.

    Dropped: fenced code blocks, headings (Markdown `#` and underlined ones),
    tables, and blocks that are not prose (see `_prose_like`).  Markdown links
    keep their text; HTML tags are removed.
    """
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    kept: list[str] = []
    in_fence = False
    for line in lines:
        if _FENCE.match(line):
            in_fence = not in_fence
            kept.append("")
            continue
        kept.append("" if in_fence else line)
    blocks: list[list[str]] = [[]]
    for line in kept:
        if line.strip():
            blocks[-1].append(line)
        elif blocks[-1]:
            blocks.append([])
    out = []
    for block in blocks:
        body = []
        for i, line in enumerate(block):
            if _UNDERLINE.match(line) or _TABLE.match(line) or (markdown and _ATX_HEADING.match(line)):
                continue
            if i + 1 < len(block) and _UNDERLINE.match(block[i + 1]):
                continue  # the title above an underline
            body.append(line)
        if not body:
            continue
        indented = body[0][:1].isspace()
        joined = " ".join(line.strip() for line in body)
        if markdown:
            joined = _HTML_TAG.sub("", _MD_LINK.sub(r"\1", joined))
        joined = re.sub(r"\s+", " ", joined).strip()
        if _prose_like(joined, indented):
            out.append(joined)
    return out


def _is_abbreviation(text: str, dot: int) -> bool:
    """Whether the "." at index `dot` ends an abbreviation or an initial rather than a sentence."""
    start = dot
    while start > 0 and not text[start - 1].isspace() and text[start - 1] not in "(\"'“‘[":
        start -= 1
    word = text[start:dot]
    if len(word) == 1 and word.isalpha() and word.isupper():
        return True  # an initial: "J. Smith"
    return word.lower() in ABBREVIATIONS


def split_sentences(text: str) -> list[tuple[int, int]]:
    """Sentence spans (start, end) of one paragraph, in order; together they cover all non-space text."""
    spans: list[tuple[int, int]] = []
    start = 0
    for m in _BOUNDARY.finditer(text):
        if m.group(1) == "." and _is_abbreviation(text, m.start(1)):
            continue
        end = m.end(2)
        if text[start:end].strip():
            spans.append((start, end))
        start = m.end(3)
    if text[start:].strip():
        spans.append((start, len(text.rstrip())))
    return spans


def words(text: str) -> list[str]:
    """Alphabetic words of a text (used to judge whether a sentence can become a query)."""
    return _WORD.findall(text)

"""The documentation: README.md's links all resolve (its length: tests/test_docs_hygiene.py), and the MkDocs site
under docs/ (mkdocs.yml) builds with `mkdocs build --strict`: no broken link or anchor, no page
missing from the navigation, no docstring that mkdocstrings cannot render."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from test_generated_docs import _resolve as resolve_dotted, generate

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


# -- prose that cannot drift (the conventions: docs/development.md, "Writing docs") -------------------------

PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console", "zsh"}
RUNNABLE = "<!-- runnable -->"
_ILLUSTRATIVE = re.compile(r"^<!-- illustrative: (\S.*?) -->$")
_NOT_MEASURED = re.compile(r"^<!-- not measured: (\S.*?) -->$")
_GENERATED = re.compile(r"<!-- generated: (\S+) by docs/generate.py -->.*?<!-- end generated: \1 -->", re.DOTALL)
# The record of superseded measurements (dated entries, naming what existed then) and the changelog page that
# includes CHANGELOG.md: history, exempt from the name, figure and claim checks.
HISTORY_PAGES = {"performance-log.md", "changelog.md"}


@dataclasses.dataclass(frozen=True)
class Fence:
    page: Path
    line: int          # 1-based line of the opening fence
    info: str
    code: str
    marker: str        # the line right above the opening fence

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def fences(page: Path, text: str | None = None) -> list[Fence]:
    from markdown_it import MarkdownIt

    text = page.read_text(encoding="utf-8") if text is None else text
    lines = text.splitlines()
    return [Fence(page, t.map[0] + 1, t.info.strip(), t.content,
                  lines[t.map[0] - 1].strip() if t.map[0] > 0 else "")
            for t in MarkdownIt("commonmark").parse(text) if t.type == "fence"]


def fence_problems(blocks: list[Fence]) -> list[str]:
    out = []
    for f in blocks:
        if not f.info:
            out.append(f"{f.id}: a fenced block without a language (bash, python, text, ...)")
        elif f.info.split()[0] in SHELL and f.marker != RUNNABLE and not _ILLUSTRATIVE.match(f.marker):
            out.append(f"{f.id}: a shell block needs `{RUNNABLE}` or `<!-- illustrative: REASON -->` "
                       "on the line above it")
    return out


def _all_fences() -> list[Fence]:
    return [f for page in PAGES for f in fences(page)]


def test_every_shell_block_is_runnable_or_illustrative():
    problems = fence_problems(_all_fences())
    assert not problems, "shell blocks (docs/development.md, Writing docs):\n" + "\n".join(problems)


def test_fence_check_sees_an_unmarked_block():
    page = REPO / "docs" / "planted.md"
    text = ("# P\n\n```bash\nattncal doctor\n```\n\n<!-- illustrative: needs a GPU -->\n```bash\nnvidia-smi\n```\n\n"
            "<!-- illustrative: -->\n```bash\nx\n```\n\n```\nplain\n```\n\n<!-- runnable -->\n```bash\ntrue\n```\n")
    problems = fence_problems(fences(page, text))
    assert [p.split(":", 2)[1] for p in problems] == ["3", "13", "17"], problems


# The runnable blocks run in order (README first), in one process of the suite: an export an earlier block
# made with the same arguments is copied instead of being made again.
_EXPORT_LINE = re.compile(r"^attncal export (?P<args>[^#&|;]*?)\s*(?:#.*)?$")
_EXPORTS: dict[tuple[str, ...], Path] = {}
CORPUS = [{"id": "a", "text": "A man is playing a guitar."},
          {"id": "b", "text": "The new movie is awesome."},
          {"id": "c", "text": "A cheetah is running behind its prey."},
          {"id": "d", "text": "The cat sits outside on the mat."}]


def _export_key(args: str) -> tuple[tuple[str, ...], str | None]:
    words = shlex.split(args)
    out = None
    for flag in ("-o", "--out", "--output"):
        if flag in words:
            i = words.index(flag)
            out = words[i + 1]
            del words[i:i + 2]
    return tuple(words), out


def reuse_exports(code: str, cache: dict) -> tuple[str, list[tuple[tuple[str, ...], str]]]:
    """The block with each `attncal export` line an earlier block ran with the same arguments replaced by
    a copy of that export, and the exports this block makes (to remember once it passed)."""
    lines, made = [], []
    for line in code.splitlines():
        m = _EXPORT_LINE.match(line.strip())
        key, out = _export_key(m.group("args")) if m else ((), None)
        if out and key in cache:
            lines.append(f"cp -r {shlex.quote(str(cache[key]))} {shlex.quote(out)}")
        else:
            lines.append(line)
            if out:
                made.append((key, out))
    return "\n".join(lines) + "\n", made


def test_export_reuse_replaces_only_the_same_export(tmp_path):
    code = ("attncal export default -o a        # calibrated\n"
            "attncal export default -o b --no-calibration\n"
            "attncal inspect a\n")
    out, made = reuse_exports(code, {("default",): tmp_path / "x"})
    assert out.splitlines() == [f"cp -r {tmp_path / 'x'} a", "attncal export default -o b --no-calibration",
                                "attncal inspect a"]
    assert made == [(("default", "--no-calibration"), "b")]


_RUNNABLE_FENCES = [f for f in _all_fences() if f.marker == RUNNABLE]


@pytest.mark.parametrize("block", _RUNNABLE_FENCES, ids=lambda f: f.id)
def test_runnable_block(block, tmp_path_factory):
    work = tmp_path_factory.mktemp("block")
    (work / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CORPUS), encoding="utf-8")
    (work / "my-docs").mkdir()
    for i, r in enumerate(CORPUS[:3]):
        (work / "my-docs" / f"doc{i}.txt").write_text(r["text"] + "\n", encoding="utf-8")
    code, made = reuse_exports(block.code, _EXPORTS)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(["bash", "-eo", "pipefail", "-c", code], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (f"{block.id}: exit {proc.returncode}\n{code}\n--- stdout\n{proc.stdout[-3000:]}"
                                  f"\n--- stderr\n{proc.stderr[-5000:]}")
    for key, out in made:
        if (work / out).is_dir():
            _EXPORTS.setdefault(key, work / out)


# -- names in prose resolve --------------------------------------------------------------------------------

def _spans(text: str) -> list[tuple[int, str]]:
    """(line, content) of every inline code span outside fenced blocks and generated blocks."""
    from markdown_it import MarkdownIt

    text = _GENERATED.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    out = []
    for tok in MarkdownIt("commonmark").enable("table").parse(text):
        for child in tok.children or ():
            if child.type == "code_inline":
                out.append(((tok.map or [0])[0] + 1, child.content))
    return out


def _top_level() -> set[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    return {p.split("/", 1)[0] for p in listed} or {p.name for p in REPO.iterdir()}


@functools.cache
def _parser_options() -> tuple[dict[str, set[str]], set[str]]:
    import argparse

    from attncal.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    commands = {name: {o for a in sp._actions for o in a.option_strings} for name, sp in sub.items()}
    top = {o for a in parser._actions for o in a.option_strings}
    return commands, top | set().union(*commands.values())


@functools.cache
def _env_names() -> str:
    parts = [p.read_text(encoding="utf-8", errors="replace") for d in ("attncal", "plugins", "tests", "benchmarks")
             for p in (REPO / d).rglob("*") if p.is_file() and p.suffix in (".py", ".h", ".cc", ".cu", ".cmake", ".txt")
             and p.resolve() != Path(__file__).resolve()]
    return "\n".join(parts + [(REPO / "Makefile").read_text(encoding="utf-8")])


@functools.cache
def _script_sources() -> str:
    """The scripts' sources, whose options a bare `--option` may name (benchmarks/, tests/)."""
    return "\n".join(p.read_text(encoding="utf-8") for d in ("benchmarks", "tests") for p in (REPO / d).rglob("*.py")
                     if p.resolve() != Path(__file__).resolve())


# Where the platform wheel installs the native library (CMake's install step), not a file of the checkout.
INSTALLED_PATHS = ("attncal/lib/",)


@functools.cache
def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (REPO / "Makefile").read_text(encoding="utf-8"), re.MULTILINE))


def _resolves(dotted: str) -> bool:
    try:
        resolve_dotted(dotted)
    except (ImportError, AttributeError):
        return False
    return True


def _path_exists(word: str) -> bool:
    path, _, test = word.partition("::")
    path = path.rstrip("/")
    hits = sorted(REPO.glob(path)) if any(c in path for c in "*?[") else [REPO / path]
    if not any(h.exists() for h in hits):
        return False
    if test:
        name = test.split("::")[-1].split("[")[0]
        source = (REPO / path).read_text(encoding="utf-8")
        return re.search(rf"^\s*(?:async )?(?:def|class) {re.escape(name)}\b", source, re.MULTILINE) is not None
    return True


_WORD_END = ".,;:)('\""


def name_problems(span: str, top: set[str]) -> list[str]:
    """What a code span names that does not exist (empty when it names nothing of the project's)."""
    words = span.split()
    if not words:
        return []
    out = []
    commands, all_options = _parser_options()
    command = words[1].rstrip(":") if len(words) > 1 else ""
    if words[0] == "attncal" and command and not command.startswith("-") and not command.isupper():
        if command not in commands:
            out.append(f"`attncal {command}` is not a command")
        else:
            out += [f"`attncal {command}` has no option {w.split('=')[0]}" for w in words[2:]
                    if w.startswith("--") and w.split("=")[0] not in commands[command]]
    elif re.fullmatch(r"--[a-z][\w-]*(=\S*)?", words[0]) and words[0].split("=")[0] not in all_options \
            and f'"{words[0].split("=")[0]}"' not in _script_sources():
        out.append(f"{words[0].split('=')[0]} is no option of an attncal command or a script's")
    if words[0] == "make" and len(words) > 1 and not words[1].startswith("-") and "=" not in words[1]:
        if words[1] not in _make_targets():
            out.append(f"`make {words[1]}` is not a Makefile target")
    for raw in words:
        w = raw.strip(_WORD_END)
        if re.fullmatch(r"attncal(\.[A-Za-z_]\w*)+(\(.*)?", w):
            dotted = w.split("(")[0]
            if dotted != "attncal.json" and f'"{dotted}"' not in _env_names() and not _resolves(dotted):
                out.append(f"{dotted} does not resolve")
        elif "/" in w and w.split("/", 1)[0] in top and not re.search(r"[A-Z]{3,}|<|\{", w) \
                and not w.startswith(INSTALLED_PATHS):
            if not _path_exists(w):
                out.append(f"{w} does not exist")
        elif re.fullmatch(r"ATTNCAL_[A-Z0-9_]+", w) and f'"{w}"' not in _env_names() and w not in _env_names():
            out.append(f"{w} is read nowhere")
    return out


def test_names_in_prose_resolve():
    top = _top_level()
    problems = [f"{page.relative_to(REPO)}:{line}: {p}" for page in PAGES if page.name not in HISTORY_PAGES
                for line, span in _spans(page.read_text(encoding="utf-8")) for p in name_problems(span, top)]
    assert not problems, "names in the docs that do not resolve:\n" + "\n".join(problems)


def test_name_check_sees_what_does_not_exist():
    top = _top_level()
    bad = ["attncal calibrate", "attncal export --no-such-flag", "--no-such-flag", "make no-such-target",
           "tests/test_no_such_file.py", "tests/test_docs.py::test_no_such_test", "attncal.no_such_module",
           "attncal.runtime.Encoder.no_such_method", "ATTNCAL_NO_SUCH_VARIABLE"]
    good = ["attncal export default -o OUT --no-calibration", "--fp16", "make test", "tests/test_docs.py",
            "tests/test_docs.py::test_names_in_prose_resolve", "attncal.runtime.Encoder", "ATTNCAL_CPU_PATH",
            "attncal.json", "onnx/model.onnx", "pip install --no-deps x", "docs/eval/*/results.json"]
    assert all(name_problems(s, top) for s in bad), [s for s in bad if not name_problems(s, top)]
    assert not [p for s in good for p in name_problems(s, top)]


# -- figures and claims --------------------------------------------------------------------------------------

# A number with a unit of time (seconds with a space: "1s" is a plural), memory, throughput, a ratio (× not
# followed by a number: "2 × 255" is a product) or a percentage (not a confidence level). A thousands comma is
# followed by a digit: "2e-3, min cosine" is a list.
FIGURE = re.compile(r"(?<![\w.])\d(?:[\d,]*\d)?(?:\.\d+)?(?:\s?(?:ns|µs|us|ms|min|KiB|MiB|GiB|KB|MB|GB|%|req/s|rows/s|"
                    r"tokens/s|texts/s|GFLOP/s)|\ss|\s?×(?!\s*\d))(?![\w/])"
                    r"(?!\s*(?:confidence|bootstrap|interval|CI\b))")
# The prose may wrap between "commit" and its hash.
_COMMIT = re.compile(r"\bcommits?\s+`?[0-9a-f]{7,40}\b")
_DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
CLAIM = re.compile(r"(?<!not )(?<!never )\b(tested|checked|verified)\b", re.IGNORECASE)
_NAMES_CHECK = re.compile(r"`[^`]*(?:tests/|test_\w|benchmarks/|attncal\.\w|attncal (?:check|doctor)\b|make (?:test|gpu-check)\b)"
                          r"[^`]*`")


@dataclasses.dataclass
class Block:
    start: int   # 0-based first line
    end: int     # 0-based line after the block
    text: str    # the prose (code spans kept with their backticks)
    header: bool = False  # a table's header row


def prose_blocks(text: str) -> list[Block]:
    """Each paragraph, list item and table row outside fenced and generated blocks, headings left out. A list
    item's text includes its nested items; a table row is one block."""
    from markdown_it import MarkdownIt

    text = _GENERATED.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    out, stack, in_heading, in_thead = [], [], False, False
    for tok in tokens:
        if tok.type in ("thead_open", "thead_close"):
            in_thead = tok.type == "thead_open"
        elif tok.type in ("tr_open", "list_item_open"):
            stack.append(Block(*(tok.map or (0, 0)), "", header=in_thead))
        elif tok.type in ("tr_close", "list_item_close"):
            block = stack.pop()
            out.append(block)
            if stack:
                stack[-1].text += " " + block.text
        elif tok.type == "heading_open":
            in_heading = True
        elif tok.type == "heading_close":
            in_heading = False
        elif tok.type == "inline" and not in_heading:
            content = "".join(f"`{c.content}`" if c.type == "code_inline" else c.content
                              for c in tok.children or ()) or tok.content
            if stack:
                stack[-1].text += " " + content
            else:
                out.append(Block(tok.map[0], tok.map[1], content))
    return out


def _headings(lines: list[str]) -> list[int]:
    fenced, out = False, []
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(i)
    return out


def figure_problems(text: str, name: str) -> list[str]:
    lines = text.splitlines()
    heads = _headings(lines)
    out = []
    for block in prose_blocks(text):
        prose = re.sub(r"`[^`]*`", "", block.text)
        figures = FIGURE.findall(prose)
        if not figures:
            continue
        above = lines[block.start - 1].strip() if block.start else ""
        table_start = block.start
        while table_start > 0 and lines[table_start - 1].lstrip().startswith("|"):
            table_start -= 1
        if _NOT_MEASURED.match(above) or (table_start and _NOT_MEASURED.match(lines[table_start - 1].strip())):
            continue
        section = max([h for h in heads if h <= block.start], default=0)
        scope = "\n".join(lines[section:block.end])
        if not (_COMMIT.search(scope) and _DATE.search(scope)):
            out.append(f"{name}:{block.start + 1}: {', '.join(figures[:3])} without the commit and date it was "
                       "measured at in its section")
    return out


def claim_problems(text: str, name: str) -> list[str]:
    out = []
    for b in prose_blocks(text):
        claim = CLAIM.search(re.sub(r"`[^`]*`", "", b.text))
        if claim and not b.header and not _NAMES_CHECK.search(b.text):
            out.append(f"{name}:{b.start + 1}: '{claim.group(0)}' without the test that does it")
    return out


def test_figures_carry_commit_and_date():
    problems = [p for page in PAGES if page.name not in HISTORY_PAGES
                for p in figure_problems(page.read_text(encoding="utf-8"), str(page.relative_to(REPO)))]
    assert not problems, "figures in prose (docs/development.md, Writing docs):\n" + "\n".join(problems)


def test_figure_check_needs_the_stamp_in_the_section():
    text = ("# A\n\nIt takes 12.5 ms.\n\n## B\n\nMeasured at commit\n1a2b3c4 on 2026-12-07: 3.1 s.\n\n"
            "Then 40 MiB.\n\n## C\n\n| x | t |\n|---|---:|\n| a | 7 ms |\n\n"
            "<!-- not measured: a limit -->\nAt most 60 s.\n\nA `--seq 512` option, 3 layers, a 95 % confidence interval, "
            "1s and 0s, 2 × 255 × 64, tolerance 2e-3, min cosine 0.9995.\n")
    assert [p.split(":")[1] for p in figure_problems(text, "p")] == ["3", "16"]


def test_claims_name_their_test():
    problems = [p for page in PAGES if page.name not in HISTORY_PAGES
                for p in claim_problems(page.read_text(encoding="utf-8"), str(page.relative_to(REPO)))]
    assert not problems, "claims without their test (docs/development.md, Writing docs):\n" + "\n".join(problems)


def test_claim_check_needs_a_named_test():
    text = ("Parity is tested.\n\nParity is tested (`tests/test_export.py`).\n\nIt is not tested on a GPU.\n\n"
            "- checked by `attncal check`\n- verified in CI\n\n| a | tested |\n|---|---|\n| b | `test_x` checked |\n"
            "| c | tested |\n\nThe `tested` key.\n")
    assert [p.split(":")[1] for p in claim_problems(text, "p")] == ["1", "8", "13"]


# -- claims about the peers ------------------------------------------------------------------------------------

# A claim that attncal's default is ahead of (or level with) every peer (OpenVINO, sentence-transformers, the
# uncalibrated ORT graph) must link the generated statements it rests on (docs/performance.md, `bench-peers`,
# written from the committed runs by docs/generate.py), and they must say it for every shape and measure it names:
# "ahead" at every size measured, or for a "level" claim ahead or level. The claim's sentence names the shapes and
# measures: one that names no shape claims them all, one that names no measure (time, memory) claims both.
PEER_CLAIM = re.compile(r"\b(?:ahead of|faster than|beats?|outperforms?|(?:less|smaller|lower)\b[^.]*?\bthan|"
                        r"level with|on par with)\s+"
                        r"(?:(?:every|each|all|all the|all its|the other)\s+peers?|the\s+peers)\b", re.I)
PEERS_ANCHOR = "#peers-openvino-and-sentence-transformers"
_PEER_SHAPES = {shape: re.compile(rf"\b{re.escape(shape)}\b") for shape, _ in generate.PEER_SHAPES}
_PEER_METRICS = {"time": re.compile(r"\b(?:time|faster|latency|speed)\b", re.I),
                 "memory": re.compile(r"\b(?:memory|peak|smaller)\b", re.I)}


def _sentences(text: str) -> list[str]:
    """`text` cut after each . ; ! or ? that a capital, a parenthesis or a code span follows (prose_blocks joins a
    paragraph's lines without a space)."""
    return re.split(r"(?<=[.;!?])\s*(?=[A-Z(`])", text)


def peer_claim_problems(text: str, name: str, verdicts: list) -> list[str]:
    lines = _GENERATED.sub(lambda m: "\n" * m.group(0).count("\n"), text).splitlines()
    out = []
    for b in prose_blocks(text):
        for claim in PEER_CLAIM.finditer(b.text):
            where = f"{name}:{b.start + 1}: '{claim.group(0)}'"
            if PEERS_ANCHOR not in "\n".join(lines[b.start:b.end]):
                out.append(f"{where} without a link to the generated statements (performance.md{PEERS_ANCHOR})")
                continue
            sentence = next(t for t in _sentences(b.text) if claim.group(0) in t)
            shapes = [s for s, pattern in _PEER_SHAPES.items() if pattern.search(sentence)] or list(_PEER_SHAPES)
            metrics = [m for m, pattern in _PEER_METRICS.items() if pattern.search(sentence)] or list(_PEER_METRICS)
            allowed = {"ahead", "level"} if re.search(r"level|par", claim.group(0), re.I) else {"ahead"}
            out += [f"{where}, but the generated statement: {v.shape} shape, {v.metric}: {v.describe()}"
                    for v in verdicts if v.shape in shapes and v.metric in metrics and v.verdict not in allowed]
    return out


def test_peer_claims_are_what_the_generated_statements_say():
    verdicts = generate.peer_verdicts()
    problems = [p for page in PAGES if page.name not in HISTORY_PAGES
                for p in peer_claim_problems(page.read_text(encoding="utf-8"), str(page.relative_to(REPO)), verdicts)]
    assert not problems, "claims about the peers the generated statements do not make:\n" + "\n".join(problems)


def test_peer_claim_check_sees_an_unsupported_claim():
    V = generate.PeerVerdict
    verdicts = [V("BERT", 8, 128, "time", "level", "openvino", 1.01, (0.98, 1.04)),
                V("BERT", 8, 128, "memory", "behind", "ort-opt", 1.2),
                V("XLM-R", 8, 2048, "time", "ahead", "openvino", 0.5, (0.45, 0.55)),
                V("XLM-R", 8, 2048, "memory", "ahead", "ort-opt", 0.2)]
    link = f"([peers](performance.md{PEERS_ANCHOR}))"
    text = (f"Ahead of every peer.\n\nOn the XLM-R shape it is ahead of every peer {link}.\n\n"
            f"It is faster than all peers {link}.\n\nOn BERT it is level with every peer in time {link}.\n\n"
            f"- on BERT it uses less memory than every peer {link}. Its time is another matter.\n\n"
            f"On the XLM-R shape it uses less memory than every peer {link}. On BERT its time is level.\n\n"
            f"{generate._begin('x')}\nahead of every peer\n{generate._end('x')}\n\nThe peers differ.\n")
    problems = peer_claim_problems(text, "p", verdicts)
    assert [p.split(":")[1] for p in problems] == ["1", "5", "9"], problems
    assert "behind `ort-opt` at 8 × 128 by 20 %" in problems[-1]

"""attncal eval --make-posq: prose extraction, sentence splitting, thirds, the token budget, determinism, errors;
the real-prose example corpus; truncation reporting and the HM/PSI sweep plot of `attncal eval`.

The tokenizer is the tiny char-level one from attncal.synthetic: an ASCII text
of n non-space characters is n + 2 tokens ([CLS] and [SEP]), so budgets can be
checked by hand.
"""

from __future__ import annotations

import argparse
import json
import random
import re

import pytest

from attncal.eval import DataError, load_dataset
from attncal.eval.posq_builder import (
    Document, PosqOptions, _thirds, build_posq, load_tokenizer, make_query, read_documents,
)
from attncal.eval.text import prose_blocks, split_sentences


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    from attncal.synthetic import save_synthetic_model

    return save_synthetic_model("bert", tmp_path_factory.mktemp("tiny") / "bert", seed=1, max_positions=256)


@pytest.fixture(scope="module")
def tok(tiny_bert):
    return load_tokenizer(tiny_bert)[0]


def _cli(argv: list[str]) -> int:
    from attncal.cli import eval as ev

    p = argparse.ArgumentParser()
    ev.add_arguments(p)
    return ev.run(p.parse_args(argv))


def _ntok(text: str) -> int:
    return len(text.replace(" ", "")) + 2  # the char-level tokenizer: one token per non-space char, plus CLS/SEP


WORDS = "ox sun sea map cat dog hat pen cup box key jar bus fig owl egg ant bee elk yak".split()


def _doc(rng: random.Random, n_sent: int) -> str:
    """Paragraphs of distinct, capitalised, full-stop sentences of 10-15 short words (about 40 tokens)."""
    paras, cur = [], []
    for i in range(n_sent):
        n = rng.randint(9, 14)
        cur.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + f" n{rng.randint(0, 10**6)}.")
        if len(cur) == 4:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return "\n\n".join(paras)


# --------------------------------------------------------------------------- text
def test_split_sentences_protects_abbreviations_and_initials():
    text = ('See e.g. the manual, i.e. chapter two. J. Smith wrote it in 1999! Is "x" true? '
            '(Yes, it is.) 3 cases remain. It costs 2.5 euros vs. 3 dollars.')
    got = [text[s:e] for s, e in split_sentences(text)]
    assert got == ["See e.g. the manual, i.e. chapter two.", "J. Smith wrote it in 1999!", 'Is "x" true?',
                   "(Yes, it is.)", "3 cases remain.", "It costs 2.5 euros vs. 3 dollars."]
    assert split_sentences("no final punctuation here") == [(0, 25)]
    assert split_sentences("   ") == []


def test_prose_blocks_drop_code_headings_tables_and_fragments():
    rst = ('The "for" statement\n*******************\n\nThe loop runs once per item of the list:\n\n'
           '   for x in y:\n       print(x)\n\n   >>> print(1)\n   1\n\n'
           '   for_stmt ::= "for" target_list "in" expression_list\n\n'
           'The simple form is equivalent to\n\n'
           '+-----+-----+\n| a   | b   |\n+-----+-----+\n\n'
           'object.__del__(self)\n\n   Called when the instance is about to be destroyed by the runtime.\n')
    assert prose_blocks(rst) == ["The loop runs once per item of the list:",
                                 "Called when the instance is about to be destroyed by the runtime."]
    md = ("# Title\n\nSome [linked words](http://x.y) and <b>bold</b> text here.\n\n```python\nx = 1.\n```\n\n"
          "## Sub\nA second paragraph that\nwraps over two lines.\n")
    assert prose_blocks(md, markdown=True) == ["Some linked words and bold text here.",
                                               "A second paragraph that wraps over two lines."]


# --------------------------------------------------------------------------- thirds and queries
def test_thirds_take_sentences_inside_each_third():
    sents = ["a" * 20, "b" * 20, "c" * 20, "d" * 20, "e" * 20, "f" * 20]  # 6 x 20 chars + 5 spaces = 125
    text = " ".join(sents)
    spans = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
    th = _thirds(text, spans)
    assert th == {"beginning": [0, 1], "middle": [2, 3], "end": [4, 5]}
    # one long sentence straddling the middle: no sentence lies wholly inside; its centre decides
    text2 = "x" * 10 + " " + "y" * 80 + " " + "z" * 10
    spans2 = [(0, 10), (11, 91), (92, 102)]
    assert _thirds(text2, spans2) == {"beginning": [0], "middle": [1], "end": [2]}


def test_make_query_drops_a_share_of_words_in_order():
    sentence = "one two three four five six seven eight nine ten."
    q = make_query(sentence, 0.5, random.Random(1))
    kept = q.split()
    assert len(kept) == 5 and not q.endswith(".")
    it = iter(sentence.rstrip(".").split())
    assert all(w in it for w in kept)  # a subsequence: order kept
    assert make_query(sentence, 0.5, random.Random(1)) == q
    assert make_query(sentence, 0.0, random.Random(1)) == sentence.rstrip(".")


# --------------------------------------------------------------------------- building
def _docs(n_docs: int = 4, n_sent: int = 24, seed: int = 0) -> list[Document]:
    rng = random.Random(seed)
    return [Document(f"d{i}.txt", _doc(rng, n_sent)) for i in range(n_docs)]


def test_build_respects_the_token_budget_and_never_truncates(tok):
    docs = _docs()
    long_sentence = "Overlong " + " ".join(["wordy"] * 40) + " sentence."  # ~250 chars: over a 200 budget
    docs.append(Document("long.txt", _doc(random.Random(9), 10) + "\n\n" + long_sentence + "\n\n"
                         + _doc(random.Random(10), 10)))
    sources = {d.id: d.text.replace("\n\n", " ") for d in docs}
    posq = build_posq(docs, tok, 256, PosqOptions(passage_tokens=200, seed=3))
    assert posq.passages and posq.manifest["passage_budget_tokens"] == 200
    for p in posq.passages:
        assert p["tokens"] == _ntok(p["text"]) <= 200  # exact count with the tokenizer, within the budget
        assert p["tokens"] >= 100  # min_passage_tokens defaults to half the budget
        assert p["text"] in sources[p["doc"]]  # consecutive whole sentences of one document, unchanged
        assert "wordy wordy" not in p["text"]
    assert posq.manifest["counts"]["sentences_over_budget_dropped"] == 1
    assert any("left out rather than truncated" in w for w in posq.warnings)
    assert posq.manifest["passage_tokens"]["max"] <= 200
    assert sum(posq.manifest["passage_tokens"]["histogram"].values()) == len(posq.passages)
    # every passage has one query per third, drawn from a sentence in that third
    by_pid = {p["id"]: p for p in posq.passages}
    per_passage: dict[str, list[str]] = {}
    for q in posq.queries:
        text = by_pid[q["passage_id"]]["text"]
        s, e = q["span"]
        third = {"beginning": (0, 1 / 3), "middle": (1 / 3, 2 / 3), "end": (2 / 3, 1)}[q["span_class"]]
        assert third[0] <= (s + e) / 2 / len(text) < third[1]  # (wholly inside when possible: see test_thirds)
        assert (s, e) in split_sentences(text) and q["position"] == pytest.approx((s + e) / 2 / len(text), abs=1e-4)
        assert q["text"] != text[s:e] and set(q["text"].split()) <= set(text[s:e].rstrip(".").split())
        per_passage.setdefault(q["passage_id"], []).append(q["span_class"])
    assert all(v == ["beginning", "middle", "end"] for v in per_passage.values())
    assert len(per_passage) == len(posq.passages)


def test_build_is_deterministic_and_seeded(tok):
    a = build_posq(_docs(), tok, 256, PosqOptions(seed=5))
    b = build_posq(_docs(), tok, 256, PosqOptions(seed=5))
    c = build_posq(_docs(), tok, 256, PosqOptions(seed=6))
    assert (a.passages, a.queries, a.manifest) == (b.passages, b.queries, b.manifest)
    assert a.passages == c.passages and [q["text"] for q in a.queries] != [q["text"] for q in c.queries]


def test_duplicate_documents_and_repeated_sentences(tok):
    docs = _docs(2)
    dup = Document("copy.txt", docs[0].text.split("\n\n", 1)[1])  # most of d0 again
    posq = build_posq(docs + [dup], tok, 256, PosqOptions())
    assert posq.manifest["counts"]["duplicate_documents_dropped"] == 1
    assert {p["doc"] for p in posq.passages} == {"d0.txt", "d1.txt"}


def test_budget_over_the_max_length_warns_that_eval_will_truncate(tok):
    posq = build_posq(_docs(), tok, 256, PosqOptions(passage_tokens=400))
    over = sum(1 for p in posq.passages if p["tokens"] > 256)
    assert over > 0 and posq.manifest["counts"]["passages_over_model_max_length"] == over
    assert any("attncal eval will truncate" in w for w in posq.warnings)


# --------------------------------------------------------------------------- CLI and files
def test_make_posq_cli_writes_a_set_that_eval_reads(tmp_path, tiny_bert, capsys):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    rng = random.Random(0)
    (docs / "a.txt").write_text(_doc(rng, 24))
    (docs / "sub" / "b.md").write_text("# Heading\n\n" + _doc(rng, 24) + "\n\n```\ncode = 1.\n```\n")
    (docs / "ignored.py").write_text("x = 1\n")
    out = tmp_path / "posq"
    assert _cli([str(tiny_bert), "--make-posq", str(docs), "-o", str(out), "--seed", "1"]) == 0
    assert "passages" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["passages.jsonl", "posq.json", "queries.jsonl"]
    man = json.loads((out / "posq.json").read_text())
    assert man["source"]["documents"] == 2 and man["options"]["seed"] == 1
    assert man["tokenizer"]["max_length"] == 256 and man["passage_budget_tokens"] == 256
    ds = load_dataset(out)
    assert len(ds.corpus) == man["counts"]["passages"] and len(ds.queries) == man["counts"]["queries"]
    assert {p["doc"] for p in map(json.loads, (out / "passages.jsonl").read_text().splitlines())} == {"a.txt",
                                                                                                     "sub/b.md"}
    with pytest.raises(FileExistsError, match="--overwrite"):
        _cli([str(tiny_bert), "--make-posq", str(docs), "-o", str(out)])
    # JSONL input with a custom field gives the same passages as the directory
    jl = tmp_path / "docs.jsonl"
    jl.write_text("\n".join(json.dumps({"id": n, "body": (docs / n).read_text(), "markdown": n.endswith(".md")})
                            for n in ("a.txt", "sub/b.md")))
    out2 = tmp_path / "posq2"
    assert _cli([str(tiny_bert), "--make-posq", str(jl), "-o", str(out2), "--text-field", "body",
                 "--seed", "1"]) == 0
    assert (out2 / "passages.jsonl").read_text() == (out / "passages.jsonl").read_text()
    assert not list(tmp_path.glob(".posq*"))  # no temp dirs left behind


@pytest.mark.parametrize("setup, argv_extra, message", [
    (lambda d: None, [], "documents not found"),
    (lambda d: (d.mkdir(), (d / "x.py").write_text("x")), [], "no .txt, .md or .rst files"),
    (lambda d: d.write_text('{"text": "a"}\n{bad\n'), [], r":2: invalid JSON"),
    (lambda d: d.write_text('{"body": "a"}\n'), [], "missing string field 'text'"),
    (lambda d: d.write_text('{"text": "Too short."}\n'), [], "no passage of"),
    (lambda d: d.write_text('{"text": "a"}\n'), ["--drop-words", "1.5"], "--drop-words must be in"),
])
def test_make_posq_bad_input_is_one_line_exit_2(tmp_path, tiny_bert, capsys, setup, argv_extra, message):
    from attncal.cli import main

    src = tmp_path / "in"
    setup(src)
    rc = main(["eval", str(tiny_bert), "--make-posq", str(src), "-o", str(tmp_path / "out")] + argv_extra)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_read_documents_rejects_non_utf8(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 latin-1 text.")
    with pytest.raises(DataError, match=r"a\.txt: not UTF-8"):
        read_documents(tmp_path)
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl: not UTF-8"):
        read_documents(tmp_path / "d.jsonl")
    (tmp_path / "one.md").write_text("# T\n\nOne document.\n")
    docs, src = read_documents(tmp_path / "one.md")  # a single text file is one document
    assert [(d.id, d.markdown) for d in docs] == [("one.md", True)] and src["kind"] == "file"


def test_python_reference_example_set(tmp_path, tiny_bert):
    from attncal.eval.realtext import python_reference_documents

    docs, source = python_reference_documents()
    assert len(docs) > 50 and "PSF" in source["license"] and source["python"]
    out = tmp_path / "ex"
    assert _cli([str(tiny_bert), "--make-posq-example", str(out), "--max-passages", "12"]) == 0
    man = json.loads((out / "posq.json").read_text())
    assert man["source"]["kind"] == "python-reference" and man["counts"]["passages"] == 12
    ds = load_dataset(out)
    assert len(ds.corpus) == 12 and set(ds.group.values()) == {"begin", "middle", "end"}


# --------------------------------------------------------------------------- eval: truncation and the sweep plot
def test_eval_reports_truncation_apart_from_position(tmp_path, tiny_bert):
    from attncal.eval.posq_builder import write_posq

    posq = build_posq(_docs(3, 30), load_tokenizer(tiny_bert)[0], 256, PosqOptions(passage_tokens=380))
    data = write_posq(tmp_path / "data", posq)
    expected = sum(1 for p in posq.passages if _ntok(p["text"]) > 256)
    assert 0 < expected < len(posq.passages)
    out = tmp_path / "out"
    assert _cli([str(tiny_bert), "--data", str(data), "--strength", "0,1", "--baselines", "sea",
                 "--out", str(out), "--no-cache"]) == 0
    res = json.loads((out / "results.json").read_text())
    t = res["dataset"]["truncation"]
    assert t["max_length"] == 256 and t["passages_truncated"] == expected
    truncated = {p["id"] for p in posq.passages if _ntok(p["text"]) > 256}
    want = {g: sum(1 for q in posq.queries if q["passage_id"] in truncated and q["span_class"].startswith(g[:3]))
            for g in ("begin", "middle", "end")}
    assert t["queries_on_truncated_passages"] == want
    rows = {r["label"]: r for r in res["rows"]}
    kept = sum(1 for q in posq.queries if q["passage_id"] not in truncated)
    assert sum(rows["uncalibrated"]["untruncated"]["counts"].values()) == kept
    md = (out / "results.md").read_text()
    assert "## Length and truncation" in md and f"**{expected} of {len(posq.passages)} passages are truncated**" in md
    assert any("truncated" in n for n in res["notes"])
    assert res["plots"]["hm_psi_vs_strength"] == "hm_psi_vs_strength.png"
    assert (out / "hm_psi_vs_strength.png").read_bytes()[:4] == b"\x89PNG"


def test_hm_psi_plot_draws_sea_and_uncalibrated_references(monkeypatch, tmp_path):
    import matplotlib.pyplot as plt

    from attncal.eval import report

    def row(kind, label, strength, hm, psi):
        return {"kind": kind, "label": label, "config": None if strength is None else {"strength": strength},
                "scores": {"hm": hm, "psi": psi}}

    rows = [row("uncalibrated", "uncalibrated", None, 0.69, 0.16), row("calibrated", "λ=0", 0.0, 0.69, 0.16),
            row("calibrated", "λ=1", 1.0, 0.70, 0.02), row("calibrated", "λ=0.5", 0.5, 0.71, 0.07),
            row("baseline", "SEA (128-token chunks)", None, 0.707, 0.039)]
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    report.plot_hm_psi_vs_strength(rows, tmp_path / "p.png")
    (hm_ax, psi_ax) = figs[0].axes
    for ax, key in ((hm_ax, "hm"), (psi_ax, "psi")):
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        assert list(lines["calibrated"].get_xdata()) == [0.0, 0.5, 1.0]  # sorted by λ
        assert list(lines["calibrated"].get_ydata()) == [rows[1]["scores"][key], rows[3]["scores"][key],
                                                         rows[2]["scores"][key]]
        assert set(lines["SEA (128-token chunks)"].get_ydata()) == {rows[4]["scores"][key]}
        assert set(lines["uncalibrated"].get_ydata()) == {rows[0]["scores"][key]}
    plt.close(figs[0])

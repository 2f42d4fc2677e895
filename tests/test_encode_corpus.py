"""`attncal encode` / `attncal.corpus.encode_corpus`: formats, bad rows, manifest, resume after a kill,
local workers and Ray runs on one local 2-CPU instance (the bad-row tests run on every engine), all
against a bare `Encoder.encode`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from attncal.cli import main
from attncal.corpus import CorpusInputError, encode_corpus, load_manifest, read_embeddings, shards
from attncal.synthetic import synthetic_text
from support.hooks import Park, hooked_cli, parked_pid, process_gone, ship_with_ray, wait_until

TOL = 1e-5
ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(batch_size=8, window=32, shard_size=70, show_progress=False)


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """A calibrated tiny BERT export (max length 64, basket 4 so calibration changes long rows)."""
    from attncal.calibration.config import CalibrationConfig
    from attncal.exporting.exporter import ExportOptions, export
    from attncal.synthetic import save_synthetic_model

    root = tmp_path_factory.mktemp("encode-corpus")
    model = save_synthetic_model("bert", root / "m", seed=5, max_positions=128, max_seq_length=64)
    out = root / "export"
    export(str(model), out, ExportOptions(config=CalibrationConfig(basket_size=4, strength=1.0),
                                          exporter="torchscript", check=False), quiet=True)
    return out


def make_rows(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"id": f"d{seed}-{i}", "text": synthetic_text(int(rng.integers(1, 300)), seed=seed * 100000 + i),
             "extra": i} for i in range(n)]


@pytest.fixture(scope="module")
def rows():
    return make_rows(230)


@pytest.fixture(scope="module")
def reference(tiny_export, rows):
    from attncal.runtime.encoder import Encoder

    return Encoder(tiny_export, providers=["CPUExecutionProvider"]).encode([r["text"] for r in rows], batch_size=8)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    import csv

    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["id", "text", "extra"])
        w.writeheader()
        w.writerows(rows)
    return path


def write_parquet(path: Path, rows: list[dict], row_group_size: int = 50) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


WRITERS = {"jsonl": write_jsonl, "csv": write_csv, "parquet": write_parquet}


def assert_matches(out: Path, rows: list[dict], reference: np.ndarray) -> dict:
    ids, emb = read_embeddings(out)
    assert ids == [r["id"] for r in rows]
    assert emb.dtype == np.float32 and emb.shape == reference.shape
    assert np.abs(emb - reference).max() <= TOL
    return load_manifest(out)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_each_format_matches_encoder_and_manifest(fmt, tiny_export, rows, reference, tmp_path):
    src = WRITERS[fmt](tmp_path / f"corpus.{fmt}", rows)
    out = tmp_path / "out"
    res = encode_corpus(tiny_export, src, out, **SMALL)
    m = assert_matches(out, rows, reference)
    assert res.rows == res.rows_this_run == len(rows) and res.skipped == 0 and res.tokens > len(rows)
    # shards: fixed size, in order, each a committed file; schema id string + fixed-size float32 list
    assert [s["rows"] for s in m["shards"]] == [70, 70, 70, 20]
    assert [s["first_row"] for s in m["shards"]] == [0, 70, 140, 210]
    assert sorted(p.name for p in out.iterdir()) == sorted([s["file"] for s in m["shards"]] +
                                                           ["manifest.json", "skipped.jsonl"])
    schema = pq.read_schema(out / m["shards"][0]["file"])
    assert schema.field("id").type == pa.string()
    assert schema.field("embedding").type == pa.list_(pa.float32(), reference.shape[1])
    import hashlib

    import attncal

    assert m["complete"] and m["rows"] == len(rows) and m["skip_list"] == [] and m["skipped"] == 0
    assert m["attncal_version"] == attncal.__version__
    assert m["config_hash"] == "sha256:" + hashlib.sha256((tiny_export / "attncal.json").read_bytes()).hexdigest()
    assert m["model"]["calibrated"] is True and m["model"]["dimension"] == reference.shape[1]
    # the fingerprint is made of listings (name, size, modification time): no input byte is hashed for it
    st = src.stat()
    assert m["input"]["files"][0]["size"] == st.st_size and m["input"]["files"][0]["mtime_ns"] == st.st_mtime_ns
    assert m["input"]["fingerprint"].startswith("sha256:") and m["options"]["shard_size"] == 70
    assert m["layout"] == "sequential" and m["input"]["files"][0]["rows"] == len(rows)


def test_multiple_files_workers_and_windows(tiny_export, rows, reference, tmp_path):
    """Two input files (JSONL then JSONL), two worker processes: same ids, order and embeddings."""
    d = tmp_path / "in"
    d.mkdir()
    write_jsonl(d / "a.jsonl", rows[:101])
    write_jsonl(d / "b.jsonl", rows[101:])
    out = tmp_path / "out"
    encode_corpus(tiny_export, d, out, workers=2, **SMALL)
    assert_matches(out, rows, reference)


def test_json_fast_and_slow_paths_agree(tiny_export, tmp_path):
    """Integer ids (pyarrow path) and mixed id types (line-by-line path) give the same string ids."""
    from attncal.corpus.inputs import InputFile, read_chunks

    p = tmp_path / "ids.jsonl"
    p.write_text('{"id": 7, "text": "a"}\n\n{"id": 8, "text": "b"}\n')
    q = tmp_path / "mixed.jsonl"
    q.write_text('{"id": 7, "text": "a"}\n\n{"id": "8", "text": "b"}\n')
    fast = list(read_chunks(InputFile(p, "jsonl"), "text", "id"))
    slow = list(read_chunks(InputFile(q, "jsonl"), "text", "id"))
    assert not fast[0].fallback and slow[0].fallback
    assert fast[0].ids == slow[0].ids == ["7", "8"] and fast[0].texts == slow[0].texts == ["a", "b"]


def bad_jsonl(path: Path, rows: list[dict]) -> tuple[Path, list[int]]:
    lines = [json.dumps(r) for r in rows]
    bad = {3: '{"id": "x3", "text": ', 7: '{"id": "x7"}', 11: '{"id": "x11", "text": 42}',
           15: '["not", "an", "object"]', 19: '{"text": "no id"}', 23: '{"id": "x23", "text": null}'}
    out = []
    for i, line in enumerate(lines):
        if i + 1 in bad:
            out.append(bad[i + 1].encode())
        else:
            out.append(line.encode())
    out.insert(26, b'{"id": "x27", "text": "caf\xe9"}')  # line 27: latin-1, not UTF-8
    path.write_bytes(b"\n".join(out) + b"\n")
    return path, sorted(bad) + [27]


def test_cli_errors_are_one_line_exit_2(tiny_export, rows, tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", rows[:5])
    model_dir = tiny_export.parent / "m"
    out = tmp_path / "out"
    cases = [
        ([str(tiny_export), "--input", str(tmp_path / "missing.jsonl")], "not found"),
        ([str(model_dir), "--input", str(src)], "is a model directory, not an attncal export"),
        (["default", "--input", str(src)], "attncal export default -o OUT"),
        ([str(tiny_export), "--input", str(tmp_path / "x.txt")], "not found"),
        ([str(tiny_export), "--input", str(src), "--batch-size", "0"], "batch_size must be"),
        ([str(tiny_export), "--input", str(src), "--max-length", "1000"], "max_length must be"),
        ([str(tiny_export), "--input", str(src), "--engine", "triton"], "needs the served model"),
        ([str(tiny_export), "--input", str(src), "--model", "x"], "--model names a served model"),
        ([str(tiny_export), "--input", str(src), "--text-field", "body"], "missing field 'body'"),
    ]
    for argv, msg in cases:
        assert main(["encode", *argv, "--output", str(out), "-q"]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, (argv, err)
        assert not out.exists()
    (tmp_path / "x.txt").write_text("a\n")
    assert main(["encode", str(tiny_export), "--input", str(tmp_path / "x.txt"), "--output", str(out), "-q"]) == 2
    assert "unknown format '.txt'" in capsys.readouterr().err
    # a finished run: a second run without --resume is refused, --resume is a no-op, other options are refused
    assert main(["encode", str(tiny_export), "--input", str(src), "--output", str(out), "-q"]) == 0
    assert "encoded 5 rows" in capsys.readouterr().out
    assert main(["encode", str(tiny_export), "--input", str(src), "--output", str(out), "-q"]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert main(["encode", str(tiny_export), "--input", str(src), "--output", str(out), "-q", "--resume"]) == 0
    assert main(["encode", str(tiny_export), "--input", str(src), "--output", str(out), "-q", "--resume",
                 "--shard-size", "2"]) == 2
    assert "shard_size was 100000, now 2" in capsys.readouterr().err
    write_jsonl(src, rows[:6])
    assert main(["encode", str(tiny_export), "--input", str(src), "--output", str(out), "-q", "--resume"]) == 2
    assert "input files changed" in capsys.readouterr().err


def _encode_args(export: Path, src: Path, out: Path, *extra: str) -> list[str]:
    return ["encode", str(export), "--input", str(src), "--output", str(out), "--batch-size", "8", "--window", "32",
            "--shard-size", "100", "-q", *extra]


def test_resume_after_sigkill_gives_identical_output(tiny_export, tmp_path):
    """A run SIGKILLed right after its third shard is committed (support.hooks.KillAt: in the encoding
    process, at exactly that shard) leaves a manifest listing those three shards and nothing else; --resume
    completes it, and the result is byte-for-byte the shards of an uninterrupted run (ids, order,
    embeddings) with no row lost or doubled."""
    rows = make_rows(600, seed=1)
    src = write_jsonl(tmp_path / "big.jsonl", rows)
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert main(_encode_args(tiny_export, src, full)) == 0
    proc = subprocess.run(hooked_cli(["kill-at-shard", "committed", "part-00002.parquet"],
                                     _encode_args(tiny_export, src, killed)), env=dict(os.environ, HF_HUB_OFFLINE="1"),
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL
    m = load_manifest(killed)
    assert not m["complete"] and [s["file"] for s in m["shards"]] == [f"part-{k:05d}.parquet" for k in range(3)]
    assert sorted(p.name for p in killed.iterdir()) == sorted([s["file"] for s in m["shards"]] +
                                                              ["manifest.json", "skipped.jsonl"])
    assert main(_encode_args(tiny_export, src, killed, "--resume")) == 0
    a, b = load_manifest(full), load_manifest(killed)
    assert b["complete"] and b["runs"] == 2 and [s["rows"] for s in a["shards"]] == [s["rows"] for s in b["shards"]]
    assert len(a["shards"]) == 6 and not [p for p in killed.iterdir() if p.name.startswith(".")]  # no temporary left
    for s in a["shards"]:
        ta, tb = pq.read_table(full / s["file"]), pq.read_table(killed / s["file"])
        assert ta.equals(tb), s["file"]
    ids, _ = read_embeddings(killed)
    assert ids == [r["id"] for r in rows]


@pytest.fixture(scope="module")
def ray_session():
    """One local 2-CPU Ray instance for every Ray run in this module: starting Ray costs seconds, and
    the engine joins a running instance instead of starting its own.  The Ray tests come last in the
    file so the instance does not idle beside the other tests."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def run_encode(request, engine: str, export: Path, src, out: Path, **kw):
    """`encode_corpus` with SMALL options on `engine`; a Ray run joins `ray_session`, and a Ray
    scheduling deadlock must not hang CI."""
    if engine != "ray":
        return encode_corpus(export, src, out, engine=engine, **SMALL, **kw)
    request.getfixturevalue("ray_session")
    import faulthandler

    faulthandler.dump_traceback_later(300, exit=True, file=sys.__stderr__)  # capsys's stderr has no fileno
    try:
        return encode_corpus(export, src, out, engine="ray", ray_num_cpus=2, **SMALL, **kw)
    finally:
        faulthandler.cancel_dump_traceback_later()


def assert_layout(m: dict) -> None:
    """What the manifest of either layout guarantees: shards of at most shard_size rows, listed in
    input order, each with the number of rows before it.  Sequential: shard k holds rows
    [k * size, (k + 1) * size).  Pieces (ray): the shards of piece P are part-P-000, part-P-001, ...,
    all full but the last, the pieces in order."""
    size = m["options"]["shard_size"]
    firsts = [sum(s["rows"] for s in m["shards"][:k]) for k in range(len(m["shards"]))]
    assert [s["first_row"] for s in m["shards"]] == firsts and sum(s["rows"] for s in m["shards"]) == m["rows"]
    assert all(0 < s["rows"] <= size for s in m["shards"])
    if m["layout"] == "sequential":
        assert all(s["rows"] == size for s in m["shards"][:-1])
        return
    keys = [tuple(int(x) for x in s["file"][len("part-"):-len(".parquet")].split("-")) for s in m["shards"]]
    assert keys == sorted(keys) and [k[0] for k in keys] == [s["piece"] for s in m["shards"]]
    for k, s in enumerate(m["shards"][:-1]):
        assert keys[k + 1] == (keys[k][0], keys[k][1] + 1) or keys[k + 1][1] == 0
        assert s["rows"] == size or keys[k + 1][1] == 0
    assert [d["piece"] for d in m["pieces"]] == list(range(m["plan"]["pieces"]))


def assert_same_output(a: Path, b: Path) -> None:
    """Two engines' outputs of one input: the same skip list (file, line, id, reason) in the manifest
    and skipped.jsonl, the same rows (ids, order) with embeddings within TOL, each output laid out as
    its layout promises, and the very same shards where both have the same layout."""
    ma, mb = load_manifest(a), load_manifest(b)
    assert ma["skip_list"] == mb["skip_list"] and ma["skipped"] == mb["skipped"] and ma["rows"] == mb["rows"]
    assert (a / "skipped.jsonl").read_bytes() == (b / "skipped.jsonl").read_bytes()
    (ida, ea), (idb, eb) = read_embeddings(a), read_embeddings(b)
    assert ida == idb and np.abs(ea - eb).max() <= TOL
    assert_layout(ma)
    assert_layout(mb)
    if ma["layout"] != mb["layout"]:
        return
    assert [(s["file"], s["rows"], s["first_row"]) for s in ma["shards"]] == \
        [(s["file"], s["rows"], s["first_row"]) for s in mb["shards"]]
    for s in ma["shards"]:
        ta, tb = pq.read_table(a / s["file"]), pq.read_table(b / s["file"])
        assert ta.schema == tb.schema and ta.column("id").equals(tb.column("id")), s["file"]
        ea, eb = (np.asarray(t.column("embedding").to_pylist(), dtype=np.float32) for t in (ta, tb))
        assert np.abs(ea - eb).max() <= TOL, s["file"]


ENGINES = ["local", "ray"]  # triton reads with the local readers (`_windows`); its own test needs a server


def test_ray_pieces_parse_like_the_local_reader(tmp_path, monkeypatch):
    """The Ray engine's pieces (byte ranges planned from the size alone, row groups, whole CSV files),
    parsed one by one as its actors do, give exactly the local reader's valid rows and bad rows, however
    finely cut; a JSON-lines piece's line numbers, shifted by the lines of the pieces before it (or
    counted by `lines_before`), are the file's."""
    from attncal.corpus import inputs
    from attncal.corpus.inputs import Piece, lines_before, plan_pieces, read_chunks, read_piece, rebase, resolve_inputs

    src, _ = bad_jsonl(tmp_path / "bad.jsonl", make_rows(60))
    with open(src, "ab") as f:
        f.write(b'{"id": 5, "text": "last line, no newline"}')
    # faults that used to crash every engine: a non-UTF-8 byte (pyarrow's JSON reader lets it through)
    # and a lone surrogate escape (json.loads accepts it; the tokenizer and Parquet do not)
    uni = tmp_path / "unicode.jsonl"
    uni.write_bytes(b'{"id": "a", "text": "ok"}\n{"id": "b", "text": "caf\xe9"}\n{"id": "c", "text": "x\\ud800"}\n')
    c = tmp_path / "bad.csv"
    c.write_bytes(b'id,text\nc1,hello\nc2\nc3,"two\nlines"\nc4,caf\xe9\nc5,fine\n')
    p = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"id": [f"p{i}" if i % 7 else None for i in range(200)], "text": ["t"] * 200}), p,
                   row_group_size=30)
    files = resolve_inputs([src, uni, c, p])

    def rows_of(chunks):
        chunks = list(chunks)
        return [x for ch in chunks for x in ch.ids], [x for ch in chunks for x in ch.texts], \
            [b for ch in chunks for b in ch.bad]

    def pieces_rows(pieces):
        ids, texts, bad, before = [], [], [], 0
        for x in pieces:
            if x.format == "jsonl":
                assert lines_before(x) == before, (x.offset, before)
            got = list(read_piece(x, "text", "id"))
            i, t, b = rows_of(got)
            ids, texts, bad = ids + i, texts + t, bad + (rebase(b, before) if x.format == "jsonl" else b)
            before += sum(ch.lines for ch in got)
        return ids, texts, bad

    for piece_bytes, chunk_bytes in ((1 << 20, inputs.JSON_CHUNK_BYTES), (700, 300), (97, 1 << 20), (7, 50)):
        monkeypatch.setattr(inputs, "JSON_CHUNK_BYTES", chunk_bytes)
        for f in files:
            pieces = [Piece.from_json(x.to_json()) for x in plan_pieces(f, piece_bytes)]  # as they travel to actors
            assert rows_of(read_chunks(f, "text", "id")) == pieces_rows(pieces), (piece_bytes, f)
            assert piece_bytes > 50 or f.format == "csv" or len(pieces) >= 2
            if f.format != "parquet":
                assert sum(x.nbytes for x in pieces) == f.size
    ids, _, bad = rows_of(read_chunks(files[1], "text", "id"))
    assert ids == ["a"] and [(b.line, b.id, b.reason) for b in bad] == [
        (2, None, "not UTF-8 (byte 24)"), (3, "c", "field 'text' is not valid UTF-8 (lone surrogate)")]


@pytest.mark.parametrize("engine", ENGINES)
def test_bad_rows_fail_then_skip(engine, request, tiny_export, rows, reference, tmp_path, capsys, monkeypatch):
    """One error policy on every engine: `fail` names the same first bad row and leaves no output
    (local: refused before anything is written; ray: stopped when an actor meets it, what was written
    removed); `skip` leaves out and names the same rows, and the good rows are the same.  On Ray the
    skip run is cut into pieces of 600 bytes, so most bad rows are in a piece that numbers its lines
    from 1 and the driver's line shift is what names them."""
    from attncal.corpus import api

    if engine == "ray":
        request.getfixturevalue("ray_session")
        capsys.readouterr()  # what starting Ray printed
    src, bad_lines = bad_jsonl(tmp_path / "bad.jsonl", rows[:40])
    out = tmp_path / "out"
    if engine == "local":  # (Ray's is the command below: each Ray run starts its actors, seconds here)
        with pytest.raises(CorpusInputError, match=r"^7 bad row\(s\), first .*bad\.jsonl:3: invalid JSON"):
            encode_corpus(tiny_export, src, out, engine=engine, **SMALL)
        assert not out.exists()  # refused before anything was written
    code = main(["encode", str(tiny_export), "--input", str(src), "--output", str(out), "-q", "--engine", engine])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not out.exists() and len(err.splitlines()) == 1, (err, out.exists() and list(out.iterdir()))
    assert f"7 bad row(s), first {src}:3: invalid JSON" in err
    if engine == "ray":
        monkeypatch.setattr(api, "PIECE_BYTES", 600)
        with pytest.raises(CorpusInputError, match=r"^(at least )?\d+ bad row\(s\), first .*bad\.jsonl:(\d+): ") as exc:
            run_encode(request, engine, tiny_export, src, out)
        assert int(exc.value.args[0].split("bad.jsonl:")[1].split(":")[0]) in bad_lines and not out.exists()

    res = run_encode(request, engine, tiny_export, src, out, on_error="skip")
    m = load_manifest(out)
    assert m["engine"]["name"] == engine
    assert [b["line"] for b in m["skip_list"]] == bad_lines and res.skipped == m["skipped"] == 7
    reasons = {b["line"]: b["reason"] for b in m["skip_list"]}
    assert "invalid JSON" in reasons[3] and reasons[7] == "missing field 'text'"
    assert reasons[11] == "field 'text' is int, not a string" and "not a JSON object" in reasons[15]
    assert reasons[19] == "missing field 'id'" and reasons[23] == "missing field 'text'"
    assert reasons[27].startswith("not UTF-8")
    side = [json.loads(x) for x in (out / "skipped.jsonl").read_text().splitlines()]
    assert side == m["skip_list"] and side[1]["id"] == "x7"
    keep = [r for i, r in enumerate(rows[:40]) if i + 1 not in bad_lines[:-1]]  # line 27 was inserted
    ids, emb = read_embeddings(out)
    assert ids == [r["id"] for r in keep] and len(ids) == 34
    ref = {r["id"]: reference[i] for i, r in enumerate(rows)}
    assert np.abs(emb - np.stack([ref[i] for i in ids])).max() <= TOL
    if engine != "local":
        assert len(m["pieces"]) >= 8
        run_encode(request, "local", tiny_export, src, tmp_path / "local", on_error="skip")
        assert_same_output(tmp_path / "local", out)


@pytest.mark.parametrize("engine", ENGINES)
def test_bad_rows_csv_and_parquet(engine, request, tiny_export, tmp_path):
    c = tmp_path / "bad.csv"
    c.write_bytes(b'id,text\nc1,hello\nc2\nc3,"two\nlines"\nc4,caf\xe9\nc5,fine\n')
    if engine == "local":  # Ray's `fail` is test_bad_rows_fail_then_skip's
        with pytest.raises(CorpusInputError, match=r"2 bad row\(s\), first .*bad\.csv:3: missing field 'text'"):
            encode_corpus(tiny_export, c, tmp_path / "o1", engine=engine, **SMALL)
    p = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"id": ["p1", None, "p3"], "text": ["a", "b", None]}), p)
    # both files in one run (the ray engine reads mixed formats too): one Ray pipeline, not two
    run_encode(request, engine, tiny_export, [c, p], tmp_path / "o1", on_error="skip")
    m = load_manifest(tmp_path / "o1")
    assert [(Path(b["file"]).name, b["line"], b["reason"]) for b in m["skip_list"]] == [
        ("bad.csv", 3, "missing field 'text' (1 of 2 columns)"), ("bad.csv", 6, "not UTF-8"),
        ("bad.parquet", 2, "missing field 'id'"), ("bad.parquet", 3, "missing field 'text'")]
    assert read_embeddings(tmp_path / "o1")[0] == ["c1", "c3", "c5", "p1"]
    if engine != "local":
        run_encode(request, "local", tiny_export, [c, p], tmp_path / "local", on_error="skip")
        assert_same_output(tmp_path / "local", tmp_path / "o1")
    pq.write_table(pa.table({"id": [1], "body": [b"x"]}), tmp_path / "wrong.parquet")
    with pytest.raises(CorpusInputError, match="no column 'text'"):  # on Ray: raised in an actor, the same error
        encode_corpus(tiny_export, tmp_path / "wrong.parquet", tmp_path / "o3", engine=engine, **SMALL)
    assert not (tmp_path / "o3").exists()


def test_ray_engine_on_local_2cpu_instance_and_resume(request, tiny_export, rows, reference, tmp_path, monkeypatch):
    """Parquet and JSON lines in one Ray run, cut into pieces of 4 KiB: the local engine's rows in the
    cluster layout.  Then a run interrupted after three pieces (Ctrl-C in the driver) commits them,
    and --resume encodes only the other pieces: the manifest and every shard equal the uninterrupted
    run's."""
    from attncal.corpus import api
    from attncal.corpus.progress import Progress

    monkeypatch.setattr(api, "PIECE_BYTES", 4096)
    d = tmp_path / "in"
    d.mkdir()
    write_parquet(d / "a.parquet", rows[:120])
    write_jsonl(d / "b.jsonl", rows[120:])  # two formats in one run
    out = tmp_path / "ray"
    res = run_encode(request, "ray", tiny_export, d, out, workers=2)
    m = assert_matches(out, rows, reference)
    assert m["engine"]["name"] == "ray" and res.rows == len(rows) and m["plan"]["pieces"] >= 6
    local = tmp_path / "local"
    encode_corpus(tiny_export, d, local, **SMALL)
    assert_same_output(local, out)

    class Interrupted(Progress):
        def update(self, *args, **kw):
            super().update(*args, **kw)
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt

    calls: list = []
    monkeypatch.setattr(api, "Progress", Interrupted)
    stopped = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        run_encode(request, "ray", tiny_export, d, stopped, workers=2)
    part = load_manifest(stopped)
    assert not part["complete"] and len(part["pieces"]) == 3 and part["plan"] == m["plan"]
    assert {s["file"] for s in part["shards"]} <= {p.name for p in stopped.iterdir()}
    with pytest.raises(ValueError, match="unfinished encode run"):
        read_embeddings(stopped)
    monkeypatch.setattr(api, "Progress", Progress)
    res = run_encode(request, "ray", tiny_export, d, stopped, workers=2, resume=True)
    again = load_manifest(stopped)
    assert again["runs"] == 2 and res.resumed_from == sum(x["rows"] for x in part["pieces"]) > 0
    assert res.rows_this_run == len(rows) - res.resumed_from
    for key in ("shards", "pieces", "plan", "skip_list", "rows", "input"):
        assert again[key] == m[key], key
    assert_same_output(out, stopped)
    assert sorted(p.name for p in stopped.iterdir()) == sorted(p.name for p in out.iterdir())


def test_ray_stop_waits_for_a_running_piece_to_remove_its_shards(request, tiny_export, tmp_path, monkeypatch):
    """Stopping the Ray engine (a bad row met by another actor, Ctrl-C) while an actor is half-way
    through a piece: the piece is cancelled, stops at its next batch and deletes the shards it has
    written, and the stop returns only after that, so none of them can land behind the driver's
    cleanup.  A big piece and a one-row piece go to two actors; the big one's actor holds once its
    second shard is committed (support.hooks.Park) until the stop cancels it; the engine stops once the
    small one's result is back."""
    request.getfixturevalue("ray_session")
    from attncal.corpus.inputs import plan_pieces, resolve_inputs
    from attncal.corpus.ray_engine import RayEngine
    from attncal.corpus.shards import config_hash
    from attncal.corpus.storage import Location

    big = resolve_inputs(write_jsonl(tmp_path / "big.jsonl", make_rows(200, seed=3)))[0]
    small = resolve_inputs(write_jsonl(tmp_path / "small.jsonl", make_rows(1, seed=4)))[0]
    out = tmp_path / "out"
    out.mkdir()
    marker = tmp_path / "parked"
    ship_with_ray()
    monkeypatch.setattr(shards, "FAULT_HOOK", Park("committed", "part-000000-001.parquet", str(marker)))
    export = Location.parse(tiny_export)
    eng = RayEngine(export, config_hash(export), out=Location.parse(out), batch_size=8, window=32, shard_size=20,
                    text_field="text", id_field="id", on_error="skip", workers=2, num_cpus=2)
    with eng:
        eng.start()
        results = eng.run([(0, plan_pieces(big, 1 << 30)[0]), (1, plan_pieces(small, 1 << 30, None, 1)[0])])
        assert next(results)["piece"] == 1
        wait_until(marker.exists, 120, "the big piece to hold after its second shard")
        assert sorted(p.name for p in out.glob("part-000000-*")) == ["part-000000-000.parquet",
                                                                      "part-000000-001.parquet"]
        results.close()
    assert not list(out.glob("part-000000-*")), "the cancelled piece left its shards"
    # nothing lands later either: the actor that ran the piece has ended, and the output is as it was
    wait_until(lambda: process_gone(parked_pid(marker)), 60, "the stopped actor to end")
    assert sorted(p.name for p in out.iterdir()) == ["part-000001-000.parquet"]

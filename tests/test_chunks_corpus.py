"""`attncal encode --chunks / --dimensions / --precision`: one row per chunk with its window and character span,
Parquet columns of the precision's type, int8 ranges from a seeded corpus sample recorded in the manifest and
reused by --resume, exactly one row per chunk after a resume, rows that cannot be chunked skipped by name; the
local and Ray engines write what `Encoder.encode_chunks` / `Encoder.encode` give, bit for bit."""

from __future__ import annotations

import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from attncal.cli import main
from attncal.corpus import CorpusInputError, encode_corpus, load_manifest, shards
from attncal.corpus.shards import read_output
from attncal.runtime import precision as P
from attncal.runtime.chunking import ChunkOptions
from attncal.runtime.encoder import Encoder
from attncal.synthetic import synthetic_text
from support.chunk_exports import chunk_export

SMALL = dict(batch_size=4, window=8, shard_size=6, show_progress=False)
CPU = ["CPUExecutionProvider"]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return chunk_export(tmp_path_factory)[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(7)
    rows = [{"id": f"doc{i}", "text": synthetic_text(int(rng.integers(20, 400)), seed=50 + i)} for i in range(15)]
    path = tmp_path_factory.mktemp("chunk-corpus") / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path, rows


def _expected(export, rows, opts, dimensions=None, precision="float32", ranges=None):
    enc = Encoder(export, providers=CPU)
    got = enc.encode_chunks([r["text"] for r in rows], opts, batch_size=SMALL["batch_size"], dimensions=dimensions,
                            precision=precision, ranges=ranges)
    return [rows[i]["id"] for i in got.text], got


@pytest.mark.parametrize("precision", ["int8", "ubinary", "float16"])
def test_local_chunk_rows_equal_encode_chunks(export, corpus, tmp_path, precision):
    src, rows = corpus
    out = tmp_path / "out"
    res = encode_corpus(export, src, out, chunks="late", chunk_size=16, chunk_overlap=4, dimensions=16,
                        precision=precision, **SMALL)
    m = load_manifest(out)
    ranges = m["output"]["ranges"]
    if precision == "int8":  # the seeded sample: every row of a corpus smaller than RANGE_SAMPLE
        floats = _expected(export, rows, ChunkOptions("late", 16, "tokens", 4), dimensions=16)[1].vectors
        assert np.array_equal(np.asarray(ranges, np.float32), P.ranges_of(floats))
        assert m["output"]["ranges_sample"] == {"rows": 15, "size": P.RANGE_SAMPLE, "seed": P.RANGE_SEED,
                                                "vectors": len(floats)}
    else:
        assert ranges is None
    ids, want = _expected(export, rows, ChunkOptions("late", 16, "tokens", 4), 16, precision, ranges)
    got_ids, emb, cols = read_output(out)
    assert got_ids == ids and np.array_equal(emb, want.vectors) and emb.dtype == want.vectors.dtype
    for name, col in (("chunk", want.chunk), ("window", want.window), ("char_start", want.start),
                      ("char_end", want.end)):
        assert np.array_equal(cols[name], col), name
    assert cols["window"].max() >= 2 and res.rows == 15
    assert sum(s["chunk_rows"] for s in m["shards"]) == len(ids) and [s["rows"] for s in m["shards"]] == [6, 6, 3]
    schema = pq.read_schema(out / m["shards"][0]["file"])
    assert schema.field("chunk").type == pa.int32() and schema.field("char_start").type == pa.int64()
    want_type = {"int8": pa.list_(pa.int8(), 16), "ubinary": pa.binary(2), "float16": pa.list_(pa.float16(), 16)}
    assert schema.field("embedding").type == want_type[precision]


def test_plain_rows_in_a_precision(export, corpus, tmp_path):
    src, rows = corpus
    out = tmp_path / "out"
    encode_corpus(export, src, out, dimensions=8, precision="binary", **SMALL)
    ids, emb = read_output(out)[:2]
    want = Encoder(export, providers=CPU).encode([r["text"] for r in rows], batch_size=4, dimensions=8,
                                                 precision="binary")
    assert ids == [r["id"] for r in rows] and emb.dtype == np.int8 and np.array_equal(emb, want)


def test_resume_reuses_ranges_and_writes_each_chunk_once(export, corpus, tmp_path, monkeypatch):
    src, _ = corpus
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    kw = dict(chunks="naive", chunk_size=12, precision="uint8", **SMALL)
    encode_corpus(export, src, whole, **kw)

    def crash(stage, name):
        if stage == "committed" and name == "part-00001.parquet":
            raise KeyboardInterrupt

    monkeypatch.setattr(shards, "FAULT_HOOK", crash)
    with pytest.raises(KeyboardInterrupt):
        encode_corpus(export, src, killed, **kw)
    monkeypatch.setattr(shards, "FAULT_HOOK", None)
    before = load_manifest(killed)
    assert len(before["shards"]) == 2 and before["output"]["ranges"] is not None
    import attncal.corpus.api as api

    monkeypatch.setattr(api, "_sample_ranges", lambda *a: pytest.fail("resume computed the ranges again"))
    encode_corpus(export, src, killed, resume=True, **kw)
    a, b = read_output(whole), read_output(killed)
    assert a[0] == b[0] and np.array_equal(a[1], b[1]) and all(np.array_equal(a[2][k], b[2][k]) for k in a[2])
    pairs = list(zip(b[0], b[2]["chunk"].tolist()))
    assert len(pairs) == len(set(pairs))  # each chunk row once
    assert load_manifest(killed)["output"]["ranges"] == before["output"]["ranges"]
    with pytest.raises(ValueError, match="cannot resume .*: precision was 'uint8', now 'int8'"):
        encode_corpus(export, src, killed, resume=True, **{**kw, "precision": "int8"})


def test_unchunkable_rows_fail_by_name_or_are_skipped(tmp_path_factory, tmp_path):
    export = chunk_export(tmp_path_factory, every="sentence")[0]
    rows = [{"id": "ok1", "text": "A first. And a second."}, {"id": "huge", "text": synthetic_text(200, seed=6)},
            {"id": "ok2", "text": "Third text here."}]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(CorpusInputError, match=r"^row 'huge': landmark chunk 0 \(\d+ tokens\) is longer than a "
                                               r"window .*--on-error skip"):
        encode_corpus(export, src, tmp_path / "fail", chunks="landmark", **SMALL)
    res = encode_corpus(export, src, tmp_path / "skip", chunks="landmark", on_error="skip", **SMALL)
    ids = read_output(tmp_path / "skip")[0]
    assert set(ids) == {"ok1", "ok2"} and res.skipped == 1
    skipped = [json.loads(x) for x in (tmp_path / "skip" / "skipped.jsonl").read_text().splitlines()]
    assert [(s["id"], s["stage"]) for s in skipped] == [("huge", "chunking")]


CLI_ERRORS = [
    (["--chunks", "late", "--chunk-size", "64"], "chunk size 64 + overlap 0 tokens exceed the 62 content tokens"),
    (["--dimensions", "40"], "dimensions must be in [1, 32] (the model's embedding width), got 40"),
    (["--precision", "int8", "--ranges", "RANGES"], "int8 ranges have width 31, the embeddings 32"),
    (["--chunk-size", "8"], "--chunk-size, --chunk-by and --chunk-overlap need --chunks"),
    (["--chunks", "landmark"], "landmark chunking needs an export with landmark pooling"),
]


@pytest.mark.parametrize("extra,message", CLI_ERRORS, ids=[m[:25] for _, m in CLI_ERRORS])
def test_cli_errors_are_one_line(export, corpus, tmp_path, capsys, extra, message):
    src, _ = corpus
    ranges = tmp_path / "r.json"
    ranges.write_text(json.dumps([[0.0] * 31, [1.0] * 31]))
    extra = [str(ranges) if x == "RANGES" else x for x in extra]
    code = main(["encode", str(export), "-i", str(src), "-o", str(tmp_path / "o"), "-q", *extra])
    err = capsys.readouterr().err.strip()
    assert code != 0 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_ray_chunk_rows_equal_local(export, corpus, tmp_path):
    ray = pytest.importorskip("ray")
    src, _ = corpus
    local, remote = tmp_path / "local", tmp_path / "ray"
    kw = dict(chunks="late", chunk_size=16, chunk_overlap=4, dimensions=16, precision="int8", **SMALL)
    encode_corpus(export, src, local, **kw)
    ranges = load_manifest(local)["output"]["ranges"]
    with pytest.raises(ValueError, match="int8 with the ray engine needs ranges"):
        encode_corpus(export, src, tmp_path / "none", engine="ray", ray_num_cpus=2, **kw)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        import faulthandler

        faulthandler.dump_traceback_later(300, exit=True, file=sys.__stderr__)
        encode_corpus(export, src, remote, engine="ray", ray_num_cpus=2, ranges=ranges, **kw)
    finally:
        faulthandler.cancel_dump_traceback_later()
        ray.shutdown()
    a, b = read_output(local), read_output(remote)
    assert a[0] == b[0] and np.array_equal(a[1], b[1]) and all(np.array_equal(a[2][k], b[2][k]) for k in a[2])

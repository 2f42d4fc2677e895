"""`attncal encode --engine triton` against the real tritonserver, started by test_serving's fixtures
(imported, not copied), and its retry / loud-failure behaviour."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("tritonclient")

from test_serving import encoders, exports, repo, server  # noqa: E402,F401  (fixtures, reused as they are)

from attncal.corpus import encode_corpus, load_manifest, read_embeddings  # noqa: E402
from attncal.corpus.triton import TritonEngine, TritonEngineError  # noqa: E402
from attncal.serving.server import free_port  # noqa: E402
from attncal.synthetic import synthetic_text  # noqa: E402

TOL = 1e-5


def test_triton_engine_matches_encoder(exports, encoders, server, tmp_path):  # noqa: F811
    rng = np.random.default_rng(3)
    texts = [synthetic_text(int(rng.integers(1, 300)), seed=i) for i in range(90)]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    out = tmp_path / "out"
    res = encode_corpus(exports["cal"], src, out, engine="triton", url=server.grpc_url, model_name="cal", workers=4,
                        batch_size=8, window=32, shard_size=40, show_progress=False)
    ids, emb = read_embeddings(out)
    assert ids == [f"t{i}" for i in range(90)] and res.tokens is None
    assert [s["rows"] for s in load_manifest(out)["shards"]] == [40, 40, 10]
    assert np.abs(emb - encoders["cal"].encode(texts, batch_size=8)).max() <= TOL
    with pytest.raises(TritonEngineError, match="model 'nope' is not ready"):
        encode_corpus(exports["cal"], src, tmp_path / "o2", engine="triton", url=server.grpc_url, model_name="nope",
                      show_progress=False)
    assert not (tmp_path / "o2").exists()


def test_triton_engine_retries_then_fails_loudly(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr("attncal.corpus.triton.time.sleep", sleeps.append)
    eng = TritonEngine(f"127.0.0.1:{free_port()}", "m", batch_size=4, retries=3, backoff_s=0.5, timeout_s=5)
    with pytest.raises(TritonEngineError, match=r"failed after 4 attempt\(s\) \(persistent transient error\)"):
        eng._infer(["a"])
    assert sleeps == [0.5, 1.0, 2.0]
    with pytest.raises(TritonEngineError, match="not reachable|not ready"):
        eng.check(32)


def test_triton_engine_writes_dimensions_and_precision(exports, encoders, server, tmp_path):  # noqa: F811
    """--dimensions / --precision on the Triton engine: the client applies them to the server's float embeddings
    with the functions `Encoder.output` runs, so the bits equal the Encoder's wherever the server's floats and the
    Encoder's (equal to 1e-5) lie on the same side of a bit's threshold."""
    texts = [synthetic_text(40 + 5 * i, seed=200 + i) for i in range(30)]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    encode_corpus(exports["cal"], src, tmp_path / "out", engine="triton", url=server.grpc_url, model_name="cal",
                  dimensions=16, precision="ubinary", batch_size=8, show_progress=False)
    ids, got = read_embeddings(tmp_path / "out")
    enc = encoders["cal"]
    floats = enc.encode(texts, batch_size=8, dimensions=16)
    want = enc.encode(texts, batch_size=8, dimensions=16, precision="ubinary")
    assert ids == [f"t{i}" for i in range(30)] and got.shape == (30, 2) and got.dtype == np.uint8
    bits = np.unpackbits(got, axis=1) != np.unpackbits(want, axis=1)
    assert not (bits & (np.abs(floats) > 1e-4)).any()

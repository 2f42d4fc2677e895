"""`Encoder.encode_chunks`: naive chunks equal `Encoder.encode` of the chunk texts, late chunks equal a PyTorch
reference written from the late-chunking description (transformers' forward, with attncal's calibration where the
export is calibrated, span means of the chunk's own tokens, normalisation), landmark chunks are the landmark
states of the export's own tokenization, and each bad text gets its one-line error."""

from __future__ import annotations

import numpy as np
import pytest

from attncal.runtime.chunking import ChunkOptions
from attncal.runtime.precision import normalise
from attncal.runtime.encoder import Encoder
from attncal.synthetic import synthetic_text
from support.chunk_exports import CALIBRATION, MAX_LENGTH, chunk_export

TOL = 1e-5
CPU = ["CPUExecutionProvider"]


def _texts():
    """A short text (one window), one of several windows (max length 64, one token per character), sentences."""
    return [synthetic_text(40, seed=1),
            synthetic_text(300, seed=2),
            "First one here. A second, longer sentence follows it! Third?\n\nNew paragraph at the end."]


@pytest.fixture(scope="module", params=[("bert", "mean", True), ("bert", "mean", False), ("qwen3", "last", True)],
                ids=lambda p: f"{p[0]}-{p[1]}-{'cal' if p[2] else 'plain'}")
def late_case(request, tmp_path_factory):
    arch, pooling, cal = request.param
    export, model = chunk_export(tmp_path_factory, arch, pooling, cal)
    return export, model, pooling, cal


def _reference_late(model_dir, pooling, calibrated, text, size, overlap):
    """Late chunking from its description, in PyTorch: the text's tokens (special tokens left out) cut into chunks of
    `size`; windows of whole chunks of at most max length (template included), each after the first opening with
    the `overlap` tokens before its first chunk; one transformers forward per window (calibrated as the export is);
    each chunk the mean of its own tokens' final states, L2-normalised."""
    import contextlib

    import torch

    from attncal.calibration.config import CalibrationConfig
    from attncal.calibration.encode import TorchEncoder
    from attncal.calibration.patching import calibrate
    from attncal.modelinfo import forward_kwargs

    te = TorchEncoder(model_dir)
    tok = te.tokenizer
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = [i for i in enc["input_ids"] if i not in tok.all_special_ids]
    full = tok("a")["input_ids"]
    plain = tok("a", add_special_tokens=False)["input_ids"]
    at = full.index(plain[0])
    prefix, suffix = full[:at], full[at + len(plain):]
    budget = MAX_LENGTH - len(prefix) - len(suffix)
    chunks = [(a, min(a + size, len(ids))) for a in range(0, len(ids), size)]
    out, c, first = [], 0, True
    while c < len(chunks):
        lo = 0 if first else max(0, chunks[c][0] - overlap)
        e = c
        while e < len(chunks) and chunks[e][1] - lo <= budget:
            e += 1
        row = prefix + ids[lo:chunks[e - 1][1]] + suffix
        batch = {"input_ids": torch.tensor([row]), "attention_mask": torch.ones(1, len(row), dtype=torch.long)}
        if "token_type_ids" in tok.model_input_names:
            batch["token_type_ids"] = torch.zeros(1, len(row), dtype=torch.long)
        with torch.no_grad(), contextlib.ExitStack() as stack:
            if calibrated:
                stack.enter_context(calibrate(te.model, CalibrationConfig(**CALIBRATION), pooling=pooling))
            hidden = te.model(**batch, **forward_kwargs(te.model)).last_hidden_state[0]
        for k in range(c, e):
            a, b = chunks[k]
            v = hidden[len(prefix) + a - lo: len(prefix) + b - lo].mean(0)
            out.append(torch.nn.functional.normalize(v, dim=-1).numpy())
        c, first = e, False
    return np.stack(out)


def test_late_chunks_equal_the_torch_reference(late_case):
    """Both ways of computing them: in the graph (the calibrated exports have chunk vectors) and from the token
    states (every export; the uncalibrated one has nothing else)."""
    export, model, pooling, cal = late_case
    enc = Encoder(export, providers=CPU)
    assert enc.has_chunk_vectors == cal
    texts = _texts()[:2]
    got = enc.encode_chunks(texts, "late", size=12, overlap=5, batch_size=3)
    states = enc.encode_chunks(texts, "late", size=12, overlap=5, batch_size=3, in_graph=False)
    assert got.window[got.of(1)].max() >= 2  # the long text took several windows
    for i, text in enumerate(texts):
        want = _reference_late(model, pooling, cal, text, 12, 5)
        np.testing.assert_allclose(got.vectors[got.of(i)], want, atol=TOL, rtol=0)
        np.testing.assert_allclose(states.vectors[states.of(i)], want, atol=TOL, rtol=0)
    for col in ("text", "chunk", "window", "start", "end"):
        assert np.array_equal(getattr(got, col), getattr(states, col)), col
    if not cal:
        with pytest.raises(ValueError, match="no chunk-vector output .*--chunk-vectors"):
            enc.encode_chunks(texts, "late", in_graph=True)


def test_check_verifies_chunk_vectors(tmp_path_factory):
    """`attncal check` (check_parity) of an export with chunk vectors compares them with the token states' path."""
    from attncal.runtime.parity import ParityReport, check_parity

    export, model = chunk_export(tmp_path_factory, "bert", "mean", True)
    report = check_parity(export, [synthetic_text(40, seed=1), synthetic_text(300, seed=2)], model, batch_size=2)
    assert report.chunk_count > 3 and report.chunk_max_abs <= TOL and report.ok
    assert "chunk vectors: max abs diff" in report.summary()
    plain_export = chunk_export(tmp_path_factory, "bert", "mean", False)[0]
    plain = check_parity(plain_export, ["short text"], model)
    assert plain.chunk_max_abs is None and "chunk vectors" not in plain.summary()
    assert Encoder(export, providers=CPU).meta["chunk_vectors"]["output"] == "chunk_embeddings"
    assert "chunk_vectors" not in Encoder(plain_export, providers=CPU).meta  # as in exports made before the option
    bad = ParityReport(**{**report.__dict__, "chunk_max_abs": 2e-5})
    assert not bad.ok


def test_calibration_changes_late_chunks(tmp_path_factory):
    cal = Encoder(chunk_export(tmp_path_factory, "bert", "mean", True)[0], providers=CPU)
    plain = Encoder(chunk_export(tmp_path_factory, "bert", "mean", False)[0], providers=CPU)
    text = [synthetic_text(300, seed=2)]
    a, b = cal.encode_chunks(text, "late", size=12), plain.encode_chunks(text, "late", size=12)
    assert np.abs(a.vectors - b.vectors).max() > 1e-3  # the calibrated forward is a different one


def test_naive_chunks_equal_encode_of_the_chunk_texts(tmp_path_factory):
    enc = Encoder(chunk_export(tmp_path_factory)[0], providers=CPU)
    texts = _texts()
    for opts in (ChunkOptions("naive", 12, "tokens", 4), ChunkOptions("naive", 20, "sentence", 0)):
        got = enc.encode_chunks(texts, opts, batch_size=4)
        pieces = [texts[t][s:e] for t, s, e in zip(got.text, got.start, got.end)]
        assert np.array_equal(got.vectors, enc.encode(pieces, batch_size=4))
        assert np.array_equal(got.window, got.chunk)  # one model call per chunk
    # nothing is cut: the chunks of late chunking follow each other to the text's last token
    late = enc.encode_chunks(texts, "late", size=12)
    for i in range(len(texts)):
        s, e = late.start[late.of(i)], late.end[late.of(i)]
        assert (s[1:] >= e[:-1]).all() and s[0] == 0 and e[-1] == len(texts[i].rstrip())


def test_sentence_chunks_end_at_sentence_ends(tmp_path_factory):
    enc = Encoder(chunk_export(tmp_path_factory)[0], providers=CPU)
    text = _texts()[2]
    got = enc.encode_chunks([text], "late", size=12, by="sentence")
    ends = set(got.end.tolist())
    assert {text.index("here.") + 5, text.index("it!") + 3} <= ends  # sentences are not merged past 12 tokens
    assert all(e - s <= 40 for s, e in zip(got.start, got.end))


def test_landmark_chunks_are_the_landmark_states(tmp_path_factory):
    enc = Encoder(chunk_export(tmp_path_factory, every=8)[0], providers=CPU)
    short, long = synthetic_text(30, seed=4), synthetic_text(300, seed=5)
    got = enc.encode_chunks([short, long], "landmark")
    feeds = enc.tokenize([short])
    hidden, emb = enc.run(feeds)
    marks = np.flatnonzero(feeds["input_ids"][0] == enc.pooling.token_id)
    assert len(marks) == len(got.vectors[got.of(0)]) > 1
    np.testing.assert_allclose(got.vectors[got.of(0)], normalise(hidden[0, marks]), atol=1e-6)
    # the whole-text embedding of an LMK export is the mean of these landmark states
    np.testing.assert_allclose(normalise(hidden[0, marks].mean(0, keepdims=True)), emb, atol=1e-6)
    states = enc.encode_chunks([short, long], "landmark", in_graph=False)  # the graph's chunk vectors are the same
    np.testing.assert_allclose(got.vectors, states.vectors, atol=1e-6, rtol=0)
    assert got.window[got.of(1)].max() >= 2 and len(got.vectors[got.of(1)]) == int(np.ceil(
        len(enc._chunker._texts([long])[0].ids) / 8))


BAD = [
    (["fine text", ""], dict(), "text 1: is empty"),
    (["  \n "], dict(), "text 0: is empty"),
    (["[CLS] [SEP] [PAD]"], dict(), "text 0: holds only special tokens"),
    (["fine text"], dict(size=MAX_LENGTH), "exceed the"),
    (["fine text"], dict(size=40, overlap=40), "exceed the"),
    (["fine text"], dict(dimensions=0), "dimensions must be in [1, 32]"),
    (["fine text"], dict(dimensions=33), "dimensions must be in [1, 32]"),
    (["fine text"], dict(precision="int8", ranges=np.zeros((2, 31))), "int8 ranges have width 31, the embeddings 32"),
    (["fine text"], dict(precision="int8"), "int8 needs ranges"),
    (["fine text"], dict(precision="int4"), "precision must be one of"),
]


@pytest.mark.parametrize("texts,kwargs,message", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_input_one_line_errors(tmp_path_factory, texts, kwargs, message):
    enc = Encoder(chunk_export(tmp_path_factory)[0], providers=CPU)
    with pytest.raises(ValueError) as info:
        enc.encode_chunks(texts, "late", **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_bad_texts_are_listed_and_the_rest_encoded(tmp_path_factory):
    enc = Encoder(chunk_export(tmp_path_factory, every="sentence")[0], providers=CPU)
    long_sentence = synthetic_text(200, seed=6)  # one sentence of ~200 tokens: longer than any window
    texts = ["A first. And a second.", long_sentence, "", "Third text here."]
    errors: list = []
    got = enc.encode_chunks(texts, "landmark", errors=errors)
    assert [i for i, _ in errors] == [1, 2]
    assert "longer than a window" in errors[0][1] and errors[1][1] == "text 2: is empty"
    assert sorted(set(got.text.tolist())) == [0, 3]
    with pytest.raises(ValueError, match="text 1: landmark chunk 0"):
        enc.encode_chunks(texts[:2], "landmark")


def test_chunk_vectors_refuse_a_dense_head(tmp_path):
    """A Dense head after pooling: the token states are not embeddings, so --chunk-vectors is refused before the
    export starts (nothing written)."""
    from attncal.exporting.exporter import ExportOptions, export
    from attncal.synthetic import save_synthetic_model

    model = save_synthetic_model("bert", tmp_path / "m", seed=1, dense=((16, "Tanh", True),))
    with pytest.raises(ValueError, match="--chunk-vectors: this model projects its pooled embedding with a Dense"):
        export(str(model), tmp_path / "out", ExportOptions(chunk_vectors=True, exporter="torchscript"), quiet=True)
    assert not (tmp_path / "out").exists()

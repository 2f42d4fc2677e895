"""Token-budget batching: `length_batches` bounds each batch's padded tokens, and `Encoder.encode` /
`attncal encode` give the count-batched embeddings with it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attncal.runtime.encoder import length_batches


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """An uncalibrated tiny BERT export, max length 64."""
    from attncal.exporting.exporter import ExportOptions, export
    from attncal.synthetic import save_synthetic_model

    root = tmp_path_factory.mktemp("token-batches")
    model = save_synthetic_model("bert", root / "m", seed=3, max_positions=128, max_seq_length=64)
    out = root / "export"
    export(str(model), out, ExportOptions(calibrate=False, exporter="torchscript", check=False), quiet=True)
    return out


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = "the of a calibration attention basket key position token passage retrieval index".split()
    return [" ".join(rng.choice(words, int(k))) for k in rng.integers(1, 30, n)]


@pytest.mark.parametrize("budget, batch_size", [(100, 32), (64, 4), (1000, 8), (7, 32)])
def test_batches_hold_the_budget_and_each_text_once(budget, batch_size):
    lengths = np.random.default_rng(budget).integers(1, 60, 200)
    batches = length_batches(lengths, batch_size, budget)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
    flat = np.concatenate(batches)
    assert (np.diff(lengths[flat]) <= 0).all()  # longest first, as count batching sorts
    for k, b in enumerate(batches):
        longest = int(lengths[b].max())
        assert len(b) <= batch_size
        assert len(b) * longest <= budget or len(b) == 1, (k, len(b), longest)
        if k + 1 < len(batches) and len(b) < batch_size:  # cut only where the next text would break the budget
            assert (len(b) + 1) * max(longest, int(lengths[batches[k + 1][0]])) > budget
    # Without a budget it is count batching: batch_size texts at a time in the same order.
    plain = length_batches(lengths, batch_size)
    assert [len(b) for b in plain[:-1]] == [batch_size] * (len(plain) - 1)
    assert np.concatenate(plain).tolist() == flat.tolist()


def test_unsorted_batches_keep_input_order_and_refuse_bad_values():
    batches = length_batches([5, 100, 20, 20, 3, 7], 32, 60, sort_by_length=False)
    assert [b.tolist() for b in batches] == [[0], [1], [2, 3, 4], [5]]
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_batch_tokens must be an integer >= 1"):
            length_batches([3], 32, bad)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        length_batches([3], None, 10)


def test_encode_by_token_budget_matches_count_batches(tiny_export, monkeypatch):
    from attncal.runtime.encoder import Encoder

    enc = Encoder(tiny_export, providers=["CPUExecutionProvider"])
    texts = _texts(60)
    reference = enc.encode(texts, batch_size=8)
    shapes = []
    run = enc.run

    def spy(feeds):
        shapes.append(feeds["input_ids"].shape)
        return run(feeds)

    monkeypatch.setattr(enc, "run", spy)
    budget = 300
    got = enc.encode(texts, batch_size=32, max_batch_tokens=budget)
    assert max(enc.token_lengths(texts)) * 8 > budget  # the budget binds: count batching of 8 would break it
    assert sum(n for n, _ in shapes) == len(texts) and len(shapes) > 2
    assert all(n * length <= budget or n == 1 for n, length in shapes), shapes
    assert max(n for n, _ in shapes) > 8  # short texts went in larger batches than count batching's 8
    np.testing.assert_allclose(got, reference, atol=2e-6)  # input order kept; other batch shapes, fp32 rounding
    with pytest.raises(ValueError, match="max_batch_tokens must be an integer >= 1, got 0"):
        enc.encode(texts, max_batch_tokens=0)


def test_attncal_encode_records_and_applies_the_budget(tiny_export, tmp_path, monkeypatch):
    from attncal.cli import main
    from attncal.runtime.encoder import Encoder

    texts = _texts(40, seed=1)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    calls = []
    run = Encoder.run

    def spy(self, feeds):
        calls.append(feeds["input_ids"].shape)
        return run(self, feeds)

    monkeypatch.setattr(Encoder, "run", spy)
    assert main(["encode", str(tiny_export), "-i", str(src), "-o", str(tmp_path / "out"), "--max-batch-tokens",
                 "200", "-q"]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["options"]["max_batch_tokens"] == 200 and manifest["engine"]["max_batch_tokens"] == 200
    assert calls and all(n * length <= 200 or n == 1 for n, length in calls), calls
    import pyarrow.parquet as pq

    table = pq.read_table(sorted((tmp_path / "out").glob("part-*.parquet"))[0])
    got = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    want = Encoder(tiny_export, providers=["CPUExecutionProvider"]).encode(texts, batch_size=8)
    np.testing.assert_allclose(got, want, atol=2e-6)

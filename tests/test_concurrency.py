"""`Encoder.encode` from many threads at once, and its input checks."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from attncal.synthetic import synthetic_text
from test_artifact import tiny_export

THREADS = 8


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    from attncal import Encoder

    return Encoder(tiny_export(tmp_path_factory), providers=["CPUExecutionProvider"])


def test_encode_from_8_threads_equals_sequential(encoder):
    """Different text lists per thread (mixed lengths, some beyond max length), all threads released
    together and looping; every result is identical to the sequential call's."""
    lists = [[synthetic_text(5 + (k * 37 + i * 11) % 400, seed=100 * k + i) for i in range(6 + k)]
             for k in range(THREADS)]
    expected = [encoder.encode(texts, batch_size=4) for texts in lists]
    results: dict[tuple[int, int], np.ndarray] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(THREADS)

    def work(k: int) -> None:
        try:
            barrier.wait(timeout=30)
            for r in range(3):
                results[k, r] = encoder.encode(lists[k], batch_size=4)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "an encode call hung"
    assert errors == []
    assert len(results) == THREADS * 3
    for (k, _), got in results.items():
        assert got.dtype == np.float32 and got.shape == expected[k].shape
        assert np.array_equal(got, expected[k]), (k, float(np.abs(got - expected[k]).max()))


@pytest.mark.parametrize("texts, error, message", [
    (None, TypeError, "got None"),
    ("one string", TypeError, "not a single str"),
    (b"raw bytes", TypeError, "not a single bytes"),
    (["fine", 3], TypeError, r"texts\[1\] is int, not str"),
    (["fine", b"bytes"], TypeError, r"texts\[1\] is bytes, not str; decode bytes"),
    (["fine", None], TypeError, r"texts\[1\] is NoneType"),
    (42, TypeError, "got int"),
])
def test_bad_input_names_the_problem(encoder, texts, error, message):
    with pytest.raises(error, match=message):
        encoder.encode(texts)


def test_bad_batch_size_and_empty_list(encoder):
    with pytest.raises(ValueError, match="batch_size"):
        encoder.encode(["x"], batch_size=0)
    empty = encoder.encode([])
    assert empty.shape == (0, encoder.dimension) == (0, 32) and empty.dtype == np.float32
    assert encoder.encode(iter(["a generator works"])).shape == (1, 32)

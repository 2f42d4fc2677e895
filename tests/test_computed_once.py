"""support.computed_once: the kernel tests' references shared across the CPU paths, keyed on every input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support.computed_once import computed_once

CALLS: list[tuple] = []


def reference(x, scale, *, shift=0.0):
    CALLS.append((x, scale, shift))
    return x.double() * scale + shift


def test_the_same_inputs_compute_once_and_any_other_input_anew():
    CALLS.clear()
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    first = computed_once(reference, x, 2.0)
    assert computed_once(reference, x.clone(), 2.0) is first and len(CALLS) == 1  # equal values: a hit
    y = x.clone()
    y[1, 2] = 7.0
    others = [computed_once(reference, y, 2.0),  # one element
              computed_once(reference, x.double(), 2.0),  # the dtype
              computed_once(reference, x.reshape(3, 2), 2.0),  # the shape
              computed_once(reference, x, 3.0),  # a plain argument
              computed_once(reference, x, 2.0, shift=1.0)]  # a keyword
    assert len(CALLS) == 6 and all(o is not first for o in others)
    np.testing.assert_array_equal(first, x.double().numpy() * 2.0)


def test_a_shared_reference_cannot_be_written_into():
    """A test that wrote into its reference would change what the next CPU path is checked against."""
    ref = computed_once(reference, torch.ones(4), 1.0)
    with pytest.raises(ValueError, match="read-only"):
        ref[0] = 5.0
    assert computed_once(reference, torch.ones(4), 1.0)[0] == 1.0

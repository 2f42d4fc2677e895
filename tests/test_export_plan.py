"""The export's plan: every option conflict refused from one table, with its message, before anything is
loaded or written; the metadata written from one dataclass."""

from __future__ import annotations

import dataclasses
import re

import pytest

from attncal.artifact import ExportMetadata, validate_metadata
from attncal.exporting.exporter import export
from attncal.exporting.plan import CONFLICTS, ExportOptions, check_options


@pytest.mark.parametrize("index", range(len(CONFLICTS)), ids=lambda i: "-".join(map(str, CONFLICTS[i].example.values())))
def test_each_conflict_is_refused_with_its_message_before_anything_is_read(index, tmp_path):
    conflict = CONFLICTS[index]
    opts = ExportOptions(**conflict.example)
    assert conflict.applies(opts)
    # The example has this conflict and no earlier one, so this entry's message is the one a user reads.
    assert not any(c.applies(opts) for c in CONFLICTS[:index])
    with pytest.raises(ValueError) as err:
        check_options(opts)
    assert str(err.value) == conflict.message(opts) and "\n" not in str(err.value)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="^" + re.escape(str(err.value)) + "$"):
        export(tmp_path / "no-such-model", out, opts, quiet=True)  # refused before the model is looked up
    assert list(tmp_path.iterdir()) == []


def test_default_and_every_example_alone_pass_where_they_should():
    check_options(ExportOptions())
    for conflict in CONFLICTS:  # each conflict names options that are fine one at a time
        for key, value in conflict.example.items():
            if len(conflict.example) > 1:
                check_options(ExportOptions(**{key: value}))


def test_placement_refusal_comes_before_the_working_directory(tiny_models, tmp_path):
    from attncal import CalibrationConfig
    from attncal.graphs.placements.row_placement import RowPlacementError

    opts = ExportOptions(config=CalibrationConfig(pooling="mean"), placement="row", exporter="torchscript")
    with pytest.raises(RowPlacementError, match="row placement needs a single pooling row"):
        export(tiny_models["bert"], tmp_path / "out", opts, quiet=True)
    assert list(tmp_path.iterdir()) == []  # no working directory was made


def test_metadata_dataclass_writes_the_validated_keys_in_order():
    names = [f.name for f in dataclasses.fields(ExportMetadata)]
    values = {n: None for n in names if n not in ("format", "export_steps")}
    values.update(calibrated=False, calibrated_layers=[], model_type="bert", architecture="BertModel", tested=True,
                  num_layers=2, pooling={"kind": "cls"}, normalize=True, padding_side="right", inputs=["input_ids",
                  "attention_mask"], outputs=["last_hidden_state", "sentence_embedding"], opset=18,
                  exporter="torchscript", graphs={}, fp16=False, files=[], versions={}, memory_estimate={})
    meta = ExportMetadata(**values)
    d = meta.to_dict()
    assert list(d)[0] == "format" and "export_steps" not in d  # written only once the steps have run
    assert validate_metadata(d) is d
    meta.export_steps = [{"step": "write", "seconds": 0.1, "peak_rss_mib": 1.0}]
    assert list(meta.to_dict())[-1] == "export_steps"
    with pytest.raises(ValueError, match="key 'opset' must be an integer"):
        validate_metadata(dict(d, opset="18"))

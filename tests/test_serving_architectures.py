"""Triton serving of every architecture added by capability: one real server, one repository holding a
calibrated export of each (default placement), parity with `attncal.Encoder` over HTTP.

The EmbeddingGemma-shaped export (Dense modules, a default prompt) checks that the served tokenizer puts
the model's default prompt before every text, as the Encoder and sentence-transformers do; an int8 export
(`--quantize int8`) is served the same way.  Serving is the subject, not the exporter: the exports come from
TorchScript where it traces (conftest.quick_exporter; dynamo for Gemma3).
"""

from __future__ import annotations

import numpy as np
import pytest

from attncal.artifact import onnx_io
from attncal.serving.repository import RepoOptions, build_repository
from attncal.serving.server import TritonServer, free_port

pytest.importorskip("tritonclient")
from conftest import quick_exporter  # noqa: E402
from test_serving import _env_or_skip, _http_embed  # noqa: E402 - the serving tests' helpers

pytestmark = pytest.mark.usefixtures("shared_raw_exports")  # conftest: one torch.onnx export per model and options

# Gemma3 is served as "gemma-st" below (its Dense modules and default prompt on top of the same graph): a plain
# Gemma3 case too would add a second dynamo export (~30 s on the 2-core CI machine) for no path of its own.
ARCHS = ("mpnet", "distilbert", "roberta", "t5")
MAX_LEN = 96
TEXTS = ["a", "hello world", "calibrated attention " * 3, "position bias in long passages " * 6,
         "naïve café — 東京 ✓"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    _env_or_skip()
    from attncal.calibration.config import CalibrationConfig
    from attncal.exporting.exporter import ExportOptions, export
    from attncal.runtime.encoder import Encoder
    from attncal.synthetic import save_synthetic_model

    root = tmp_path_factory.mktemp("serving-archs")
    repo = root / "repo"
    cases = {a: {} for a in ARCHS}
    cases["gemma-st"] = dict(arch="gemma3_text", dense=((48, "Identity", False), (24, "Identity", False)),
                             prompts={"query": "task: search result | query: ", "document": "title: none | text: "},
                             default_prompt_name="document")
    cases["bert-int8"] = dict(arch="bert", quantize="int8")
    cases["bert-external"] = dict(arch="bert", external=True)  # its graph's weights in model.onnx_data, as above 2 GiB
    encoders = {}
    for name, extra in cases.items():
        arch = extra.pop("arch", name)
        quantize = extra.pop("quantize", None)
        external = extra.pop("external", False)
        src = save_synthetic_model(arch, root / f"src-{name}", seed=5, max_positions=128, max_seq_length=MAX_LEN,
                                   **extra)
        out = root / name
        with pytest.MonkeyPatch.context() as mp:
            if external:
                mp.setattr(onnx_io, "INLINE_LIMIT", 0)
            export(str(src), out, ExportOptions(config=CalibrationConfig(basket_size=8, strength=1.0), check=False,
                                                optimized=False, quantize=quantize, exporter=quick_exporter(arch)),
                   quiet=True)
        build_repository(out, repo, RepoOptions(name=name.replace("_", "-"), max_batch=8, max_queue_delay_us=2000))
        encoders[name] = Encoder(out, providers=["CPUExecutionProvider"])
    served_graphs = [g for g in repo.rglob("*.onnx") if any(d.name.startswith("bert-external") for d in g.parents)]
    assert served_graphs and all(g.with_name(g.name + "_data").exists() for g in served_graphs), served_graphs
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    server.start()
    try:
        server.wait_ready(180)
        yield server, encoders
    finally:
        server.stop()


def test_every_architecture_is_served_with_parity(served):
    server, encoders = served
    for name, enc in encoders.items():
        ref = enc.encode(TEXTS)
        got = _http_embed(server.http_url, name.replace("_", "-"), TEXTS)
        assert got.shape == ref.shape
        assert np.abs(got - ref).max() <= 1e-5, (name, np.abs(got - ref).max())
    gemma = encoders["gemma-st"]
    no_prompt = gemma.encode(TEXTS, prompt="")
    served_emb = _http_embed(server.http_url, "gemma-st", TEXTS)
    assert np.abs(served_emb - no_prompt).max() > 1e-3, "the served tokenizer must apply the default prompt"

"""The bench harness itself (no timing assertions)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from attncal import cpuinfo
from attncal.cli import main

# The bench is the subject, not torch.onnx: its exports of the tiny BERT share one torch.onnx export (conftest).
pytestmark = pytest.mark.usefixtures("shared_raw_exports")


def test_two_engine_one_shape_run_writes_json_table_and_plots(tiny_models, tmp_path, capsys):
    out = tmp_path / "results"
    code = main(["bench", str(tiny_models["bert"]), "--engines", "ort,ort-cal", "--seq", "40", "--batch", "2",
                 "--repeats", "2", "--basket-size", "8", "--memory-probes", "2", "--out", str(out),
                 "--workdir", str(tmp_path / "work")])
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    rows = {r["engine"]: r for r in data["rows"]}
    assert set(rows) == {"ort", "ort-cal"}
    for r in rows.values():
        assert (r["seq"], r["batch"]) == (40, 2)
        assert r["p50_ms"] > 0 and r["p95_ms"] >= r["p50_ms"] and r["tok_per_s"] == pytest.approx(80 / r["p50_ms"] * 1e3)
        assert len(r["peak_mib_probes"]) == 2 and r["peak_mib"] == pytest.approx(sum(r["peak_mib_probes"]) / 2)
    assert rows["ort"]["latency_vs_ort"] == 1.0
    assert rows["ort-cal"]["latency_vs_ort"] == pytest.approx(rows["ort-cal"]["p50_ms"] / rows["ort"]["p50_ms"])
    assert data["meta"]["memory_probes"] == 2
    # BERT's peer is its ORT-optimized graph where that ran; here only the plain export did.
    assert data["meta"]["peer"] == "ort" and "Peer (lat/peer, mem/peer): `ort`" in (out / "results.md").read_text()
    assert rows["ort-cal"]["latency_vs_peer"] == rows["ort-cal"]["latency_vs_ort"]
    assert rows["ort-cal"]["memory_vs_peer"] == pytest.approx(rows["ort-cal"]["peak_mib"] / rows["ort"]["peak_mib"])
    assert data["meta"]["machine"]["threads"] >= 1 and "onnxruntime" in data["meta"]["machine"]["versions"]
    # What a figure generated from this file names: the model as given, the date, the machine's CPU class, the
    # commit of this checkout ("+changes" where attncal/ or plugins/ differ from it); the command only where
    # `attncal bench` was typed (here `main` is called).
    meta = data["meta"]
    assert meta["model"] == str(tiny_models["bert"]) and meta["command"] is None
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", meta["date"]) and meta["machine"]["cpu_class"] in cpuinfo.CLASSES
    if (Path(__file__).resolve().parents[1] / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{7,40}(\+changes)?", meta["commit"]), meta["commit"]
    else:  # an unpacked source tree: no commit to name
        assert meta["commit"] is None
    table = (out / "results.md").read_text()
    assert "| ort-cal | 2 | 40 |" in table and "median of 2 fresh processes" in table
    for png in ("latency.png", "memory.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".results.tmp")]


def test_cached_exports_are_reused_only_by_the_code_that_made_them(tiny_models, tmp_path, monkeypatch):
    """A checkout's next commit keeps attncal's version string; its bench must export anew, not measure the
    exports the last commit's code made."""
    from attncal.bench import engines

    work = tmp_path / "work"

    def bench() -> set[str]:
        assert main(["bench", str(tiny_models["bert"]), "--engines", "ort", "--seq", "16", "--batch", "1",
                     "--repeats", "1", "--no-memory", "--out", str(tmp_path / "results"),
                     "--workdir", str(work)]) == 0
        return {p.name for p in work.iterdir() if p.is_dir()}

    first = bench()
    assert bench() == first  # same code: the cached export is reused
    fingerprint = engines.export_code_fingerprint()
    assert fingerprint == engines.export_code_fingerprint() and len(fingerprint) == 12
    monkeypatch.setattr(engines, "export_code_fingerprint", lambda: "other code")
    second = bench()
    assert first < second and len(second - first) == 1


def test_peer_is_the_optimized_graph_where_it_ran_else_the_plain_export():
    from attncal.bench.engines import peer_engine

    assert peer_engine(["ort", "ort-cal", "ort-opt"]) == "ort-opt"
    assert peer_engine(["ort-native", "ort"]) == "ort"
    assert peer_engine(["torch", "ort-cal"]) is None


def test_peak_memory_is_the_median_of_interleaved_fresh_process_probes(monkeypatch):
    """One process can peak in another allocator mode (MiniLM 8 x 128, `ort-opt` in ten processes: 38.7 MiB
    seven times, 35.7 and 36.5 once each), so a single probe pair gave ratios up to 1.12 where the median gave
    1.03.  The engines take turns, so a change in the machine's state during the probes hits both."""
    from attncal.bench import harness

    probes = {"a": iter([38.7, 35.7, 38.7]), "b": iter([42.5, 40.0, 40.0])}
    order = []

    def fake_probe(ws, engine, seq, batch):
        order.append(engine)
        return next(probes[engine])

    monkeypatch.setattr(harness, "make_engine", lambda name, ws, **kw: (lambda feeds: None))
    monkeypatch.setattr(harness, "_vocab", lambda ws: 100)
    monkeypatch.setattr(harness, "measure_memory", fake_probe)
    rows, notes = harness.run_bench(None, ["a", "b"], [16], [1], 1, memory_probes=3, progress=False)
    assert not notes and order == ["a", "b"] * 3
    by = {r.engine: r for r in rows}
    assert (by["a"].peak_mib, by["a"].peak_mib_probes) == (38.7, [38.7, 35.7, 38.7])
    assert (by["b"].peak_mib, by["b"].peak_mib_probes) == (40.0, [42.5, 40.0, 40.0])
    with pytest.raises(ValueError, match="memory_probes must be >= 1"):
        harness.run_bench(None, ["a"], [16], [1], 1, memory_probes=0, progress=False)


def test_engine_sessions_stop_spinning_between_runs(tiny_models, tmp_path):
    """The engines' sessions run interleaved in one process: a session whose workers spin on after its run
    takes cores from the next engine's run (at 1 x 70 on MiniLM the reported p50 was 1.8x the session's own).
    They take the Encoder's choice of ORT's memory pattern, unless a +mempattern / +nomempattern suffix sets it."""
    from attncal.bench.engines import Workspace, build_exports, make_engine
    from attncal.calibration.config import CalibrationConfig

    ws = Workspace(tiny_models["bert"], CalibrationConfig(basket_size=8), tmp_path / "work", threads=2)
    build_exports(ws, ["ort", "ort-opt-cal+mempattern"])
    for name in ("ort", "ort-opt-cal", "ort-opt-cal+mempattern"):
        options = make_engine(name, ws).encoder.session.get_session_options()
        assert options.get_session_config_entry("session.force_spinning_stop") == "1"
        assert options.intra_op_num_threads == 2
    # +mempattern: ORT's memory pattern on, as ORT's defaults have it, where the Encoder's default turns it off
    meta_file = ws.export_dir("opt-cal") / "attncal.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "max_seq_length": 8192}))
    assert make_engine("ort-opt-cal", ws).encoder.session.get_session_options().enable_mem_pattern is False
    assert make_engine("ort-opt-cal+mempattern", ws).encoder.session.get_session_options().enable_mem_pattern
    meta_file.write_text(json.dumps(meta))  # the tiny model's own length: the Encoder keeps the pattern
    assert make_engine("ort-opt-cal", ws).encoder.session.get_session_options().enable_mem_pattern is True
    assert make_engine("ort-opt-cal+nomempattern", ws).encoder.session.get_session_options().enable_mem_pattern \
        is False


def test_encoder_keeps_the_memory_pattern_for_short_exports_only(tiny_models, tmp_path):
    """ORT's memory pattern holds a batch shape's working memory about twice (docs/performance.md, "Session
    options"): long-context exports (and those without a max length) run without it, short ones with it, and a
    caller's own options are taken as given."""
    import onnxruntime as ort

    from attncal.exporting.exporter import ExportOptions, export
    from attncal.runtime import Encoder
    from attncal.artifact import LONG_CONTEXT_TOKENS
    from attncal.runtime.encoder import default_session_options

    assert default_session_options(LONG_CONTEXT_TOKENS).enable_mem_pattern
    assert not default_session_options(LONG_CONTEXT_TOKENS + 1).enable_mem_pattern
    assert not default_session_options(None).enable_mem_pattern
    out = tmp_path / "raw"
    export(tiny_models["bert"], out, ExportOptions(calibrate=False, check=False, optimized=False), quiet=True)
    meta = json.loads((out / "attncal.json").read_text())
    assert meta["max_seq_length"] <= LONG_CONTEXT_TOKENS
    assert Encoder(out).session.get_session_options().enable_mem_pattern is True
    for length in (8192, None):
        (out / "attncal.json").write_text(json.dumps({**meta, "max_seq_length": length}))
        assert Encoder(out).session.get_session_options().enable_mem_pattern is False
        mine = ort.SessionOptions()
        assert Encoder(out, session_options=mine).session.get_session_options().enable_mem_pattern is True


def test_an_ort_engine_may_take_a_twin_session():
    """`ort-native@2` is a second session of ort-native (an A/A control), alone or after a memory-pattern suffix;
    other engines take no twin."""
    from attncal.bench import engines

    assert engines.is_engine("ort-native@2") and engines.is_engine("ort-opt-native+nomempattern@2")
    assert engines._split("ort-native+mempattern@2") == ("ort-native", True)
    assert not engines.is_engine("torch@2") and not engines.is_engine("ort-native@3")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--engines", "ort,onnx-magic"], "unknown engine(s) onnx-magic"),
        (["--engines", "ort,torch+mempattern,ort+mempattern+nomempattern"],
         "unknown engine(s) torch+mempattern, ort+mempattern+nomempattern"),
        (["--seq", "128,abc"], "--seq must be a comma-separated list of integers"),
        (["--batch", "0"], "--batch must list integers >= 1"),
        (["--seq", "100000"], "exceeds the model's 256 positions"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--memory-probes", "0"], "--memory-probes must be >= 1, got 0 (--no-memory skips the probes)"),
        (["--clock", "cpu", "--threads", "2"], "--clock cpu: the cpu clock needs one intra-op thread (--threads 1), got 2"),
        (["--clock", "cpu", "--threads", "1", "--engines", "ort,torch-sdpa"],
         "--clock cpu: the cpu clock times this process, and torch-sdpa runs in its own process"),
    ],
)
def test_bad_engine_or_shape_is_a_clear_error(tiny_models, tmp_path, capsys, args, message):
    code = main(["bench", str(tiny_models["bert"]), "--out", str(tmp_path / "r"), *args])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()

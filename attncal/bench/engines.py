"""The engines `attncal bench` compares, each behind one small interface.

An engine is prepared once (models loaded, sessions created) and then runs
one batch of token ids per call.  Everything model-related is shared through
`Workspace`, which holds the source model and the exports the engines need,
built once per bench run.

The peers (`OWN_PROCESS`: OpenVINO and sentence-transformers on PyTorch) run in a process of their own
during the timed rounds (`make_engine(..., own_process=True)`): their thread pools (OpenVINO's, PyTorch's
OpenMP) would otherwise share the bench's process with ONNX Runtime's, and a pool that spins after its run
takes cores from the next engine's.  The rounds still alternate: each call sends the batch to the engine's
process and waits for it to finish, so its time includes one round trip through a pipe (the batch's token
ids out, a status back).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import traceback
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from ..artifact import (INLINED_GRAPH, ONNX_FILE, ONNX_SUBDIR, OPTIMIZED_FILE, PORTABLE_GRAPH, ArtifactError,
                        config_int, open_export, read_metadata, save_onnx_proto, write_metadata)
from ..calibration.config import CalibrationConfig
from ..exporting.plan import ExportOptions
from ..runtime import oplib
from ..runtime.encoder import Encoder, default_session_options
from ..pooling import Pooling
from ..runtime.landmarks import place

ENGINES = ("torch", "torch-cal", "torch-naive", "torch-sdpa", "torch-cal-sdpa", "ort", "ort-cal", "ort-opt",
           "ort-opt-cal", "ort-opt-split", "ort-opt-native", "ort-native", "ort-cal-lib", "ort-fused", "ort-fused-lib",
           "ort-split", "ort-row", "ort-int8", "ort-cal-int8", "ort-pooled", "ort-opt-pooled", "openvino",
           "openvino-cal")
# The peers that run in a process of their own during the timed rounds (module docstring):
#   openvino:     the uncalibrated export's portable graph (standard ONNX) in OpenVINO, compiled as
#                 sentence-transformers' OpenVINO backend compiles it (optimum-intel: PERFORMANCE_HINT LATENCY),
#                 with float32 inference (OpenVINO's default is bfloat16 on CPUs that have it) and `threads`
#                 inference threads; the optional `openvino` extra
#   openvino-cal: the calibrated export's inlined graph (`attncal export --inlined`, standard ONNX), the same way
#   torch-sdpa:   sentence-transformers on PyTorch as users run it: SentenceTransformer(model) with its default
#                 attention (SDPA), uncalibrated; where torch is installed (the export extra)
OWN_PROCESS = ("openvino", "openvino-cal", "torch-sdpa")
_OPENVINO_ENGINES = {"openvino": ("uncal", PORTABLE_GRAPH), "openvino-cal": ("inlined", INLINED_GRAPH)}

# engine -> (export directory, graph of that export, calibrated?, native library policy)
#   ort / ort-opt:   the uncalibrated export's portable / ORT-optimized graph
#   ort-cal(-lib):   softmax placement on the portable graph, function body (or the native library)
#   ort-fused(-lib): fused-softmax placement on the portable graph, function body (or the native library)
#   ort-opt-cal:     what `Encoder` runs by default on the CPU: the calibrated export's graph="auto" (with the
#                    native library built: onnx/model_optimized_native.onnx, the calibrated attention op; without
#                    it: the ORT-optimized graph with the bench's placement, auto: row for cls/last, split for mean)
#   ort-opt-split:   that export's onnx/model_optimized.onnx (split / row placement, no custom op) whatever is built
#   ort-opt-native:  that export's onnx/model_optimized_native.onnx with the native library (required)
#   ort-native:      the uncalibrated export's native graph with the native library (required): the calibrated
#                    attention op with calibration off in every layer
#   ort-split/-row:  split / row placement on the portable graph (standard ONNX)
#   ort-int8 / ort-cal-int8: `attncal export --quantize int8` of the uncalibrated / calibrated model, graph="auto"
#                    as `Encoder` runs it (compare with ort-opt / ort-opt-cal)
#   ort-pooled / ort-opt-pooled: the uncalibrated export with the workspace's landmark or Mean@k pooling
#                    (`--pooling lmk|multi-cls|mean-every`), portable / ORT-optimized graph; each batch of `seq` content
#                    tokens gets its landmarks inserted (`pooled_feeds`), so it runs the longer rows an export with
#                    that pooling runs, up to the export's max length, where landmarks replace content (compare
#                    with ort / ort-opt, the model's own pooling on the same content)
_ORT_ENGINES = {
    "ort": ("uncal", "portable", False),
    "ort-opt": ("uncal", "optimized", False),
    "ort-cal": ("cal", "portable", False),
    "ort-cal-lib": ("cal", "portable", True),
    "ort-fused": ("fused", "portable", False),
    "ort-fused-lib": ("fused", "portable", True),
    "ort-opt-cal": ("opt-cal", "auto", None),
    "ort-opt-split": ("opt-cal", "optimized", None),
    "ort-opt-native": ("opt-cal", "native", True),
    "ort-native": ("uncal", "native", True),
    "ort-split": ("split", "portable", None),
    "ort-row": ("row", "portable", None),
    "ort-int8": ("uncal-int8", "auto", None),
    "ort-cal-int8": ("opt-cal-int8", "auto", None),
    "ort-pooled": ("pooled", "portable", False),
    "ort-opt-pooled": ("pooled", "optimized", None),
}
# An ORT engine followed by a suffix of MEM_PATTERN: the same session with ONNX Runtime's memory pattern on
# (as ORT's default session options, and so a user's own InferenceSession, have it) or off, whatever the Encoder
# chooses for the export (runtime.encoder.default_session_options).
MEM_PATTERN = {"+mempattern": True, "+nomempattern": False}
# An ORT engine (with or without a MEM_PATTERN suffix) followed by TWIN: a second session of the same export and
# options, timed in the same rounds: an A/A control, whose ratio to the first is what two identical sessions
# differ by on this machine (where they sit in memory), the floor under any A/B ratio of the same run.
TWIN = "@2"
_EXPORTS = {  # export directory -> placement (None: uncalibrated; "bench": the workspace's placement)
    "uncal": None, "cal": "softmax", "fused": "fused-softmax", "opt-cal": "bench", "split": "split", "row": "row",
    "uncal-int8": None, "opt-cal-int8": "bench", "pooled": None, "inlined": "auto",
}
_INT8_EXPORTS = ("uncal-int8", "opt-cal-int8")
DEFAULT_ENGINES = ("torch", "torch-cal", "torch-naive", "ort", "ort-cal", "ort-opt", "ort-opt-cal", "ort-cal-lib",
                   "ort-fused-lib")
# Each model's peer, the uncalibrated graph users would otherwise deploy: ONNX Runtime's optimized graph where its
# optimizer fuses the model's attention (the BERT family), else the plain export.  The first of these that ran.
PEERS = ("ort-opt", "ort")


def peer_engine(ran: list[str]) -> str | None:
    """The peer among the engines that ran (`PEERS`), or None."""
    return next((e for e in PEERS if e in ran), None)


def is_engine(name: str) -> bool:
    """`name` is one of ENGINES, or an ORT engine followed by a suffix of MEM_PATTERN and/or TWIN."""
    return name in ENGINES or _is_ort_engine(name)


def _split(name: str) -> tuple[str, bool | None]:
    """(the engine without its TWIN and MEM_PATTERN suffixes, the memory pattern it asks for, or None)."""
    name = name.removesuffix(TWIN)
    for suffix, on in MEM_PATTERN.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix), on
    return name, None


def _ort_engine(name: str) -> tuple[str, str, bool | None]:
    """(export directory, graph, native library policy) of ORT engine `name`, with or without a suffix."""
    return _ORT_ENGINES[_split(name)[0]]


def _is_ort_engine(name: str) -> bool:
    return _split(name)[0] in _ORT_ENGINES


def _export_of(name: str) -> str | None:
    """The workspace export engine `name` runs (None for the PyTorch engines)."""
    if name in _OPENVINO_ENGINES:
        return _OPENVINO_ENGINES[name][0]
    return _ort_engine(name)[0] if _is_ort_engine(name) else None


class EngineUnavailable(RuntimeError):
    """The engine cannot run here (e.g. the native op library is not built); the bench notes and skips it."""


@dataclass
class Workspace:
    """The source model, the calibration config and the export directories of one bench run."""

    model: Path
    config: CalibrationConfig
    exports: Path
    threads: int
    placement: str = "auto"  # of ort-opt-cal
    pooled: Pooling | None = None  # the pooling of the ort-pooled engines (lmk, multi-cls or mean-every)

    def export_dir(self, name: str) -> Path:
        return self.exports / name

    def to_json(self) -> str:
        return json.dumps({"model": str(self.model), "config": self.config.to_dict(), "exports": str(self.exports),
                           "threads": self.threads, "placement": self.placement,
                           "pooled": self.pooled.to_json() if self.pooled is not None else None})

    @classmethod
    def from_json(cls, text: str) -> "Workspace":
        d = json.loads(text)
        return cls(Path(d["model"]), CalibrationConfig.from_dict(d["config"]), Path(d["exports"]), d["threads"],
                   d.get("placement", "auto"), Pooling.from_json(d["pooled"]) if d.get("pooled") else None)


def build_exports(ws: Workspace, engines: list[str], quiet: bool = True) -> dict[str, str]:
    """Create the exports the selected engines need (once; reused when present). Returns notes."""
    from ..exporting.exporter import export  # lazy: onnx_ir and sympy, not loaded at start-up

    notes: dict[str, str] = {}
    needed = {_ort_engine(e)[0] for e in engines if _is_ort_engine(e)} | \
             {_OPENVINO_ENGINES[e][0] for e in engines if e in _OPENVINO_ENGINES}
    for name in sorted(needed):
        if name == "pooled" and ws.pooled is None:
            notes.update({e: "needs --pooling lmk, multi-cls or mean-every" for e in engines
                          if _is_ort_engine(e) and _ort_engine(e)[0] == name})
            continue
        if _cached_export_ok(ws.export_dir(name), quiet):
            continue
        placement = _EXPORTS[name]
        if placement == "bench":
            placement = ws.placement
        # The default exporter, as users export (the exporter makes the TorchScript export ONNX Runtime's
        # optimizer needs itself; Gemma3's bidirectional masks do not trace with TorchScript).
        opts = ExportOptions(config=replace(ws.config, pooling=ws.pooled) if name == "pooled" else ws.config,
                             calibrate=placement is not None, check=False,
                             overwrite=True, placement=placement or "auto",
                             optimized=name in ("uncal", "opt-cal", "pooled", *_INT8_EXPORTS),
                             quantize="int8" if name in _INT8_EXPORTS else None,
                             inlined=name == "inlined")
        try:
            export(ws.model, ws.export_dir(name), opts, quiet=quiet)
        except ValueError as exc:  # e.g. row placement with mean pooling
            for e in engines:
                if _export_of(e) == name:
                    notes[e] = str(exc)
    for e in engines:
        if e in _OPENVINO_ENGINES and e not in notes and \
                not (ws.export_dir(_export_of(e)) / _OPENVINO_ENGINES[e][1]).exists():
            notes[e] = (f"no {INLINED_GRAPH}: the calibrated export's portable graph calls no ONNX function "
                        "(attncal-export.log says why)")
        if _is_ort_engine(e) and e not in notes:
            name, graph, _ = _ort_engine(e)
            if graph == "optimized" and not (ws.export_dir(name) / "onnx" / "model_optimized.onnx").exists():
                notes[e] = ("no ORT-optimized graph: ONNX Runtime's optimizer does not fuse this model's attention "
                            "(attncal.json: optimizer)")
            if graph == "native" and not (ws.export_dir(name) / "onnx" / "model_optimized_native.onnx").exists():
                notes[e] = ("no native graph (calibrated attention op): the export writes it for a calibrated "
                            "model with an ORT-optimized graph, and for a model without one where the op replaces "
                            "its attention (attncal-export.log says why not)")
    return notes


def export_code_fingerprint() -> str:
    """What a cached bench export depends on besides the model, the config and the placement: attncal's own
    code (every module's source: a checkout's next commit keeps the version string, and must not reuse the
    last commit's exports) and the versions of the libraries that export and rewrite it."""
    from ..exporting.exporter import library_versions  # lazy: the exporter, which attncal --help must not load

    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    versions = library_versions()
    try:
        versions["onnxscript"] = md.version("onnxscript")
    except md.PackageNotFoundError:
        pass
    h.update(json.dumps(versions, sort_keys=True).encode())
    return h.hexdigest()[:12]


def _cached_export_ok(path: Path, quiet: bool) -> bool:
    """Whether a cached bench export is there and intact; a damaged one is removed and rebuilt."""
    if not (path / "attncal.json").exists():
        return False
    try:
        open_export(path)
        return True
    except ArtifactError as exc:
        if not quiet:
            print(f"attncal: rebuilding the damaged cached export ({exc})", flush=True)
        shutil.rmtree(path, ignore_errors=True)
        return False


def optimize_export(src: Path, dest: Path) -> None:
    """ONNX Runtime's transformer optimizer (attention and layer-norm fusions) on an uncalibrated export."""
    from onnxruntime.transformers.optimizer import optimize_model

    meta = read_metadata(src)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    opt = optimize_model(str(src / ONNX_SUBDIR / ONNX_FILE), model_type="bert",
                         num_heads=config_int(src, "num_attention_heads"), hidden_size=config_int(src, "hidden_size"))
    save_onnx_proto(opt.model, tmp / ONNX_SUBDIR / ONNX_FILE)
    (tmp / ONNX_SUBDIR / OPTIMIZED_FILE).unlink(missing_ok=True)  # model.onnx is now the optimized graph
    meta.pop("graphs", None)
    meta["optimized"] = "onnxruntime.transformers.optimizer (model_type=bert)"
    write_metadata(tmp, meta)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)


def make_engine(name: str, ws: Workspace, *, own_process: bool = False
                ) -> Callable[[dict[str, np.ndarray]], object]:
    """A callable running one batch (numpy int64 feeds) on engine `name`; with `own_process`, an engine of
    `OWN_PROCESS` runs in a process of its own (`OwnProcessEngine`), the others here."""
    if own_process and name in OWN_PROCESS:
        return OwnProcessEngine(name, ws)
    if name in _OPENVINO_ENGINES:
        return _openvino_engine(name, ws)
    if name == "torch-sdpa":
        return _sentence_transformers_engine(ws)
    if name.startswith("torch"):
        import torch

        from ..calibration.encode import TorchEncoder  # lazy: torch (the export extra), not needed by ORT engines

        torch.set_num_threads(ws.threads)
        sdpa = name.endswith("sdpa")  # torch-cal-sdpa: SDPA attention, split calibration
        enc = TorchEncoder(ws.model, attn_implementation="sdpa" if sdpa else "eager")
        config = None if name == "torch" else ws.config
        impl = {"torch-naive": "naive", "torch-cal-sdpa": "split"}.get(name, "efficient")
        names = set(enc.tokenizer.model_input_names)

        def run_torch(feeds: dict[str, np.ndarray]):
            batch = {k: torch.from_numpy(v) for k, v in feeds.items() if k in names}
            return enc.forward(batch, config, implementation=impl)

        return run_torch
    export_name, graph, native = _ort_engine(name)
    if native:
        if oplib.default_library_path() is None:
            raise EngineUnavailable("the native op library is not installed (pip install . or make plugins)")
    path = ws.export_dir(export_name)
    if not (path / "attncal.json").exists():
        raise EngineUnavailable(f"no export for {name} at {path}")
    so = interleaved_session_options(path)
    pattern = _split(name)[1]
    if pattern is not None:
        so.enable_mem_pattern = pattern
    enc = Encoder(path, providers=["CPUExecutionProvider"], native=native, graph=graph, intra_op_threads=ws.threads,
                  session_options=so)
    inserted: dict[int, tuple] = {}  # a shape's feeds -> (those feeds, with landmarks): made once per shape

    def run_ort(feeds: dict[str, np.ndarray]):
        if enc.pooling.row_set:
            if id(feeds) not in inserted:
                inserted[id(feeds)] = (feeds, pooled_feeds(feeds, enc.pooling, enc.max_length))
            feeds = inserted[id(feeds)][1]
        return enc.run({k: v for k, v in feeds.items() if k in enc.input_names})

    run_ort.encoder = enc  # type: ignore[attr-defined]  # for tests and inspection
    return run_ort


def _openvino_engine(name: str, ws: Workspace) -> Callable[[dict[str, np.ndarray]], object]:
    """Engine `openvino` / `openvino-cal` (`OWN_PROCESS`): the export's standard-ONNX graph in OpenVINO."""
    try:
        import openvino as ov  # lazy: the optional openvino extra
    except ImportError:
        raise EngineUnavailable("openvino is not installed (pip install 'attncal[openvino]')") from None
    export_name, graph = _OPENVINO_ENGINES[name]
    path = ws.export_dir(export_name)
    if not (path / graph).exists():
        raise EngineUnavailable(f"no {graph} in the export at {path}")
    open_export(path, graphs=graph)  # the graph's digest and external data checked before OpenVINO reads it
    core = ov.Core()
    compiled = core.compile_model(core.read_model(str(path / graph)), "CPU", {
        "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": ws.threads, "INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    names = {p.get_any_name() for p in compiled.inputs}

    def run_openvino(feeds: dict[str, np.ndarray]):
        return request.infer({k: v for k, v in feeds.items() if k in names})

    run_openvino.compiled = compiled  # type: ignore[attr-defined]  # for tests and inspection
    return run_openvino


def _sentence_transformers_engine(ws: Workspace) -> Callable[[dict[str, np.ndarray]], object]:
    """Engine `torch-sdpa` (`OWN_PROCESS`): sentence-transformers on PyTorch with its defaults (SDPA attention)."""
    import torch
    from sentence_transformers import SentenceTransformer  # lazy: the export extra, not needed by the ORT engines

    torch.set_num_threads(ws.threads)
    model = SentenceTransformer(str(ws.model), device="cpu")
    names = set(model.tokenizer.model_input_names)

    def run_sentence_transformers(feeds: dict[str, np.ndarray]):
        with torch.inference_mode():
            out = model.forward({k: torch.from_numpy(v) for k, v in feeds.items() if k in names})
        return out["sentence_embedding"]

    run_sentence_transformers.model = model  # type: ignore[attr-defined]  # for tests and inspection
    return run_sentence_transformers


class OwnProcessEngine:
    """Engine `name` in a process of its own (module docstring): a fresh interpreter (`python -m
    attncal.bench.engines`, so no thread pool of this process is copied and no main script is imported again)
    builds it with `make_engine`; each call sends the batch over a pipe and returns once that process has run
    it.  The process ends with this object (or `close`)."""

    def __init__(self, name: str, ws: Workspace) -> None:
        self.name = name
        self._conn, child = multiprocessing.Pipe()
        self._proc = subprocess.Popen([sys.executable, "-m", "attncal.bench.engines", "--serve", str(child.fileno()),
                                       name, ws.to_json()], pass_fds=(child.fileno(),))
        child.close()
        self._closer = weakref.finalize(self, _stop_engine, self._conn, self._proc)
        kind, detail = self._receive()
        if kind != "ready":
            self.close()
            raise (EngineUnavailable if kind == "unavailable" else RuntimeError)(detail)

    def _receive(self) -> tuple[str, object]:
        try:
            return self._conn.recv()
        except EOFError:
            code = self._proc.wait()
            raise RuntimeError(f"engine {self.name}: its process ended (exit code {code})") from None

    def __call__(self, feeds: dict[str, np.ndarray]) -> None:
        self._conn.send(feeds)
        kind, detail = self._receive()
        if kind != "ok":
            raise RuntimeError(f"engine {self.name} failed in its process:\n{detail}")

    @property
    def pid(self) -> int:
        return self._proc.pid

    def close(self) -> None:
        self._closer()


def _serve_engine(conn, name: str, ws_json: str) -> None:
    """The body of an `OwnProcessEngine`'s process: build the engine, then run each batch received until None."""
    ws = Workspace.from_json(ws_json)
    try:
        run = make_engine(name, ws)
    except EngineUnavailable as exc:
        conn.send(("unavailable", str(exc)))
        return
    except Exception:  # noqa: BLE001 - reported to the bench's process, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            feeds = conn.recv()
        except EOFError:
            return
        if feeds is None:
            return
        try:
            run(feeds)
            conn.send(("ok", None))
        except Exception:  # noqa: BLE001 - reported to the bench's process, which raises it
            conn.send(("error", traceback.format_exc()))


def _stop_engine(conn, proc) -> None:
    """End an `OwnProcessEngine`'s process: asked first, then terminated if it does not end."""
    try:
        conn.send(None)
    except (OSError, ValueError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.wait()
    conn.close()


def interleaved_session_options(export: Path) -> "onnxruntime.SessionOptions":  # noqa: F821 (imported lazily)
    """The Encoder's default session options for `export` (an export directory), except that worker threads stop
    spinning as soon as a run returns.

    The engines' sessions run interleaved in one process. With ORT's default, a session's idle workers go on
    spinning after its run and take cores from the next engine's run: at 1 x 70 tokens `ort-opt` read 13.2 ms
    p50 here (7.3 ms with this option; 8.2-8.8 ms in a session of its own). `session.force_spinning_stop`
    keeps spinning within a run (what a user's session does) and stops it between runs, so each engine gets
    the cores it would get on its own.
    """
    so = default_session_options(read_metadata(export).get("max_seq_length"))
    so.add_session_config_entry("session.force_spinning_stop", "1")
    return so


def pooled_feeds(feeds: dict[str, np.ndarray], pooling: Pooling, max_length: int | None = None
                 ) -> dict[str, np.ndarray]:
    """`make_feeds`' rows (content tokens, all valid) with the landmarks of `pooling` inserted where an export with
    that pooling places them (`attncal.runtime.landmarks.place`; Mean@k inserts none), within `max_length` as
    the export's tokenizer keeps them: at the max length the landmarks take the place of content."""
    other = 11 if pooling.token_id == 10 else 10  # content never holds the landmark: rows keep one length
    rows = [place([other if x == pooling.token_id else x for x in row], [0] * len(row), None, pooling,
                  max_length=max_length)[0] for row in feeds["input_ids"].tolist()]
    ids = np.array(rows, dtype=np.int64).reshape(len(rows), -1)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


def make_feeds(batch: int, seq: int, vocab: int = 100, seed: int = 0) -> dict[str, np.ndarray]:
    """Token ids of exactly `seq` valid tokens per item (special ids avoided), as numpy int64."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(10, max(11, vocab), size=(batch, seq), dtype=np.int64)
    return {
        "input_ids": ids,
        "attention_mask": np.ones((batch, seq), dtype=np.int64),
        "token_type_ids": np.zeros((batch, seq), dtype=np.int64),
    }


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--serve":  # an OwnProcessEngine's process
    from multiprocessing.connection import Connection

    os.environ["OMP_NUM_THREADS"] = str(Workspace.from_json(sys.argv[4]).threads)  # before PyTorch is imported
    _serve_engine(Connection(int(sys.argv[2])), sys.argv[3], sys.argv[4])

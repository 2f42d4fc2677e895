"""`Encoder`: encode texts with an exported (calibrated or not) ONNX model in ONNX Runtime."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from .. import cpuinfo
from ..artifact import (
    INLINED_GRAPH,
    NATIVE_GRAPH,
    ONNX_FILE,
    ONNX_SUBDIR,
    OPTIMIZED_GRAPH,
    ArtifactError,
    ExportDir,
    MissingArtifactError,
    check_model_files,
    config_int,
    is_long_context,
    pooling_of,
    read_metadata,
)
from ..messages import first_line
from ..modelinfo import UnsupportedModelError, choose_prompt, read_prompts
from ..versions import without_torch_advice
from . import oplib, precision as _precision
from .chunking import CHUNK_SPANS, CHUNK_VECTORS, Chunker, ChunkedEmbeddings, ChunkOptions
from .tokenizer import TransformersTokenizer, load_tokenizer

GRAPHS = ("auto", "portable", "optimized", "native", "inlined")
_ORT_NATIVE_PROVIDERS = ("CPUExecutionProvider", "CUDAExecutionProvider")
# `attncal encode`'s token budget per batch (`length_batches`): 32 texts of 512 tokens, so no batch of a model of
# up to 512 tokens holds more than the count batching of 32 texts held at its worst, and short texts go in
# larger batches.
DEFAULT_MAX_BATCH_TOKENS = 32 * 512

load_metadata = read_metadata  # the validated attncal.json (ArtifactError when missing or damaged)


def default_providers() -> list[str]:
    import onnxruntime as ort

    available = ort.get_available_providers()
    preferred = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    return [p for p in preferred if p in available]


def default_session_options(max_seq_length: int | None = None) -> "onnxruntime.SessionOptions":  # noqa: F821
    """The ONNX Runtime session options an `Encoder` gets when none are given: ORT's defaults, with its C++
    warnings shown only with --verbose, and ORT's memory pattern only where `max_seq_length` (the export's)
    is not a long context (`attncal.artifact.is_long_context`).

    The memory pattern records a run's allocations and, from the next run with the same input shapes on,
    serves them from one block planned for the whole graph.  That block comes from the arena beside the
    blocks the first run left there, so a batch shape's working memory is held about twice.  At long
    context that is hundreds of MiB to GiBs, and the pattern buys no speed there; on short batches it is
    tens of MiB and the pattern is a few per cent faster (docs/performance.md, "Session options").  An
    export without a max length may be fed long texts, so it goes without."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.enable_mem_pattern = memory_pattern(max_seq_length)
    return so


def memory_pattern(max_seq_length: int | None) -> bool:
    """Whether sessions of an export of `max_seq_length` tokens run with ORT's memory pattern
    (`default_session_options`)."""
    return not is_long_context(max_seq_length)


def native_graph_runs(library: Path | None, providers: Sequence[str]) -> bool:
    """Whether the native graph (calibrated attention op) runs at its speed here: the attncal library is
    loaded and the first provider is ONNX Runtime's CPU one, where the op has its kernel.  (The CUDA
    kernel of the op has never run on a GPU; until it has, CUDA sessions run the ORT-optimized graph, split or
    row placement.)"""
    return library is not None and bool(providers) and providers[0] == "CPUExecutionProvider"


def select_graph(out_dir: Path, meta: dict, graph: str, providers: Sequence[str],
                 library: Path | None = None) -> str:
    """Which graph of an export to run: `onnx/model.onnx` (portable), `onnx/model_optimized.onnx` or
    `onnx/model_optimized_native.onnx` (the calibrated attention op).

    `auto` takes the native graph when the export has one and it runs at its speed here
    (`native_graph_runs`: `library` is the attncal library to load), else the ORT-optimized graph when
    the export has one and the first provider runs ONNX Runtime's contrib ops natively (CPU, CUDA);
    TensorRT gets the portable graph.  So without the library nothing is slower than the split graph."""
    if graph not in GRAPHS:
        raise ValueError(f"graph must be one of {', '.join(GRAPHS)}, got {graph!r}")
    listed = meta.get("graphs") or {}
    for rel in (OPTIMIZED_GRAPH, NATIVE_GRAPH):
        if not (out_dir / rel).exists() and rel in listed:
            raise MissingArtifactError(out_dir / rel, "missing, but attncal.json lists it; re-export the model")
    has_opt, has_native = (out_dir / OPTIMIZED_GRAPH).exists(), (out_dir / NATIVE_GRAPH).exists()
    if graph == "native":
        if not has_native:
            raise MissingArtifactError(out_dir / NATIVE_GRAPH, "missing (an export with --placement auto writes it, "
                                                               "calibrated or not: for the BERT family beside the "
                                                               "ORT-optimized graph, without --no-optimized; for "
                                                               "other models where the attention op replaces theirs)")
        return NATIVE_GRAPH
    if graph == "inlined":
        if not (out_dir / INLINED_GRAPH).exists():
            raise MissingArtifactError(out_dir / INLINED_GRAPH, "missing (a calibrated export with --inlined writes "
                                                                "it; without functions, onnx/model.onnx is standard "
                                                                "ONNX already)")
        return INLINED_GRAPH
    if graph == "optimized":
        if not has_opt:
            raise MissingArtifactError(out_dir / OPTIMIZED_GRAPH, "missing (export without --no-optimized, on a "
                                                                  "BERT-family model)")
        return OPTIMIZED_GRAPH
    if graph == "auto" and has_native and native_graph_runs(library, providers):
        return NATIVE_GRAPH
    if graph == "auto" and has_opt and providers and providers[0] in _ORT_NATIVE_PROVIDERS:
        return OPTIMIZED_GRAPH
    return f"{ONNX_SUBDIR}/{ONNX_FILE}"


def planned_graph(out_dir: str | os.PathLike, providers: Sequence[str] | None = None, graph: str = "auto",
                  native: bool | None = None) -> str:
    """The graph `Encoder(out_dir, providers, graph=graph, native=native)` would run, without loading
    it: for reports (`attncal encode`, `attncal triton-repo`) made where the sessions are not."""
    out = Path(out_dir)
    meta = read_metadata(out)
    providers = list(providers or default_providers())
    lib = None
    if NATIVE_GRAPH in (meta.get("graphs") or {}) and graph in ("auto", "native"):
        lib = oplib.resolve_library(native, notice=False)
    return select_graph(out, meta, graph, providers, lib)


def needs_right_padding(meta: dict, graph_file: str) -> bool:
    """Whether a graph keeps ONNX Runtime's fused attention, which takes key lengths (so a token after
    padding would be dropped): the optimized graph, and the native graph made from it.  The native graph
    of a plain export (`any_padding` in its entry) masks every key and takes either padding side."""
    if graph_file not in (OPTIMIZED_GRAPH, NATIVE_GRAPH):
        return False
    return not ((meta.get("graphs") or {}).get(graph_file) or {}).get("any_padding", False)


def graph_has_custom_op(meta: dict, graph_file: str) -> bool:
    """Whether a graph of the export contains ai.attncal ops (every placement but split does, unless inlined)."""
    graphs = meta.get("graphs")
    if isinstance(graphs, dict) and graph_file in graphs:
        entry = graphs[graph_file]
        return entry.get("placement") not in (None, "split") and not entry.get("inlined")
    return bool(meta.get("op_type"))


class Encoder:
    """Tokenizes like the source model, batches by length and runs the ONNX session.

    `providers` defaults to TensorRT/CUDA when the installed onnxruntime offers
    them, else CPU.  `graph="auto"` runs the export's ORT-optimized graph
    (`onnx/model_optimized.onnx`, fused attention) when it has one and the provider
    is CPU or CUDA, else the portable `onnx/model.onnx`; with the native library loaded on the CPU it
    runs `onnx/model_optimized_native.onnx` (calibrated attention op) instead.  When the graph contains
    attncal ops, the native kernel library (plugins/) is registered if it is built
    (`native=None`, the default; `$ATTNCAL_NATIVE=0` or `native=False` turns it off,
    `native=True` requires it); `custom_op_library` names a library explicitly.
    An int8 graph on a CPU class its parity figures do not cover gets an `attncal.cpuinfo.Int8CpuWarning`.
    An export with landmark pooling places its landmarks as it tokenizes (`attncal.runtime.landmarks`).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        providers: Sequence[str] | None = None,
        *,
        custom_op_library: str | os.PathLike | None = None,
        native: bool | None = None,
        graph: str = "auto",
        intra_op_threads: int | None = None,
        session_options=None,
    ) -> None:
        import onnxruntime as ort

        without_torch_advice()

        self.path = Path(out_dir)
        self.meta = read_metadata(self.path)
        check_model_files(self.path, self.meta)
        providers = list(providers or default_providers())
        lib: Path | None = None
        if custom_op_library is not None:
            lib = Path(custom_op_library)
            if not lib.exists():
                raise FileNotFoundError(f"custom-op library {lib} not found")
        elif NATIVE_GRAPH in (self.meta.get("graphs") or {}) and graph in ("auto", "native"):
            # Decides between the native and the split graph; no notice: without the library the split
            # graph runs, not a function body.
            lib = oplib.resolve_library(native, notice=False)
        self.graph_file = select_graph(self.path, self.meta, graph, providers, lib)
        if custom_op_library is None and lib is None and graph_has_custom_op(self.meta, self.graph_file):
            lib = oplib.resolve_library(native)
        elif lib is not None and custom_op_library is None and not graph_has_custom_op(self.meta, self.graph_file):
            lib = None  # the graph has no attncal op: nothing to register
        model_file = self.path / self.graph_file
        ExportDir(self.path, self.meta).check_graph(self.graph_file)  # damaged graph -> ArtifactError
        self._max_length = self.meta.get("max_seq_length")
        self._hf_tokenizer = None
        self.pooling = pooling_of(self.meta)
        try:
            self._tokenizer = load_tokenizer(self.path, self.meta.get("tokenizer"), self._max_length,
                                             self.meta.get("padding_side", "right"), self.pooling)
        except Exception as exc:  # a damaged tokenizer file fails deep inside tokenizers/transformers
            raise ArtifactError(self.path / "tokenizer.json", "the tokenizer cannot be loaded "
                                f"({type(exc).__name__}: {first_line(exc)[:300]})") from None

        try:
            self.prompts, self.default_prompt_name = read_prompts(self.path)
        except UnsupportedModelError as exc:
            raise ArtifactError(self.path / "config_sentence_transformers.json", str(exc)) from None
        so = session_options if session_options is not None else default_session_options(self._max_length)
        if session_options is None and self.meta.get("chunk_vectors"):
            # The chunk spans' default is an initializer listed as an input, which ONNX Runtime warns about at
            # every load (it is meant: the input is optional); its other warnings at load go with it.
            so.log_severity_level = 3
        if intra_op_threads is not None:
            so.intra_op_num_threads = intra_op_threads
        if lib is not None:
            so.register_custom_ops_library(str(lib))
        self.custom_op_library = lib
        try:
            self.session = ort.InferenceSession(str(model_file), so, providers=providers)
        except Exception as exc:
            if not type(exc).__module__.startswith("onnxruntime"):
                raise
            raise ArtifactError(model_file, f"ONNX Runtime cannot load it ({first_line(exc)[:300]})") from None
        if (self.meta.get("quantization") or {}).get("precision") == "int8":  # figures hold where its graph says
            cpuinfo.warn_if_uncovered(cpuinfo.int8_record(self.session.get_modelmeta().custom_metadata_map),
                                      str(model_file))
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe to call concurrently
        self.input_names = [i.name for i in self.session.get_inputs()]
        self._chunker: Chunker | None = None  # made on the first encode_chunks

    @property
    def max_length(self) -> int | None:
        """Texts are truncated to this many tokens (the export's max_seq_length unless set)."""
        return self._max_length

    @max_length.setter
    def max_length(self, value: int | None) -> None:
        with self._tokenizer_lock:
            self._max_length = value
            self._tokenizer.set_max_length(value)

    @property
    def padding_side(self) -> str:
        """Which side `tokenize` pads ("right", or "left"; the export's padding_side unless set)."""
        return self._tokenizer.padding_side

    @padding_side.setter
    def padding_side(self, side: str) -> None:
        if side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}")
        with self._tokenizer_lock:
            self._tokenizer.padding_side = side
            if self._hf_tokenizer is not None:
                self._hf_tokenizer.padding_side = side

    @property
    def tokenizer(self):
        """transformers' tokenizer of the export, loaded on first use, for its API (chunkers and evaluations
        need it; `tokenize` and `encode` do not, see attncal.runtime.tokenizer).  Set `max_length` and
        `padding_side` on the Encoder: they are what `tokenize` and `encode` use.  It places no landmarks
        (`tokenize` does)."""
        if self._hf_tokenizer is None:
            tok = getattr(self._tokenizer, "base", self._tokenizer)
            self._hf_tokenizer = (tok if isinstance(tok, TransformersTokenizer) else TransformersTokenizer(
                self.path, self._max_length, self.padding_side)).hf
        return self._hf_tokenizer

    def token_lengths(self, texts: Sequence[str]) -> list[int]:
        """Each text's number of tokens after truncation, special tokens included."""
        with self._tokenizer_lock:
            return self._tokenizer.token_lengths(texts)

    @property
    def dimension(self) -> int:
        dim = self.session.get_outputs()[1].shape[-1]
        if isinstance(dim, int):
            return dim
        return config_int(self.path, "hidden_size")

    def tokenize(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        with self._tokenizer_lock:
            batch = self._tokenizer(texts)
        return {n: batch[n] for n in self.input_names}

    def run(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Raw session call: (last_hidden_state, sentence_embedding)."""
        self._check_padding(feeds)
        hidden, emb = self.session.run(["last_hidden_state", "sentence_embedding"], feeds)
        return hidden, emb

    def _check_padding(self, feeds: dict[str, np.ndarray]) -> None:
        if needs_right_padding(self.meta, self.graph_file) and "attention_mask" in feeds:
            m = feeds["attention_mask"] != 0
            # ORT's fused attention takes key lengths: a token after a pad would be silently dropped.
            if m.shape[1] > 1 and bool((~m[:, :-1] & m[:, 1:]).any()):
                raise ValueError(f"{self.graph_file} needs right padding (its fused attention takes key lengths); "
                                 "this batch has tokens after padding. Use graph='portable' for left padding")

    @property
    def has_chunk_vectors(self) -> bool:
        """Whether the graph returns chunk vectors (an export made with --chunk-vectors)."""
        return any(o.name == CHUNK_VECTORS for o in self.session.get_outputs())

    def run_chunks(self, feeds: dict[str, np.ndarray], spans: np.ndarray) -> np.ndarray:
        """Raw session call of an export with chunk vectors: float32 [batch, chunks, D], the vector of each
        chunk span of `spans` (int64 [batch, chunks, 2], token positions [start, end) in the padded row;
        attncal.exporting.chunk_vectors)."""
        self._check_padding(feeds)
        (vectors,) = self.session.run([CHUNK_VECTORS], {**feeds, CHUNK_SPANS: spans})
        return vectors

    def encode(
        self,
        texts: Sequence[str],
        batch_size: int = 32,
        show_progress: bool = False,
        sort_by_length: bool = True,
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
        max_batch_tokens: int | None = None,
        dimensions: int | None = None,
        precision: str = "float32",
        ranges=None,
    ) -> np.ndarray:
        """`sentence_embedding` of every text, float32 [N, D], in input order ([0, D] for no text).

        `prompt_name` / `prompt` put a prompt before every text as sentence-transformers does (EmbeddingGemma's
        "query" / "document"); without them the model's default prompt applies, if it has one.
        `max_batch_tokens` bounds each batch's padded tokens (texts x its longest), so its working memory, as
        well as its count (`batch_size`): see `length_batches`.
        `dimensions`, `precision` and `ranges` are `output`'s (Matryoshka truncation, int8 / binary ...).
        Safe to call from several threads at once: tokenizer calls are serialised, ONNX Runtime
        sessions run concurrently."""
        texts = check_texts(texts)
        self.check_output(dimensions, precision, ranges)

        text_prompt = choose_prompt(self.prompts, self.default_prompt_name, prompt_name, prompt)
        if text_prompt:
            texts = [text_prompt + t for t in texts]
        from tqdm.auto import tqdm

        lengths = self.token_lengths(texts) if texts and (sort_by_length or max_batch_tokens is not None) else None
        batches = length_batches(lengths if lengths is not None else [0] * len(texts), batch_size, max_batch_tokens,
                                 sort_by_length)
        out = np.zeros((len(texts), self.dimension), dtype=np.float32)
        for idx in tqdm(batches, desc="encode (onnx)", disable=not show_progress, unit="batch"):
            _, emb = self.run(self.tokenize([texts[j] for j in idx]))
            out[idx] = emb
        return self.output(out, dimensions, precision, ranges)

    def encode_chunks(
        self,
        texts: Sequence[str],
        chunks: str | ChunkOptions = "late",
        *,
        size: int | None = None,
        by: str = "tokens",
        overlap: int = 0,
        batch_size: int = 32,
        prompt_name: str | None = None,
        prompt: str | None = None,
        dimensions: int | None = None,
        precision: str = "float32",
        ranges=None,
        errors: list | None = None,
        in_graph: bool | None = None,
        served=None,
    ) -> ChunkedEmbeddings:
        """Several vectors per text, one per chunk, with its character span and window
        (`attncal.runtime.chunking`: naive, late or landmark chunking; `chunks` a method name with `size`, `by`,
        `overlap`, or a `ChunkOptions`).  Nothing is cut: a text longer than the max length is covered by
        several windows.  `dimensions`, `precision` and `ranges` are `output`'s, applied to every chunk vector.
        A text that cannot be chunked (empty, only special tokens, a landmark chunk longer than a window) raises
        a one-line ValueError naming it, or, with a list as `errors`, is left out and listed there as
        (index, message).  Late and landmark vectors come from the graph's chunk-vector output where the export
        has one (`attncal export --chunk-vectors`; `in_graph=False` takes them from its token states instead,
        `in_graph=True` requires it), the same vectors to float32 rounding.  `served`: a served copy of this
        export (`attncal.runtime.chunking.Served`, e.g. a Triton server's) runs the model calls instead of this
        Encoder's session, with the same windows and batches."""
        texts = check_texts(texts)
        options = chunks if isinstance(chunks, ChunkOptions) else ChunkOptions(chunks, size, by, overlap)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        self.check_output(dimensions, precision, ranges)
        text_prompt = choose_prompt(self.prompts, self.default_prompt_name, prompt_name, prompt)
        if self._chunker is None:
            with self._tokenizer_lock:
                self._chunker = Chunker(self)
        out = self._chunker.run(texts, options, batch_size, text_prompt, errors, in_graph, served)
        out.vectors = self.output(out.vectors, dimensions, precision, ranges)
        return out

    @property
    def normalize(self) -> bool:
        """Whether the model normalises its embeddings (attncal.json's `normalize`)."""
        return bool(self.meta.get("normalize"))

    def check_output(self, dimensions: int | None = None, precision: str = "float32", ranges=None) -> int:
        """The width of the output `output` gives for these arguments; ValueError (one line) for a precision
        that is not one of `attncal.runtime.precision.PRECISIONS`, `dimensions` above the embedding width,
        below 1 or not among the Matryoshka dimensions the model declares, int8 / uint8 without ranges or with
        ranges of another width."""
        _precision.check_precision(precision)
        width = _precision.check_dimensions(dimensions, self.dimension,
                                            _precision.declared_dimensions(self.path)) or self.dimension
        if precision in _precision.SCALAR:
            _precision.check_ranges(ranges, width, precision)
        return width

    def output(self, emb: np.ndarray, dimensions: int | None = None, precision: str = "float32",
               ranges=None) -> np.ndarray:
        """Embeddings as an index stores them: cut to their first `dimensions` (then normalised again where
        the model normalises), in `precision` (sentence-transformers' `quantize_embeddings` meaning; int8 /
        uint8 take `ranges` [2, dimensions] from `quantization_ranges`).  See attncal.runtime.precision."""
        self.check_output(dimensions, precision, ranges)
        return _precision.quantize(_precision.truncate(emb, dimensions, self.normalize), precision, ranges)

    def quantization_ranges(self, texts: Sequence[str], *, dimensions: int | None = None,
                            sample: int = _precision.RANGE_SAMPLE, seed: int = _precision.RANGE_SEED,
                            batch_size: int = 32, prompt_name: str | None = None,
                            prompt: str | None = None) -> np.ndarray:
        """int8 / uint8 ranges, float32 [2, dimensions]: the per-dimension minimum and maximum of the
        embeddings of `sample` texts drawn from `texts` with `seed` (all of them when there are fewer).
        Compute them once per index and pass them to `encode(..., ranges=)` for its documents and queries."""
        texts = check_texts(texts)
        if not texts:
            raise ValueError("quantization ranges need at least one text")
        picked = [texts[i] for i in _precision.sample_rows(len(texts), sample, seed)]
        emb = self.encode(picked, batch_size, prompt_name=prompt_name, prompt=prompt, dimensions=dimensions)
        return _precision.ranges_of(emb)


def length_batches(lengths: Sequence[int], batch_size: int = 32, max_batch_tokens: int | None = None,
                   sort_by_length: bool = True) -> list[np.ndarray]:
    """The batches `Encoder.encode` runs, as index arrays into `lengths` (each text's tokens): longest first
    when `sort_by_length` (stable among equal lengths), else in input order.

    A batch holds at most `batch_size` texts and, with `max_batch_tokens`, at most as many as keep its padded
    size (texts x its longest text) within that budget, so a batch's activations are bounded by the budget
    rather than by the count times the longest text: long texts go a few at a time and short ones many at
    a time.  A text longer than the budget runs alone (its own length bounds it)."""
    for name, value in (("batch_size", batch_size), ("max_batch_tokens", max_batch_tokens)):
        if (value is not None or name == "batch_size") and (
                isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    order = np.argsort(lengths, kind="stable")[::-1] if sort_by_length else np.arange(len(lengths))
    batches, start, longest = [], 0, 0
    for k, i in enumerate(order):
        n = int(lengths[i])
        grown = max(longest, n)
        if k > start and (k - start >= batch_size or (max_batch_tokens is not None
                                                      and (k - start + 1) * grown > max_batch_tokens)):
            batches.append(order[start:k])
            start, grown = k, n
        longest = grown
    if start < len(order):
        batches.append(order[start:])
    return batches


def check_texts(texts) -> list[str]:
    """`texts` as a list of str, or a TypeError naming what is wrong (None, a bare string or
    bytes, an item that is not a string)."""
    if texts is None:
        raise TypeError("texts must be a list of strings, got None")
    if isinstance(texts, (str, bytes, bytearray)):
        raise TypeError(f"texts must be a list of strings, not a single {type(texts).__name__}; wrap it in a list")
    try:
        items = list(texts)
    except TypeError:
        raise TypeError(f"texts must be a list of strings, got {type(texts).__name__}") from None
    for i, t in enumerate(items):
        if not isinstance(t, str):
            hint = "; decode bytes to str first (UTF-8)" if isinstance(t, (bytes, bytearray)) else ""
            raise TypeError(f"texts[{i}] is {type(t).__name__}, not str{hint}")
    return items

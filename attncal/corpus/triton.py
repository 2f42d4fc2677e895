"""The `triton` engine: batches of texts sent to a served attncal model (`attncal triton-repo`).

The served ensemble tokenizes, so the client sends UTF-8 text (input `text`,
BYTES [n, 1]) and reads `sentence_embedding`.  A window is sorted by character
length (a cheap proxy for token length; the server pads per request) and cut
into requests of `batch_size` texts, which `concurrency` client threads send
at once, each with its own gRPC client.  Transient failures (server
unavailable, deadline exceeded, overloaded queue, dropped connection) are
retried with exponential backoff; anything else, or a transient failure that
persists through every retry, stops the run with one line naming the model,
the URL and the last error.  Token counts are not known on the client side
(the server tokenizes) and are reported as absent.

Matryoshka dimensions are the server's: each request carries the parameter
`dimensions` (the ensemble forwards it to the encoder model), and the server
returns the truncated, renormalised vectors (attncal.serving).

Chunks: naive chunk texts are ordinary texts, sent to the ensemble as above.
Late and landmark chunks need an export with chunk vectors (`attncal export
--chunk-vectors`) served by `attncal triton-repo`: the client tokenizes and
windows each text as `Encoder.encode_chunks` does, with the local copy of the
export, and sends each batch of windows -- token ids and chunk spans, padded as
the Encoder pads them -- as one request to NAME-encoder, which runs it as one
session call and returns one vector per chunk (never the token states).  So the
chunk rows are the local Encoder's, bit for bit, where the server runs the same
graph with the same ONNX Runtime.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

import numpy as np

from ..runtime.chunking import CHUNK_SPANS, CHUNK_VECTORS, ChunkError, ChunkOptions
from ..serving.repository import model_names
from .local import load_encoder, row_error

TRANSIENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "Socket closed",
             "Connection reset", "failed to connect", "Broken pipe")


class TritonEngineError(RuntimeError):
    """The server failed persistently (or the model is not served); one line says which and why."""


def is_transient(exc: Exception) -> bool:
    status = exc.status() if callable(getattr(exc, "status", None)) else ""
    text = f"{status} {exc}"
    return any(t.lower() in text.lower() for t in TRANSIENT)


class TritonEngine:
    name = "triton"

    def __init__(self, url: str, model: str, *, batch_size: int, concurrency: int = 4, retries: int = 5,
                 backoff_s: float = 0.5, timeout_s: float = 120.0, dimensions: int | None = None,
                 chunks: dict | None = None, export_dir: str | None = None, providers=None) -> None:
        """`dimensions`: the server truncates to them; `chunks`: the run's chunk options (with `skip`), chunked with
        the local copy of the export at `export_dir` (see the module docstring)."""
        self.url, self.model, self.batch_size, self.concurrency = url, model, batch_size, concurrency
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s
        self.dimensions, self.chunks, self.export_dir, self.providers = dimensions, chunks, export_dir, providers
        self.encoder_model = model_names(model)["encoder"]
        self._local = threading.local()
        self._clients: list = []

    def describe(self) -> dict:
        out = {"name": self.name, "url": self.url, "model": self.model, "concurrency": self.concurrency,
               "retries": self.retries}
        if self._in_graph:
            out["chunk_model"] = self.encoder_model
        return out

    @property
    def _in_graph(self) -> bool:
        return bool(self.chunks) and self.chunks["method"] != "naive"

    def _client(self):
        import tritonclient.grpc as grpcclient

        c = getattr(self._local, "client", None)
        if c is None:
            c = self._local.client = grpcclient.InferenceServerClient(self.url)
            self._clients.append(c)
        return c

    def check(self, dimension: int) -> None:
        """Fail early, in one line, when the server or the model is not there or has another dimension."""
        try:
            ready = self._client().is_model_ready(self.model)
        except Exception as exc:  # noqa: BLE001 - any client error means "not reachable"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TritonEngineError(f"triton server at {self.url} is not reachable: {first}") from None
        if not ready:
            raise TritonEngineError(f"model {self.model!r} is not ready on the triton server at {self.url}")
        got = self._infer(["dimension probe"], full=True).shape[1]
        if got != dimension:
            raise TritonEngineError(f"served model {self.model!r} returns dimension {got}, the export has {dimension}")
        if self._in_graph:
            try:
                outputs = [o.name for o in self._client().get_model_metadata(self.encoder_model).outputs]
            except Exception as exc:  # noqa: BLE001 - any client error: the encoder model is not served
                raise TritonEngineError(f"model {self.encoder_model!r} (the encoder of {self.model!r}) is not "
                                        f"served at {self.url}: {str(exc).strip()[:200]}") from None
            if CHUNK_VECTORS not in outputs:
                raise TritonEngineError(f"served model {self.encoder_model!r} returns no {CHUNK_VECTORS}: export "
                                        f"the model with --chunk-vectors and regenerate the repository "
                                        f"(attncal triton-repo) for {self.chunks['method']} chunks")

    def _parameters(self, full: bool = False) -> dict | None:
        return None if full or self.dimensions is None else {"dimensions": int(self.dimensions)}

    def _infer(self, texts: list[str], full: bool = False) -> np.ndarray:
        """The server's `sentence_embedding` of `texts` (the ensemble), truncated to the run's dimensions unless
        `full`."""
        import tritonclient.grpc as grpcclient

        arr = np.array([[t.encode("utf-8")] for t in texts], dtype=object)

        def call():
            inp = grpcclient.InferInput("text", list(arr.shape), "BYTES")
            inp.set_data_from_numpy(arr)
            res = self._client().infer(self.model, [inp], client_timeout=self.timeout_s,
                                       parameters=self._parameters(full))
            return np.asarray(res.as_numpy("sentence_embedding"), dtype=np.float32)

        return self._retried(call, self.model)

    def chunk_vectors(self, feeds: dict, spans: np.ndarray) -> np.ndarray:
        """One batch of windows (token ids, chunk spans) to the encoder model: its chunk vectors."""
        import tritonclient.grpc as grpcclient

        def call():
            inputs = []
            for name, arr in (*feeds.items(), (CHUNK_SPANS, spans)):
                inp = grpcclient.InferInput(name, list(arr.shape), "INT64")
                inp.set_data_from_numpy(np.ascontiguousarray(arr, dtype=np.int64))
                inputs.append(inp)
            res = self._client().infer(self.encoder_model, inputs, client_timeout=self.timeout_s,
                                       outputs=[grpcclient.InferRequestedOutput(CHUNK_VECTORS)],
                                       parameters=self._parameters())
            return np.asarray(res.as_numpy(CHUNK_VECTORS), dtype=np.float32)

        return self._retried(call, self.encoder_model)

    def _retried(self, call, model: str):
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                return call()
            except Exception as exc:  # noqa: BLE001 - classified below
                last = exc
                if not is_transient(exc):
                    break
                if attempt < self.retries:
                    time.sleep(self.backoff_s * 2**attempt)
        first = str(last).strip().splitlines()[0] if str(last).strip() else type(last).__name__
        kind = "persistent transient error" if is_transient(last) else "error"
        tries = self.retries + 1 if is_transient(last) else 1
        raise TritonEngineError(f"triton model {model!r} at {self.url} failed after {tries} "
                                f"attempt(s) ({kind}): {first[:300]}")

    def _embed(self, texts: list[str], pool) -> np.ndarray:
        """Embeddings of `texts` in input order: sorted by length, in requests of `batch_size` texts."""
        order = np.argsort([len(t) for t in texts], kind="stable")[::-1]
        batches = [order[i : i + self.batch_size] for i in range(0, len(texts), self.batch_size)]
        results = pool.map(lambda idx: self._infer([texts[j] for j in idx]), batches)
        out = None
        for idx, emb in zip(batches, results):
            if out is None:
                out = np.empty((len(texts), emb.shape[1]), dtype=np.float32)
            out[idx] = emb
        return out

    def encode(self, windows: Iterable[tuple[list[str], list[str]]]) -> Iterator[tuple[list[str], np.ndarray, None]]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            try:
                if self.chunks:
                    yield from self._encode_chunks(windows, pool)
                    return
                for ids, texts in windows:
                    yield ids, self._embed(texts, pool), None
            finally:
                for c in self._clients:
                    try:
                        c.close()
                    except Exception:  # noqa: BLE001 - closing is best effort
                        pass

    def _encode_chunks(self, windows, pool):
        """Each window's chunk rows (`Encoder.encode_chunks` with this server as its `served`)."""
        enc = load_encoder(self.export_dir, None, None, self.providers)
        options = ChunkOptions(**{k: self.chunks[k] for k in ("method", "size", "by", "overlap")})
        served = _Served(self, pool)
        for ids, texts in windows:
            errors: list | None = [] if self.chunks.get("skip") else None
            try:
                got = enc.encode_chunks(texts, options, batch_size=self.batch_size, errors=errors, served=served)
            except ChunkError as exc:
                raise row_error(exc, ids) from None
            got.errors = errors or []
            yield ids, got, None


class _Served:
    """A TritonEngine as `attncal.runtime.chunking.Served`: chunk vectors from the encoder model, naive chunk
    texts through the ensemble."""

    def __init__(self, engine: TritonEngine, pool: ThreadPoolExecutor) -> None:
        self.engine, self.pool = engine, pool

    def chunk_vectors(self, feeds: dict, spans: np.ndarray) -> np.ndarray:
        return self.engine.chunk_vectors(feeds, spans)

    def map(self, fn, items):
        return self.pool.map(fn, items)

    def encode(self, texts: list[str], batch_size: int, *, prompt: str = "") -> np.ndarray:
        # the served tokenizer puts the model's default prompt before every text, as `prompt` is here
        return self.engine._embed(texts, self.pool)

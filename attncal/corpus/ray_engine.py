"""The `ray` engine: Encoder actors that read, encode and write whole input pieces; the driver plans.

Nothing of the corpus passes through the driver.  The driver (`encode_corpus` in the calling
process) lists the input, cuts it into pieces from the files' sizes (`inputs.plan_pieces`; the
Parquet footers are read by an actor), sends each piece -- a few hundred bytes of JSON -- to an
idle actor, and commits the manifest from what the actors send back: per piece its row and line
counts, its bad rows and the names of the shards it wrote.  Each actor (`_PieceWorker`) holds one
`Encoder` with `cpus_per_worker` ONNX Runtime threads; for a piece it reads the piece's bytes from
the input itself, parses them with the local readers' code (`inputs.read_piece`: the same
validation, the same bad rows, named the same way), encodes window by window (sorted by length
inside a window, windows never crossing a shard boundary) and writes the piece's shards to the
output itself (`shards.ShardWriter`: temporary name, then moved), so the embeddings go from the
actor to the output.  A piece's shards are a function of the piece alone, so a piece encoded twice
(a retry after its actor died, a resume) writes the same shards under the same names.

Why not Ray Data: its readers stop the whole read at the first invalid JSON line, non-UTF-8 byte
or short CSV row and keep no line numbers, so `--on-error skip` could not skip and name the rows
the local engine skips; and its writers name and cut their files themselves, while a shard here
must be a function of its input piece (its name and its bytes the same on a retry) for the manifest
to commit it.  Ray core actors give the driver what it needs instead: it knows which piece each
actor holds, so when an actor dies -- its process killed, its node gone -- the piece goes back in
the queue for another actor (at most `MAX_ATTEMPTS` times), and a replacement actor is started,
which joins the pool when Ray finds room for it.  With no actor left and none started within
`START_TIMEOUT_S`, the run stops with one line; the pieces committed so far are kept and
`--resume` continues.

Ray's CPU counts are reservations: each actor reserves `cpus_per_worker` CPUs, by default the
cluster's CPUs divided by the number of actors, and no more than the largest node has.  With
`--ray-address` the run joins an existing cluster: every node then needs the package, read access to
the export and the input, write access to the output, and the credentials and endpoint for them (a
local path must be the same shared path on every node; a URI needs none of that).
"""

from __future__ import annotations

import os
import time
from collections import Counter, deque
from typing import Iterator

from ..runtime.chunking import ChunkError
from . import shards
from .inputs import InputFile, Piece, lines_before, parquet_layout, read_piece
from .local import available_cores, encode_window, load_encoder, row_error, tokenizer_threads, windows
from .shards import ShardWriter, piece_shard_name
from .storage import Location, fetch_tree

START_TIMEOUT_S = 600.0  # an actor fetches the export and loads it before it is ready
MAX_ATTEMPTS = 3  # a piece whose actor died this many times stops the run (a piece that kills its worker)
STOP_TIMEOUT_S = 120.0  # a cancelled piece stops at its next batch; past this its actor is killed mid-batch
_WAIT_S = 5.0


class RayEngineError(RuntimeError):
    """Ray could not run the pipeline; the message says what to change."""


class _PieceWorker:
    """One Encoder per actor, loaded once; reads, encodes and writes whole pieces.

    A failure to start (an export it cannot fetch, a graph it cannot load) is kept and raised by
    `ready`, so the driver receives the exception itself and not Ray's account of a dead actor."""

    def __init__(self, spec: dict) -> None:
        self.spec, self.error = spec, None
        shards.FAULT_HOOK = spec["fault_hook"]  # the driver's (a test's), in this actor's own process
        try:
            tokenizer_threads(spec["threads"])
            export: Location = spec["export"]
            local = export.url if export.is_local else str(fetch_tree(export, spec["digest"]))
            self.encoder = load_encoder(local, spec["threads"], spec["max_length"], chunks=spec.get("chunks"))
        except Exception as exc:  # noqa: BLE001 - raised again by ready()
            self.error = exc

    def ready(self) -> dict:
        if self.error is not None:
            raise self.error
        import ray

        return {"dimension": self.encoder.dimension, "graph": self.encoder.graph_file, "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id()}

    def layout(self, loc: Location) -> list[int]:
        return parquet_layout(loc)

    def lines_before(self, piece_json: str) -> int:
        return lines_before(Piece.from_json(piece_json))

    def run(self, index: int, piece_json: str) -> dict:
        """Read, validate, encode and write piece `index`; return its counts, bad rows and shards.

        With on_error "fail" a bad row stops the encoding of the piece: its shards are deleted and
        the rest of the piece is only parsed, so the driver learns every bad row of the piece."""
        s = self.spec
        piece = Piece.from_json(piece_json)
        out: Location = s["out"]
        bad: list[dict] = []
        shards: list[dict] = []
        state = {"lines": 0, "failed": False}
        chunks = read_piece(piece, s["text_field"], s["id_field"])

        def rows():
            for ch in chunks:
                state["lines"] += ch.lines
                bad.extend(b.to_dict() for b in ch.bad)
                if ch.bad and s["on_error"] == "fail":
                    state["failed"] = True
                    return
                yield ch.ids, ch.texts

        writer = ShardWriter(out, s["shard_size"], self.encoder.dimension, lambda j: piece_shard_name(index, j),
                             lambda name, n, **extra: shards.append({"file": name, "rows": n, **extra}),
                             output=s.get("output"))
        tokens = 0
        try:
            for ids, texts in windows(rows(), 0, s["shard_size"], s["window"]):
                if state["failed"]:
                    break
                try:
                    emb, t = encode_window(self.encoder, texts, s["batch_size"], _cancel_requested,
                                          s.get("max_batch_tokens"))
                except ChunkError as exc:
                    raise row_error(exc, ids) from None
                tokens += t
                writer.write(ids, emb)
            if not state["failed"]:
                writer.finish()
        except BaseException:
            writer.abort()
            for sh in shards:
                out.child(sh["file"]).delete()
            raise
        if state["failed"]:
            writer.abort()
            for sh in shards:
                out.child(sh["file"]).delete()
            shards.clear()
            for ch in chunks:  # the rest of the piece: parsed for its bad rows, not encoded
                state["lines"] += ch.lines
                bad.extend(b.to_dict() for b in ch.bad)
        return {"piece": index, "rows": writer.rows_done, "lines": state["lines"], "bad": bad, "shards": shards,
                "tokens": tokens, "failed": state["failed"]}


def _cancel_requested() -> bool:
    """Whether the driver cancelled the running piece (`RayEngine._stop`).  Ray sets a flag for a
    running task of a regular actor and leaves it to the task to look; without the flag (an older
    Ray) the piece runs to its end, and the driver's wait for it is longer, not shorter."""
    import ray

    return bool(getattr(ray.get_runtime_context(), "is_canceled", lambda: False)())


def _last_line(exc: BaseException) -> str:
    lines = [x.strip() for x in str(exc).strip().splitlines() if x.strip()]
    return lines[-1] if lines else type(exc).__name__


def _chunks_of(output: dict | None, on_error: str) -> dict | None:
    """The chunk options of a run's `output` as `load_encoder` takes them (None: one vector per row)."""
    chunks = (output or {}).get("chunks")
    return None if chunks is None else {**chunks, "skip": on_error == "skip"}


class RayEngine:
    """The actor pool and its scheduling; a context manager (Ray is started, or joined, on entry)."""

    name = "ray"

    def __init__(self, export: Location, digest: str, *, out: Location, batch_size: int, window: int,
                 shard_size: int, text_field: str, id_field: str, on_error: str, workers: int = 1,
                 max_length: int | None = None, address: str | None = None, num_cpus: int | None = None,
                 cpus_per_worker: int | None = None, max_batch_tokens: int | None = None,
                 output: dict | None = None) -> None:
        """`output`: the manifest's (dimensions, precision, ranges, chunks), which each actor applies."""
        self.workers, self.address = workers, address
        self.num_cpus = num_cpus if num_cpus is not None else (None if address else available_cores())
        self.cpus_per_worker = cpus_per_worker
        self.spec = {"export": export, "digest": digest, "out": out, "batch_size": batch_size, "window": window,
                     "shard_size": shard_size, "text_field": text_field, "id_field": id_field,
                     "on_error": on_error, "max_length": max_length, "fault_hook": shards.FAULT_HOOK,
                     "max_batch_tokens": max_batch_tokens, "output": output,
                     "chunks": _chunks_of(output, on_error)}
        self._started = False
        self._starting: dict = {}  # ready() ref -> actor
        self._idle: list = []
        self._busy: dict = {}  # run() ref -> (actor, index, piece)
        self._actors: list = []  # every actor started, alive or not: all are killed at the end
        self._spawned = 0
        self._last_death = "unknown"
        self.lost = 0  # actors that died during the run
        self.info: dict | None = None

    def describe(self) -> dict:
        return {"name": self.name, "workers": self.workers, "cpus_per_worker": self.cpus_per_worker,
                "address": self.address, "actors_lost": self.lost}

    # -- Ray and the actors -----------------------------------------------------------------------

    def __enter__(self) -> "RayEngine":
        # Ray talks a lot (its logger, the C++ core worker, deprecation notes): under the CLI that goes to the
        # console's capture (attncal.console), shown with --verbose.
        self._connect()
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            self._stop()
        finally:
            if self._started:
                import ray

                ray.shutdown()

    def _connect(self) -> None:
        import ray

        if not ray.is_initialized():
            try:
                if self.address:
                    ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
                else:
                    ray.init(num_cpus=self.num_cpus, include_dashboard=False, log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                where = self.address or "a local instance"
                raise RayEngineError(f"cannot start Ray on {where}: {str(exc).strip().splitlines()[0]}") from None
            self._started = True
        nodes = [n.get("Resources", {}).get("CPU", 0) for n in ray.nodes() if n.get("Alive")]
        largest = max(nodes, default=0)
        total = self.num_cpus or sum(nodes)
        if self.cpus_per_worker is None:
            self.cpus_per_worker = max(1, min(int(largest), int(total // self.workers)))
        if largest < self.cpus_per_worker:
            raise RayEngineError(f"no Ray node has {self.cpus_per_worker} CPU(s) for an Encoder actor (the largest "
                                 f"has {largest:g}); use fewer CPUs per actor or more --workers")
        self.spec["threads"] = self.cpus_per_worker
        self._cls = ray.remote(_PieceWorker)

    def _spawn(self) -> None:
        actor = self._cls.options(num_cpus=self.cpus_per_worker, max_restarts=0, max_task_retries=0).remote(self.spec)
        self._starting[actor.ready.remote()] = actor
        self._actors.append(actor)
        self._spawned += 1

    def _death_errors(self) -> tuple:
        import ray.exceptions as rex

        return (rex.RayActorError, rex.WorkerCrashedError, rex.NodeDiedError, rex.ObjectLostError)

    def _task_error(self, exc) -> BaseException:
        """The exception an actor method raised, as itself (a CorpusInputError, a StorageError)."""
        cause = getattr(exc, "cause", None)
        return cause if isinstance(cause, BaseException) else RayEngineError(_last_line(exc))

    def _on_ready(self, ref) -> None:
        import ray
        import ray.exceptions as rex

        actor = self._starting.pop(ref)
        try:
            info = ray.get(ref)
        except rex.RayTaskError as exc:  # the actor could not load the export: the same for every actor
            raise self._task_error(exc) from None
        except self._death_errors() as exc:
            if getattr(exc, "actor_init_failed", False):  # e.g. attncal missing on a node: no retry helps
                raise RayEngineError(f"an Encoder actor could not start: {_last_line(exc)}") from None
            self._last_death = _last_line(exc)
            self.lost += 1
            self._spawn_replacement()
            return
        if self.info is not None and info["dimension"] != self.info["dimension"]:
            raise RayEngineError(f"Encoder actors disagree on the embedding dimension ({info['dimension']} and "
                                 f"{self.info['dimension']}): the export differs between nodes")
        self.info = self.info or info
        self._idle.append(actor)

    def _spawn_replacement(self) -> None:
        if self._spawned < self.workers * (1 + MAX_ATTEMPTS):
            self._spawn()

    def _wait(self, refs: list, deadline: float) -> list:
        import ray

        ready, _ = ray.wait(refs, num_returns=1, timeout=_WAIT_S)
        if not ready and not self._idle and not self._busy and time.monotonic() > deadline:
            raise RayEngineError(f"no Encoder actor is alive and none started within {START_TIMEOUT_S:.0f} s (the "
                                 "cluster has no room for one, or its nodes keep dying); the pieces committed so "
                                 "far are kept and --resume continues")
        return ready

    def start(self) -> dict:
        """Start the actors; return the first ready actor's account (dimension, graph) once it is ready."""
        for _ in range(self.workers):
            self._spawn()
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.info is None:
            if not self._starting:
                raise RayEngineError(f"every Encoder actor died while starting (last: {self._last_death})")
            for ref in self._wait(list(self._starting), deadline):
                self._on_ready(ref)
        return self.info

    def _call(self, method: str, *args):
        """One call on an idle actor (a footer, a line count); retried on another actor if it dies."""
        import ray
        import ray.exceptions as rex

        for _ in range(MAX_ATTEMPTS):
            deadline = time.monotonic() + START_TIMEOUT_S
            while not self._idle:  # wait for a starting actor (a busy one's result must not be taken here)
                if not self._starting:
                    self._spawn_replacement()
                if not self._starting or time.monotonic() > deadline:
                    break
                for ref in self._wait(list(self._starting), deadline):
                    self._on_ready(ref)
            if not self._idle:
                break
            actor = self._idle.pop()
            try:
                result = ray.get(getattr(actor, method).remote(*args))
            except rex.RayTaskError as exc:
                self._idle.append(actor)
                raise self._task_error(exc) from None
            except self._death_errors() as exc:
                self._last_death = _last_line(exc)
                self.lost += 1
                self._spawn_replacement()
                continue
            self._idle.append(actor)
            return result
        raise RayEngineError(f"the Encoder actors died {MAX_ATTEMPTS} times running {method}")

    def parquet_layouts(self, files: list[InputFile]) -> dict[str, list[int]]:
        """Rows per row group of each Parquet file, read from the footers by the actors in parallel."""
        import ray
        import ray.exceptions as rex

        if not files:
            return {}
        while self._starting and len(self._idle) < min(len(files), self.workers):
            ready, _ = ray.wait(list(self._starting), num_returns=1, timeout=0.5)
            if not ready:
                break
            self._on_ready(ready[0])
        calls = [(f, self._idle[k % len(self._idle)]) for k, f in enumerate(files)]
        refs = [(f, actor, actor.layout.remote(f.location)) for f, actor in calls]
        out = {}
        for f, actor, ref in refs:
            try:
                out[f.path] = ray.get(ref)
            except rex.RayTaskError as exc:
                raise self._task_error(exc) from None
            except self._death_errors() as exc:
                if actor in self._idle:
                    self._idle.remove(actor)
                    self._last_death = _last_line(exc)
                    self.lost += 1
                    self._spawn_replacement()
                out[f.path] = self._call("layout", f.location)
        return out

    def lines_before(self, piece: Piece) -> int:
        return self._call("lines_before", piece.to_json())

    def run(self, items: list[tuple[int, Piece]]) -> Iterator[dict]:
        """Encode the pieces; yield each piece's result as its actor returns it (in no fixed order).

        A piece whose actor died goes back to the front of the queue; the generator's closing (the
        caller stopped) stops the actors."""
        import ray
        import ray.exceptions as rex

        queue = deque(items)
        attempts: Counter = Counter()
        deadline = time.monotonic() + START_TIMEOUT_S
        while queue or self._busy:
            while self._idle and queue:
                actor = self._idle.pop()
                i, piece = queue.popleft()
                self._busy[actor.run.remote(i, piece.to_json())] = (actor, i, piece)
            if not self._idle and not self._busy and not self._starting:
                self._spawn_replacement()
                if not self._starting:
                    raise RayEngineError(f"every Encoder actor died (last: {self._last_death}) and no more "
                                         "replacements are started; the pieces committed so far are kept and "
                                         "--resume continues")
            for ref in self._wait(list(self._busy) + list(self._starting), deadline):
                if ref in self._starting:
                    self._on_ready(ref)
                    continue
                actor, i, piece = self._busy.pop(ref)
                try:
                    result = ray.get(ref)
                except rex.RayTaskError as exc:
                    raise self._task_error(exc) from None
                except self._death_errors() as exc:
                    self._last_death = _last_line(exc)
                    self.lost += 1
                    attempts[i] += 1
                    if attempts[i] >= MAX_ATTEMPTS:
                        raise RayEngineError(f"the actor encoding piece {i} of {piece.path} died {attempts[i]} "
                                             f"times (last: {_last_line(exc)})") from None
                    queue.appendleft((i, piece))
                    self._spawn_replacement()
                    deadline = time.monotonic() + START_TIMEOUT_S
                    continue
                self._idle.append(actor)
                deadline = time.monotonic() + START_TIMEOUT_S
                yield result

    def _stop(self) -> None:
        """Stop the busy actors' pieces, then kill every actor (an idle one, or one whose call raised,
        would otherwise hold its CPUs until Ray collects its handle), so none writes after the driver
        has cleaned up or committed.

        Killing is not that fence by itself: Ray reports a killed actor's task failed once the actor is
        marked dead, which can be before its process has stopped, and a piece between its last shard's
        upload and its return would leave that shard behind the driver's cleanup.  A cancelled piece
        stops at its next batch, deletes its shards and returns.  Nor is the cancelled ref the fence
        (Ray may resolve it as cancelled while the piece still runs): a call queued behind the piece on
        the same actor, which runs its calls one at a time, returns only once the piece has."""
        import ray

        busy = list(self._busy)
        for ref in busy:
            ray.cancel(ref)
        behind = [actor.ready.remote() for actor, _, _ in self._busy.values()]
        if busy:
            ray.wait(busy + behind, num_returns=len(busy) + len(behind), timeout=STOP_TIMEOUT_S)
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._starting, self._idle, self._busy, self._actors = {}, [], {}, []

"""The Ray engine of `attncal encode`: actor start-up, throughput against the local engine, and the driver's
reads and memory on a corpus far larger than its memory budget.

    python benchmarks/ray_cluster.py [--export DIR] [--sections startup,throughput,driver] [--json out.json]
    python benchmarks/ray_cluster.py --sections startup,throughput --rows 20000 --rounds 3
    python benchmarks/ray_cluster.py --sections driver --driver-budget-mib 256 --factor 10

Without --export, a calibrated random-weight export is built in a temporary directory (BERT, 2 layers,
hidden 32, a 768-wide dense head so the embeddings weigh what a real model's do, no ORT-optimized graph);
`attncal export default -o DIR` then --export DIR measures all-MiniLM-L6-v2 instead (give it a smaller
--rows: it encodes far fewer rows per second).

The machine's cores (its CPU affinity) are the CPUs of every Ray instance here and of the local engine,
so each comparison is at equal cores.

1. startup: on a local Ray instance (`ray.init(num_cpus=cores)`), Encoder actors are created as the
   engine creates them (`ray.remote(_PieceWorker)`, the spec `RayEngine` builds, one actor of all the
   CPUs), one at a time, in --startup-rounds rounds whose variant order alternates, each actor killed
   once measured: "runtime" is the engine's actor as it is in this environment, "torch absent" the same
   actor where torch cannot be imported (a runtime install: transformers imports torch whenever it is
   installed), "with torch" the actor importing torch before its Encoder (what an actor costs when its
   imports pull torch in), "bare" a Ray actor holding nothing (the part of the figures that is Ray's
   worker process itself).  Per actor: wall seconds from `.remote()` to `ready()` returning, the actor
   process's CPU seconds (utime + stime of /proc/PID/stat) and VmHWM / VmRSS (/proc/PID/status) at that
   point, and whether torch is in its `sys.modules`.  Ray keeps idle worker processes started ahead of
   demand, and an actor may be placed on one of them: then the wall time leaves out the interpreter's
   start and Ray's imports, while the CPU seconds still hold them (the process's whole life).  Each actor
   is therefore classed by whether its process existed before `.remote()` (its start time in /proc
   against /proc/uptime), and the summary keeps the classes apart; the first measurement comes
   --settle-s after `ray.init`, once Ray's start-up has calmed down.
2. throughput: rows/s of `encode_corpus` end to end, each run in a fresh subprocess, on a JSON-lines
   corpus of --rows rows of mixed length (`encode_throughput.make_corpus`): the local engine with its
   defaults (one Encoder, ONNX Runtime's thread count = all cores) against Ray with one actor of all the
   CPUs and with one actor per CPU.  The corpus is cut into --pieces Ray pieces (the engine's piece size
   would make a corpus this small a single piece, which one actor encodes while the others wait).  The
   configurations alternate their order round by round; medians are reported, and the ratio ray /
   local.  "End to end" is the subprocess's time from before its imports to the result, Ray's start-up
   included (what a user pays); "after start-up" is the engine's own timing (`EncodeResult.seconds`):
   for Ray from the moment the actors are ready and the pieces planned, for the local engine from the
   end of its scan (its Encoder's load included).
3. driver: a moto S3 server on 127.0.0.1 (its own process: its memory and I/O are not the driver's)
   holds the export and a corpus of --factor x --driver-budget-mib MiB of JSON lines whose rows carry
   short texts and PAD bytes of an unused column, so the corpus is large but cheap to encode; it is
   written and uploaded one file of --file-mib at a time.  A driver process of its own starts a local
   Ray instance and runs `encode_corpus` from S3 to S3 with one actor per CPU, which fetch the export and
   read, encode and write the pieces themselves; a first run on a few rows pays what the process pays
   once whatever the corpus (imports, the S3 client's set-up, Ray's first calls), and the second run, on
   the corpus, is the one measured.  Its bytes read are counted two ways: read() and pread() on any file
   (rchar of /proc/self/io), and the bytes the S3 server sent it, counted by a TCP relay the S3 traffic
   goes through, which attributes each connection to the process owning the client socket (pyarrow's S3
   client receives with recv(), which rchar does not count).  Its peak resident size is VmHWM over its
   whole life, and over the measured run alone (reset through /proc/self/clear_refs where the kernel
   allows it).  Targets: the driver reads at most 1 % of the corpus bytes in the run, and its peak RSS
   stays within the budget.  The section refuses to start when the temporary directory's disk cannot
   hold the corpus (moto keeps objects over 5 MiB in temporary files) and the shards.

Results are printed as markdown tables (progress on stderr) and, with --json, written to a file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # support.s3: the moto server, shared with the cluster tests
sys.path.insert(0, str(ROOT / "benchmarks"))  # encode_throughput: the mixed-length corpus

from attncal.corpus.local import available_cores  # noqa: E402
from attncal.corpus.ray_engine import RayEngine, _PieceWorker  # noqa: E402
from attncal.corpus.storage import Location  # noqa: E402
from encode_throughput import make_corpus  # noqa: E402
from support.s3 import moto_server, upload_tree  # noqa: E402

SECTIONS = ("startup", "throughput", "driver")
MIB = 1 << 20
CPUS = available_cores()  # of every local Ray instance here: the local engine's ORT threads use as many
BUCKET = "attncal-bench"
PAD = 8000  # bytes of an unused column per driver-corpus row
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
          "AWS_EC2_METADATA_DISABLED": "true"}
S3_ENV_DROP = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN")
READ_TARGET = 0.01  # of the corpus bytes
TICKS = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def table(header: list[str], rows: Iterable[list]) -> str:
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"
    lines = ["| " + " | ".join(header) + " |", rule]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


# -- /proc ----------------------------------------------------------------------------------------------

def proc_stat(pid: int) -> list[str]:
    """Fields of /proc/PID/stat after the command name (field 3, the state, first)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()


def cpu_seconds(pid: int) -> float:
    f = proc_stat(pid)
    return (int(f[11]) + int(f[12])) / TICKS  # utime, stime (fields 14 and 15)


def started_s(pid: int) -> float:
    """When the process started, in seconds since boot (field 22)."""
    return int(proc_stat(pid)[19]) / TICKS


def uptime_s() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def memory(pid: int | str = "self") -> dict[str, int]:
    """VmHWM and VmRSS of a process, in bytes."""
    st = dict(x.split(":", 1) for x in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in x)
    return {k: int(st[k].split()[0]) * 1024 for k in ("VmHWM", "VmRSS")}


def wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


# -- the export -----------------------------------------------------------------------------------------

def build_export(work: Path) -> Path:
    """A calibrated random-weight BERT export (2 layers, a 768-wide dense head, no optimized graph)."""
    from attncal.calibration.config import CalibrationConfig
    from attncal.exporting.exporter import ExportOptions, export
    from attncal.synthetic import save_synthetic_model

    model = save_synthetic_model("bert", work / "model", seed=7, max_positions=128, max_seq_length=64, layers=2,
                                 dense=((768, "Identity", False),))
    out = work / "export"
    export(str(model), out, ExportOptions(config=CalibrationConfig(basket_size=4, strength=1.0),
                                          exporter="torchscript", check=False, optimized=False), quiet=True)
    return out


def export_name(path: Path, built: bool) -> str:
    if built:
        return "random-weight BERT, 2 layers, 768-wide head (built)"
    meta = json.loads((path / "attncal.json").read_text())
    return str(meta.get("source_model") or path.name)


# -- 1. actor start-up ----------------------------------------------------------------------------------

def imported() -> dict:
    """What the calling process has imported: torch or not, and how many modules."""
    return {"torch": sys.modules.get("torch") is not None, "modules": sum(m is not None for m in sys.modules.values())}


class RuntimeActor(_PieceWorker):
    """The engine's Encoder actor unchanged, plus a look at what its process has imported."""

    def probe(self) -> dict:
        return imported()


class TorchAbsentActor(RuntimeActor):
    """The engine's actor in a process where torch cannot be imported, as in a runtime install: a None
    entry in sys.modules makes `import torch` fail and `importlib.util.find_spec("torch")` find nothing,
    which is how transformers decides whether torch is available."""

    def __init__(self, spec: dict) -> None:
        sys.modules["torch"] = None
        super().__init__(spec)


class TorchActor(RuntimeActor):
    """The engine's actor importing torch before its Encoder."""

    def __init__(self, spec: dict) -> None:
        import torch  # noqa: F401

        super().__init__(spec)


class BareActor:
    """A Ray actor that holds nothing: the cost of Ray's worker process alone."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec

    def ready(self) -> dict:
        return {"pid": os.getpid()}

    def probe(self) -> dict:
        return imported()


VARIANTS = {"runtime": RuntimeActor, "torch absent": TorchAbsentActor, "with torch": TorchActor, "bare": BareActor}


def actor_spec(export: Path, out: Path, threads: int) -> dict:
    """The spec `RayEngine` hands its actors for this export (`threads` is what `_connect` adds)."""
    from attncal.corpus.shards import config_hash

    loc = Location.parse(export)
    eng = RayEngine(loc, config_hash(loc), out=Location.parse(out), batch_size=32, window=4096,
                    shard_size=100_000, text_field="text", id_field="id", on_error="fail")
    return dict(eng.spec, threads=threads)


def wait_for_cpus(ray, total: float, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < total and time.monotonic() < deadline:
        time.sleep(0.05)


def measure_actor(ray, cls, spec: dict, cpus: int) -> dict:
    """Create one actor, wait for ready(), read its process's counters, then kill it."""
    up0 = uptime_s()
    t0 = time.perf_counter()
    actor = cls.options(num_cpus=cpus, max_restarts=0, max_task_retries=0).remote(spec)
    info = ray.get(actor.ready.remote(), timeout=600)
    wall = time.perf_counter() - t0
    pid = info["pid"]
    cpu, mem, age = cpu_seconds(pid), memory(pid), up0 - started_s(pid)
    probe = ray.get(actor.probe.remote())
    ray.kill(actor, no_restart=True)
    wait_gone(pid)
    return {"wall_s": wall, "cpu_s": cpu, "hwm_mib": mem["VmHWM"] / MIB, "rss_mib": mem["VmRSS"] / MIB,
            "torch": probe["torch"], "modules": probe["modules"], "pid": pid,
            "process_age_s": age, "prestarted": age > 2 / TICKS}


def bench_startup(args: argparse.Namespace, export: Path, work: Path) -> dict:
    import ray

    spec = actor_spec(export, work / "startup-out", CPUS)
    ray.init(num_cpus=CPUS, include_dashboard=False, log_to_driver=False)
    try:
        classes = {name: ray.remote(cls) for name, cls in VARIANTS.items()}
        time.sleep(args.settle_s)
        actors = []
        for r in range(args.startup_rounds):
            names = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
            for name in names:
                wait_for_cpus(ray, CPUS)
                m = dict(measure_actor(ray, classes[name], spec, CPUS), variant=name, round=r)
                actors.append(m)
                log(f"startup round {r} {name:10s} {m['wall_s']:6.2f} s wall  {m['cpu_s']:6.2f} s CPU  "
                    f"HWM {m['hwm_mib']:6.0f} MiB  torch {m['torch']}  prestarted {m['prestarted']}")
    finally:
        ray.shutdown()
    return {"actors": actors, "summary": startup_summary(actors), "cpus": CPUS, "settle_s": args.settle_s}


def startup_summary(actors: list[dict]) -> list[dict]:
    groups: dict[tuple[str, bool], list[dict]] = {}
    for a in actors:
        groups.setdefault((a["variant"], a["prestarted"]), []).append(a)
    out = []
    for (variant, pre), ms in sorted(groups.items(), key=lambda kv: (list(VARIANTS).index(kv[0][0]), kv[0][1])):
        torch = {m["torch"] for m in ms}
        out.append({"variant": variant, "process": "prestarted" if pre else "started for it", "n": len(ms),
                    "wall_s": median(m["wall_s"] for m in ms), "cpu_s": median(m["cpu_s"] for m in ms),
                    "hwm_mib": median(m["hwm_mib"] for m in ms), "rss_mib": median(m["rss_mib"] for m in ms),
                    "torch": "yes" if torch == {True} else "no" if torch == {False} else "some",
                    "modules": int(median(m["modules"] for m in ms))})
    return out


def startup_table(res: dict) -> str:
    rows = [[s["variant"], s["process"], s["n"], f"{s['wall_s']:.2f}", f"{s['cpu_s']:.2f}", f"{s['hwm_mib']:.0f}",
             f"{s['rss_mib']:.0f}", s["torch"], s["modules"]] for s in res["summary"]]
    return table(["actor", "worker process", "n", "wall to ready s", "CPU s", "VmHWM MiB", "VmRSS MiB",
                  "torch imported", "modules"], rows)


# -- subprocesses ---------------------------------------------------------------------------------------

def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return dict(os.environ, **OFFLINE, **(extra or {}))


def run_child(script: str, argv: list[str], env: dict[str, str], timeout_s: float,
              on_start: Callable[[subprocess.Popen], None] | None = None) -> dict:
    """Run `script` in a fresh interpreter; return the JSON object of its last stdout line."""
    proc = subprocess.Popen([sys.executable, "-c", script, *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if on_start is not None:
        on_start(proc)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"child ran past {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}): {stderr.strip()[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


# -- 2. throughput --------------------------------------------------------------------------------------

# One run of encode_corpus; the clock starts before the imports, as a user's command would.
THROUGHPUT_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
export, corpus, out = sys.argv[1:4]
piece_bytes, extra = int(sys.argv[4]), json.loads(sys.argv[5])
from attncal.corpus import api, encode_corpus
if piece_bytes:
    api.PIECE_BYTES = piece_bytes
res = encode_corpus(export, corpus, out, batch_size=32, show_progress=False, **extra)
wall = time.perf_counter() - t0
print(json.dumps({"rows": res.rows, "wall_s": wall, "engine_s": res.seconds, "engine": res.manifest.get("engine"),
                  "pieces": res.manifest.get("plan", {}).get("pieces")}))
"""

CONFIGS = {"local": {"engine": "local"},
           f"ray 1x{CPUS}": {"engine": "ray", "workers": 1},
           f"ray {CPUS}x1": {"engine": "ray", "workers": CPUS}}


def run_throughput(name: str, export: Path, corpus: Path, work: Path, piece_bytes: int) -> dict:
    out = Path(tempfile.mkdtemp(dir=work, prefix="out-"))
    out.rmdir()
    extra = CONFIGS[name]
    try:
        res = run_child(THROUGHPUT_CHILD, [str(export), str(corpus), str(out),
                                           str(piece_bytes if extra["engine"] == "ray" else 0), json.dumps(extra)],
                        child_env(), timeout_s=3600)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return dict(res, config=name, rows_per_s=res["rows"] / res["wall_s"],
                rows_per_s_after_startup=res["rows"] / res["engine_s"])


def bench_throughput(args: argparse.Namespace, export: Path, work: Path) -> dict:
    corpus = work / "throughput.jsonl"
    make_corpus(corpus, args.rows)
    size = corpus.stat().st_size
    piece_bytes = math.ceil(size / args.pieces)
    runs: list[dict] = []
    names = list(CONFIGS)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            res = dict(run_throughput(name, export, corpus, work, piece_bytes), round=r)
            runs.append(res)
            log(f"throughput round {r} {name:8s} {res['rows_per_s']:8.1f} rows/s end to end "
                f"({res['wall_s']:.1f} s), {res['rows_per_s_after_startup']:8.1f} rows/s after start-up")
    corpus.unlink()
    return {"rows": args.rows, "corpus_bytes": size, "pieces": args.pieces, "piece_bytes": piece_bytes,
            "runs": runs, "summary": throughput_summary(runs)}


def throughput_summary(runs: list[dict]) -> list[dict]:
    out = []
    for name in CONFIGS:
        rs = [r for r in runs if r["config"] == name]
        out.append({"config": name, "engine": rs[0]["engine"], "runs": len(rs),
                    "wall_s": median(r["wall_s"] for r in rs),
                    "startup_s": median(r["wall_s"] - r["engine_s"] for r in rs),
                    "rows_per_s": median(r["rows_per_s"] for r in rs),
                    "rows_per_s_after_startup": median(r["rows_per_s_after_startup"] for r in rs)})
    local = out[0]
    for s in out:
        s["ratio"] = s["rows_per_s"] / local["rows_per_s"]
        s["ratio_after_startup"] = s["rows_per_s_after_startup"] / local["rows_per_s_after_startup"]
    return out


def describe_engine(e: dict | None) -> str:
    if not e:
        return "-"
    if e.get("name") == "ray":
        return f"{e['workers']} actor(s) x {e['cpus_per_worker']} CPU"
    return f"{e.get('workers')} worker(s) x {e.get('threads_per_worker')} threads"


def throughput_table(res: dict) -> str:
    rows = [[s["config"], describe_engine(s["engine"]), s["runs"], f"{s['wall_s']:.1f}", f"{s['startup_s']:.1f}",
             f"{s['rows_per_s']:.1f}", f"{s['ratio']:.3f}", f"{s['rows_per_s_after_startup']:.1f}",
             f"{s['ratio_after_startup']:.3f}"] for s in res["summary"]]
    return (f"{res['rows']} rows, {res['corpus_bytes'] / MIB:.1f} MiB, {res['pieces']} Ray pieces; medians\n\n"
            + table(["config", "engine", "runs", "wall s", "wall - engine s", "rows/s end to end", "ray / local",
                     "rows/s after start-up", "ray / local"], rows))


# -- 3. the driver against S3 ---------------------------------------------------------------------------

def open_files(pid: int) -> set[str]:
    """What the descriptors of a process point at (`socket:[INODE]` for a socket)."""
    links = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # the process is gone
        return links
    for fd in fds:
        try:
            links.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed while listing
            pass
    return links


class CountingRelay:
    """A TCP relay in front of the S3 server that counts the bytes each way, by client process.

    Each accepted connection is attributed to the watched process when the client socket (found by its
    port in /proc/net/tcp) is among that process's open files, else to "others".  The watched process's
    bytes are kept with the time they passed (`time.monotonic`, one clock for every process on Linux),
    so they can be split at a moment the process reports."""

    BUFFER = 1 << 20

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.pid: int | None = None
        self.totals: Counter = Counter()  # (direction, who) -> bytes; direction "in" = sent by the server
        self.connections: Counter = Counter()
        self.events: list[tuple[float, str, int]] = []  # the watched process's (time, direction, bytes)
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def watch(self, pid: int) -> None:
        self.pid = pid

    def close(self) -> None:
        self.server.close()

    def driver_bytes(self, direction: str, since: float) -> int:
        with self.lock:
            return sum(n for t, d, n in self.events if d == direction and t >= since)

    def _accept(self) -> None:
        while True:
            try:
                client, addr = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client, self._owner(addr[1])), daemon=True).start()

    def _owner(self, client_port: int) -> str:
        inode, pid = self._client_inode(client_port), self.pid
        if inode is None or pid is None:
            return "others"
        return "driver" if f"socket:[{inode}]" in open_files(pid) else "others"

    def _client_inode(self, client_port: int) -> str | None:
        """The inode of the socket bound to 127.0.0.1:client_port and connected to this relay."""
        want_local, want_remote = f"0100007F:{client_port:04X}", f"0100007F:{self.port:04X}"
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            f = line.split()
            if f[1] == want_local and f[2] == want_remote:
                return f[9]
        return None

    def _serve(self, client: socket.socket, who: str) -> None:
        with self.lock:
            self.connections[who] += 1
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        back = threading.Thread(target=self._pump, args=(upstream, client, "in", who), daemon=True)
        back.start()
        self._pump(client, upstream, "out", who)
        back.join()
        client.close()
        upstream.close()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str, who: str) -> None:
        buf = memoryview(bytearray(self.BUFFER))
        try:
            while (n := src.recv_into(buf)) > 0:
                dst.sendall(buf[:n])
                self._count(direction, who, n)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _count(self, direction: str, who: str, n: int) -> None:
        with self.lock:
            self.totals[direction, who] += n
            if who == "driver":
                self.events.append((time.monotonic(), direction, n))


# The driver, in a process of its own so that its counters are its own.  A first run on a few rows pays
# what a process pays once whatever the corpus (the imports, the S3 client's set-up, Ray's first calls);
# the counters of the second run measure what the run itself reads and holds.
DRIVER_CHILD = r"""
import json, sys, time
from pathlib import Path
export, warmup, corpus, out, endpoint, cpus = sys.argv[1:6] + [int(sys.argv[6])]

def counters():
    io = dict(x.split(": ") for x in Path("/proc/self/io").read_text().splitlines())
    st = dict(x.split(":", 1) for x in Path("/proc/self/status").read_text().splitlines())
    return int(io["rchar"]), int(st["VmHWM"].split()[0]) * 1024, int(st["VmRSS"].split()[0]) * 1024

import ray
from attncal.corpus import encode_corpus
ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
opts = dict(engine="ray", workers=cpus, s3_endpoint=endpoint, on_error="skip", show_progress=False)
read_w, _, _ = counters()
encode_corpus(export, warmup, out + "-warmup", **opts)
read0, hwm0, rss0 = counters()
try:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    reset = True
except OSError:
    reset = False
t_run, t0 = time.monotonic(), time.perf_counter()
res = encode_corpus(export, corpus, out, **opts)
wall = time.perf_counter() - t0
read1, hwm1, rss1 = counters()
ray.shutdown()
print(json.dumps({"rows": res.rows, "skipped": res.skipped, "shards": res.shards, "wall_s": wall,
                  "engine_s": res.seconds, "dimension": res.manifest["model"]["dimension"],
                  "pieces": res.manifest["plan"]["pieces"], "engine": res.manifest["engine"], "t_run": t_run,
                  "rchar_warmup": read0 - read_w, "rchar_run": read1 - read0, "rss_before": rss0,
                  "hwm_run": hwm1 if reset else None, "hwm_life": max(hwm0, hwm1), "hwm_reset": reset}))
"""


def driver_row(i: int, text: str, pad: str) -> str:
    return json.dumps({"id": f"r{i}", "text": text, "pad": pad}) + "\n"


def corpus_files(total: int, file_bytes: int, work: Path, seed: int = 0) -> Iterable[tuple[Path, int]]:
    """JSON-lines files of about `file_bytes` each, `total` bytes in all, written one at a time to the
    same temporary path; yields (path, rows) for each before the next is written."""
    from attncal.synthetic import synthetic_text

    rng = np.random.default_rng(seed)
    texts = [synthetic_text(int(rng.integers(20, 121)), seed=k) for k in range(4096)]
    pool = rng.bytes(1 << 20).hex()  # PAD-long slices of it, at varying offsets
    path, row, written = work / "corpus-part.jsonl", 0, 0
    while written < total:
        rows, size = 0, 0
        with open(path, "w", encoding="utf-8") as f:
            while size < min(file_bytes, total - written):
                start = (row * 7919) % (len(pool) - PAD)
                line = driver_row(row, texts[row % len(texts)], pool[start:start + PAD])
                f.write(line)
                size += len(line)
                rows += 1
                row += 1
        written += size
        yield path, rows


def upload_corpus(client, total: int, file_bytes: int, work: Path) -> dict:
    n_files, rows, size = 0, 0, 0
    for path, n in corpus_files(total, file_bytes, work):
        size += path.stat().st_size
        client.upload_file(str(path), BUCKET, f"corpus/part-{n_files:05d}.jsonl")
        path.unlink()
        n_files, rows = n_files + 1, rows + n
        log(f"driver corpus: {n_files} file(s), {size / MIB:,.0f} MiB uploaded")
    return {"files": n_files, "rows": rows, "bytes": size}


def upload_warmup(client, rows: int = 16) -> None:
    from attncal.synthetic import synthetic_text

    body = "".join(driver_row(i, synthetic_text(40, seed=i), "0" * PAD) for i in range(rows))
    client.put_object(Bucket=BUCKET, Key="warmup/part-00000.jsonl", Body=body.encode())


def disk_needed(corpus_bytes: int, file_bytes: int) -> int:
    """The corpus in moto's temporary files, the shards (under half the corpus: a row holds PAD bytes,
    its embedding 4 bytes per dimension), one staging file, and a margin."""
    return corpus_bytes + corpus_bytes // 2 + file_bytes + (1 << 30)


def s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name=S3_ENV["AWS_REGION"],
                        aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"])


def s3_environment() -> None:
    """This process's and its children's S3 settings: dummy credentials, no other endpoint or profile."""
    for name in S3_ENV_DROP:
        os.environ.pop(name, None)
    os.environ.update(S3_ENV)


def bench_driver(args: argparse.Namespace, export: Path, work: Path) -> dict | None:
    budget = args.driver_budget_mib * MIB
    total, file_bytes = budget * args.factor, args.file_mib * MIB
    free, need = shutil.disk_usage(work).free, disk_needed(budget * args.factor, file_bytes)
    if free < need:
        print(f"driver section refused: {work} has {free / 2**30:.1f} GiB free, the corpus and its shards need "
              f"{need / 2**30:.1f} GiB (lower --factor or --driver-budget-mib)", file=sys.stderr)
        return None
    s3_environment()
    with moto_server({"TMPDIR": str(work)}) as endpoint:
        client = s3_client(endpoint)
        client.create_bucket(Bucket=BUCKET)
        upload_tree(client, BUCKET, export, "export")
        upload_warmup(client)
        corpus = upload_corpus(client, total, file_bytes, work)
        relay = CountingRelay(int(endpoint.rsplit(":", 1)[1]))
        try:
            env = child_env({"ATTNCAL_CACHE_DIR": str(work / "cache")})
            log(f"driver: encoding {corpus['bytes'] / MIB:,.0f} MiB from s3://{BUCKET}/corpus/ ...")
            argv = [f"s3://{BUCKET}/{k}" for k in ("export", "warmup/", "corpus/", "out")]
            res = run_child(DRIVER_CHILD, [*argv, relay.endpoint, str(args.driver_cpus)], env,
                            timeout_s=args.driver_timeout_s, on_start=lambda p: relay.watch(p.pid))
        finally:
            relay.close()
    return driver_result(args, corpus, res, relay)


def driver_result(args: argparse.Namespace, corpus: dict, res: dict, relay: CountingRelay) -> dict:
    budget = args.driver_budget_mib * MIB
    s3_in = relay.driver_bytes("in", res["t_run"])
    read = res["rchar_run"] + s3_in
    return {"budget_bytes": budget, "factor": args.factor, "corpus": corpus, "run": res,
            "embeddings_bytes": res["rows"] * res["dimension"] * 4,
            "driver_s3_in_run": s3_in, "driver_s3_out_run": relay.driver_bytes("out", res["t_run"]),
            "driver_s3_in_warmup": relay.totals["in", "driver"] - s3_in,
            "driver_connections": relay.connections["driver"], "others_s3_in": relay.totals["in", "others"],
            "others_s3_out": relay.totals["out", "others"], "others_connections": relay.connections["others"],
            "driver_read_fraction": read / corpus["bytes"], "read_target": READ_TARGET,
            "read_ok": read <= READ_TARGET * corpus["bytes"], "rss_ok": res["hwm_life"] <= budget}


def driver_table(d: dict) -> str:
    r, c = d["run"], d["corpus"]
    mib = lambda b: f"{b / MIB:,.1f}" if b is not None else "-"  # noqa: E731
    ok = lambda v: "met" if v else "NOT met"  # noqa: E731
    rows = [
        ["corpus", f"{c['bytes']:,} B ({mib(c['bytes'])} MiB) in {c['files']} file(s), {c['rows']:,} rows, "
                   f"{r['pieces']} pieces"],
        ["rows encoded / skipped", f"{r['rows']:,} / {r['skipped']:,}"],
        ["embeddings (rows x dim x 4)", f"{d['embeddings_bytes']:,} B ({mib(d['embeddings_bytes'])} MiB, "
                                        f"dim {r['dimension']})"],
        ["wall s (encode_corpus) / after start-up", f"{r['wall_s']:.1f} / {r['engine_s']:.1f} "
                                                    f"({r['rows'] / r['wall_s']:,.0f} rows/s end to end)"],
        ["driver read() bytes (rchar): warm-up run / run", f"{r['rchar_warmup']:,} / {r['rchar_run']:,}"],
        ["driver bytes from S3 (relay): warm-up run / run", f"{d['driver_s3_in_warmup']:,} / {d['driver_s3_in_run']:,} "
                                                            f"(sent in the run: {d['driver_s3_out_run']:,})"],
        ["actors' bytes from S3 (relay), both runs", f"{d['others_s3_in']:,} ({d['others_s3_in'] / c['bytes']:.3f} x "
                                                     f"corpus); sent {d['others_s3_out']:,}"],
        ["driver reads in the run / corpus", f"{d['driver_read_fraction']:.5f} (target <= {READ_TARGET}: "
                                             f"{ok(d['read_ok'])})"],
        ["driver RSS before the run", f"{mib(r['rss_before'])} MiB"],
        ["driver peak RSS over the run", f"{mib(r['hwm_run'])} MiB"],
        ["driver peak RSS, whole process", f"{mib(r['hwm_life'])} MiB (budget {mib(d['budget_bytes'])} MiB: "
                                           f"{ok(d['rss_ok'])})"],
    ]
    return table(["driver", "value"], rows)


# -- main -----------------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--export", type=Path, default=None, help="an attncal export (default: a tiny one is built)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--startup-rounds", type=int, default=4, help="rounds of actors, one of each variant")
    ap.add_argument("--settle-s", type=float, default=5.0, help="wait after ray.init before the first actor")
    ap.add_argument("--rows", type=int, default=20_000,
                    help="throughput corpus rows (the default suits the built export; fewer for a real model)")
    ap.add_argument("--rounds", type=int, default=3, help="throughput rounds, each of every configuration")
    ap.add_argument("--pieces", type=int, default=8, help="Ray pieces the throughput corpus is cut into")
    ap.add_argument("--driver-budget-mib", type=int, default=256, help="the driver's memory budget")
    ap.add_argument("--factor", type=int, default=10, help="driver corpus size = factor x budget")
    ap.add_argument("--file-mib", type=int, default=64, help="size of each driver corpus file")
    ap.add_argument("--driver-cpus", type=int, default=CPUS, help="Ray CPUs = actors of the driver run")
    ap.add_argument("--driver-timeout-s", type=float, default=7200.0)
    args = ap.parse_args()
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; choose among {', '.join(SECTIONS)}")
    return args


def main() -> int:
    args = parse_args()
    os.environ.update(OFFLINE)
    work = Path(tempfile.mkdtemp(prefix="ray-bench-"))
    try:
        return run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> int:
    export = args.export.resolve() if args.export else build_export(work)
    results: dict = {"export": export_name(export, args.export is None), "built_export": args.export is None}
    print(f"export: {results['export']}\n")
    benches = {"startup": (bench_startup, startup_table, "Actor start-up (local Ray, one actor at a time)"),
               "throughput": (bench_throughput, throughput_table, "Rows/s, Ray against local at equal cores"),
               "driver": (bench_driver, driver_table, "The driver on a corpus of factor x its memory budget")}
    status = 0
    for name in args.sections:
        bench, show, title = benches[name]
        res = bench(args, export, work)
        results[name] = res
        if res is None:
            status = 1
            continue
        print(f"## {title}\n\n{show(res)}\n", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())

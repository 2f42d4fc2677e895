"""Re-index a corpus with an attncal export: streaming, sharded, resumable.

JSONL/CSV/Parquet in, Parquet shards and a manifest out; local paths or object-storage URIs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..corpus import encode_corpus
from ..corpus.ray_engine import RayEngineError
from ..corpus.triton import TritonEngineError
from ..messages import first_line
from ..runtime.chunking import BY, DEFAULT_SIZE, METHODS
from ..runtime.encoder import DEFAULT_MAX_BATCH_TOKENS
from ..runtime.precision import PRECISIONS
from .common import CLIError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", metavar="OUT",
                   help="an attncal export directory or its URI (a model or `default` is refused: run `attncal export` "
                        "first)")
    p.add_argument("--input", "-i", required=True, action="append",
                   help="a .jsonl/.csv/.parquet file, a directory of them, or a glob; a local path or a URI such as "
                        "s3://bucket/corpus/ (repeatable)")
    p.add_argument("--output", "-o", required=True,
                   help="output directory (local path or URI) for shards and manifest.json")
    p.add_argument("--text-field", default="text", help="field holding the passage (default %(default)s)")
    p.add_argument("--id-field", default="id", help="field holding the id, written as a string (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="texts per model call, at most (default %(default)s)")
    p.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS, metavar="N",
                   help="local, ray: at most N padded tokens per model call (texts x the longest), which bounds its "
                        "memory; long texts go fewer at a time (default %(default)s; the triton server batches "
                        "by its own settings)")
    p.add_argument("--max-length", type=int, default=None, help="truncate to N tokens (default: the export's)")
    p.add_argument("--workers", type=int, default=1,
                   help="local: worker processes; triton: concurrent requests; ray: Encoder actors (default 1)")
    p.add_argument("--engine", choices=("local", "triton", "ray"), default="local",
                   help="where the model runs: the attncal Encoder in this process (local), a Triton server "
                        "(triton) or Ray actors (ray) (default %(default)s)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run: keep what its manifest lists, encode the rest")
    p.add_argument("--on-error", choices=("fail", "skip"), default="fail",
                   help="bad rows: stop and leave no output, or skip them into skipped.jsonl (default fail)")
    p.add_argument("--shard-size", type=int, default=100_000, help="rows per Parquet shard (default %(default)s)")
    p.add_argument("--window", type=int, default=4096,
                   help="rows sorted by length together; bounds memory (default %(default)s)")
    p.add_argument("--url", default="localhost:8001", help="triton: gRPC address (default %(default)s)")
    p.add_argument("--model", default=None, help="triton: served model name (the ensemble from attncal triton-repo)")
    p.add_argument("--ray-address", default=None, help="ray: an existing cluster (default: a local Ray instance)")
    p.add_argument("--s3-endpoint", default=None,
                   help="S3-compatible endpoint for s3:// URIs, e.g. http://minio:9000 (default: $AWS_ENDPOINT_URL, "
                        "else AWS); Ray workers get it with the job")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    g = p.add_argument_group("chunks, dimensions and precision (docs/long-documents.md)")
    g.add_argument("--chunks", choices=METHODS, default=None,
                   help="one row per chunk of each text, with its character span and window: naive (each chunk "
                        "encoded alone), late (the text encoded once, in max-length windows; each chunk the mean of "
                        "its tokens' states), landmark (an LMK export: each chunk's landmark state); triton: late and "
                        "landmark need an export made with --chunk-vectors")
    g.add_argument("--chunk-size", type=int, default=None, metavar="G",
                   help=f"tokens per chunk (naive, late; default {DEFAULT_SIZE}, or what one model call holds where "
                        "that is less); with --chunk-by sentence, the most tokens of the sentences packed into one chunk")
    g.add_argument("--chunk-by", choices=BY, default="tokens", help="cut chunks at G tokens or at sentence ends "
                                                                    "(default %(default)s)")
    g.add_argument("--chunk-overlap", type=int, default=0, metavar="O",
                   help="naive: each chunk's text also holds the O tokens before it; late: each window after the "
                        "first opens with the O tokens before its first chunk, as context (default 0)")
    g.add_argument("--dimensions", type=int, default=None, metavar="N",
                   help="keep the first N dimensions (Matryoshka), normalised again where the model normalises "
                        "(triton: by the server, the request parameter `dimensions`)")
    g.add_argument("--precision", choices=PRECISIONS, default="float32",
                   help="embedding precision, as sentence-transformers' quantize_embeddings: int8 / uint8 with "
                        "per-dimension ranges from a seeded corpus sample (recorded in the manifest, reused by "
                        "--resume), binary / ubinary one bit per dimension (default %(default)s)")
    g.add_argument("--ranges", default=None, metavar="FILE",
                   help="int8 / uint8: the ranges to use, from the manifest.json of an earlier run (its "
                        "output.ranges) or a JSON [[minimums], [maximums]]; needed with --engine ray")


def run(args: argparse.Namespace) -> int:
    if args.engine != "triton" and args.model is not None:
        raise CLIError("--model names a served model and needs --engine triton")
    if args.engine != "ray" and args.ray_address is not None:
        raise CLIError("--ray-address needs --engine ray")
    ranges = _read_ranges(args.ranges) if args.ranges else None
    try:
        result = encode_corpus(args.out, args.input, args.output, text_field=args.text_field, id_field=args.id_field,
                               batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens,
                               max_length=args.max_length, workers=args.workers,
                               engine=args.engine, resume=args.resume, on_error=args.on_error, url=args.url,
                               model_name=args.model, ray_address=args.ray_address, shard_size=args.shard_size,
                               window=args.window, s3_endpoint=args.s3_endpoint, show_progress=not args.quiet,
                               chunks=args.chunks, chunk_size=args.chunk_size, chunk_by=args.chunk_by,
                               chunk_overlap=args.chunk_overlap, dimensions=args.dimensions, precision=args.precision,
                               ranges=ranges)
    except (TritonEngineError, RayEngineError) as exc:
        raise CLIError(str(exc), code=1) from None
    print(result.summary())
    return 0


def _read_ranges(path: str) -> list:
    """int8 ranges from a manifest.json (its output.ranges) or a JSON [[minimums], [maximums]] file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CLIError(f"--ranges {path}: {first_line(exc)}") from None
    if isinstance(data, dict):
        data = (data.get("output") or {}).get("ranges")
        if data is None:
            raise CLIError(f"--ranges {path}: the manifest records no int8 / uint8 ranges")
    return data

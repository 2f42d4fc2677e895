"""Generate a Triton Inference Server model repository from an attncal export."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..runtime.chunking import CHUNK_SPANS, CHUNK_VECTORS
from ..serving.repository import BACKENDS, KINDS, RepoOptions, build_repository


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = RepoOptions()
    p.add_argument("export", help="export directory (from `attncal export`)")
    p.add_argument("-o", "--repo", required=True, help="model repository to create or add to")
    p.add_argument("--name", default=None, help="model name clients call (default: the export directory's name)")
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="max_batch_size (default %(default)s)")
    p.add_argument("--instances", type=int, default=d.instances, help="model instances (default %(default)s)")
    p.add_argument("--backend", choices=BACKENDS, default=d.backend,
                   help="encoder backend (default %(default)s; onnxruntime and tensorrt are generated for your own "
                        "Triton install, not run by `attncal serve`)")
    p.add_argument("--kind", choices=KINDS, default=d.kind, help="instance kind (default %(default)s)")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--with-tokenizer", dest="with_tokenizer", action="store_true", default=d.with_tokenizer,
                     help="add the tokenizer model and the text-in ensemble NAME (default)")
    tok.add_argument("--no-tokenizer", dest="with_tokenizer", action="store_false",
                     help="only the encoder model (clients send token ids)")
    p.add_argument("--max-queue-delay-us", type=int, default=d.max_queue_delay_us,
                   help="dynamic batching queue delay in microseconds (default %(default)s)")
    p.add_argument("--intra-op-threads", type=int, default=d.intra_op_threads,
                   help="ONNX Runtime threads per instance, 0 = its default (default %(default)s)")
    p.add_argument("--custom-op-library", default=None,
                   help="attncal ONNX Runtime op library, as a path on the serving machine (python/onnxruntime)")
    p.add_argument("--overwrite", action="store_true", help="replace models of the same name in the repository")


def run(args: argparse.Namespace) -> int:
    opts = RepoOptions(name=args.name, max_batch=args.max_batch, instances=args.instances, backend=args.backend,
                       kind=args.kind, with_tokenizer=args.with_tokenizer, max_queue_delay_us=args.max_queue_delay_us,
                       intra_op_threads=args.intra_op_threads, custom_op_library=args.custom_op_library,
                       overwrite=args.overwrite)
    names = build_repository(args.export, args.repo, opts)
    print(f"wrote {', '.join(names.values())} ({args.backend} encoder) -> {args.repo}")
    served = _served(args.repo, names["encoder"])
    if served:
        print(f"the encoder serves the export's {served}")
    if "ensemble" in names:
        print(f"clients send UTF-8 text as input 'text' to model '{names['ensemble']}' and get 'sentence_embedding' "
              "(request parameter 'dimensions': Matryoshka truncation)" if args.backend == "python" else
              f"clients send UTF-8 text as input 'text' to model '{names['ensemble']}' and get 'sentence_embedding'")
    if _chunk_vectors(args.repo, names["encoder"]) and args.backend != "tensorrt":
        print(f"chunk vectors: clients send token ids and '{CHUNK_SPANS}' to model '{names['encoder']}' and get "
              f"'{CHUNK_VECTORS}' (attncal encode --engine triton --chunks late)")
    if args.backend == "tensorrt":
        print(f"build the plan first: see {args.repo}/{names['encoder']}/README.txt")
    return 0


def _chunk_vectors(repo, encoder: str) -> bool:
    """Whether the served export has chunk vectors (its attncal.json's `chunk_vectors`)."""
    try:
        return bool(json.loads((Path(repo) / encoder / "attncal.json").read_text()).get("chunk_vectors"))
    except (OSError, ValueError):
        return False


def _served(repo, encoder: str) -> str | None:
    """Which graph of the export the encoder model serves (recorded in its attncal.json)."""
    try:
        return json.loads((Path(repo) / encoder / "attncal.json").read_text())["triton"].get("graph")
    except (OSError, ValueError, KeyError):
        return None

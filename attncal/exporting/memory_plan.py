"""How much memory and disk an export will take, estimated before it starts, and the refusal when it cannot fit.

The estimate is a multiple of the model's float32 weight size per step, plus the interpreter and its
libraries.  The multiples are what the export's design allows (each step holds at most the weights it is
working on, memory-mapped or streamed, plus the step's own working set); docs/large-models.md gives the
per-step peaks measured against them.  An export whose estimate exceeds what is available is refused in one
line, before step 1, with what would fit; `--no-memory-check` exports anyway.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from ..memory import GIB, RELEASE_FROM_BYTES, available_bytes, float32_weight_bytes
from ..runtime.parity import ACTIVATION_SHARE

RUNTIME_BASE = 0.6 * GIB  # Python, torch, transformers, ONNX Runtime and onnx_ir loaded
PROTO_LIMIT = 2 * GIB  # protobuf's message limit: above it torch's TorchScript exporter writes external data
TORCHSCRIPT_STEP = "torch export (TorchScript, for ONNX Runtime's optimizer)"
# The native graph of a model ONNX Runtime does not fuse (attncal.graphs.placements.plain_attention_placement):
# the plain export's structure with its weights mapped as the graph is written, plus the mask probe (MASK_PROBE_FIXED).
NATIVE_PLAIN_STEP = "native graph (plain export)"
MASK_PROBE_FIXED = 0.25 * GIB
# Peak of each step, in float32 weight sizes, above RUNTIME_BASE.  The dynamo exporter holds the model and its
# exported program (weights shared), then writes the weights out.  Torch's TorchScript exporter holds the
# model and the ModelProto it builds; below PROTO_LIMIT the weights are inside that proto, which it
# serializes and hands Python as bytes: the model, the proto, its serialization and the bytes, for a moment.
# The optimizer's child holds ONNX Runtime's session of the graph.  The parity check holds one session (or
# the PyTorch reference) and the attention activations its batch planner allows
# (attncal.runtime.parity.ACTIVATION_SHARE of the weights), plus PARITY_FIXED (the reference's modules, the
# tokenizer, what earlier steps left allocated).
STEP_WEIGHTS = {
    "torch export (dynamo)": 1.6,
    TORCHSCRIPT_STEP: 2.5,
    "ONNX Runtime's optimizer": 2.5,
    "parity check": 1.0 + ACTIVATION_SHARE,
    NATIVE_PLAIN_STEP: 1.0,
}
TORCHSCRIPT_INLINE_WEIGHTS = 4.5  # TORCHSCRIPT_STEP below PROTO_LIMIT
# The int8 step: attncal's quantizer reads each graph's structure only and its weights a 16 MiB block at a time,
# and streams the int8 graph out (attncal.exporting.quantize; 0.08x at bge-m3's size).  Then the exporter re-stamps
# each quantized graph's digest (attncal.artifact.stamp_onnx), which parses a graph below 2 GiB whole and writes
# it again: about 4x the int8 graph (its bytes, the parsed message, its serialization).  An int8 graph keeps the
# embeddings float32: 0.65x the float32 weights for XLM-R (bge-m3: 2.75x measured), up to about 0.75x for the
# supported encoders with the largest embedding share (EmbeddingGemma's 65%).
QUANTIZE_STEP = "int8 quantization (attncal's streamed quantizer)"
QUANTIZE_WEIGHTS = 3.2
PARITY_FIXED = 0.25 * GIB
OPTIMIZER_CHILD = 0.15 * GIB  # the optimizer's child interpreter: Python, onnx, ONNX Runtime
# The dynamo export's child interpreter (Python, torch, transformers, onnxscript: 0.32 GiB resident before it
# loads the model), for a model the export runs in a child process (attncal.exporting.from_torch: from
# RELEASE_FROM_BYTES of weights); this process, without the model, stays at RUNTIME_BASE meanwhile.
TORCH_CHILD = 0.4 * GIB
DISK_WEIGHTS = 6.0  # the graphs (up to three) and their staged copies, beside OUT until the final rename


class ExportMemoryError(ValueError):
    """The export would not fit in the memory (or disk) available; the message says so in one line."""


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int  # float32 weight bytes
    steps: dict[str, int]  # step -> estimated peak bytes (interpreter included)
    disk: int
    options: dict  # what `estimate` was given, so a refusal can say what other options would need

    @property
    def peak(self) -> int:
        return max(self.steps.values())

    @property
    def largest_step(self) -> str:
        return max(self.steps, key=self.steps.__getitem__)


def estimate(model_dir: Path, *, exporter: str, optimized: bool, check: bool, fp16: bool = False,
             quantize: str | None = None, inlined: bool = False) -> MemoryEstimate:
    """The export's per-step peaks for a model whose weights are in `model_dir`, with these options."""
    w = float32_weight_bytes(model_dir)
    steps = {}
    first = "torch export (dynamo)" if exporter == "dynamo" else TORCHSCRIPT_STEP
    steps[first] = STEP_WEIGHTS[first]
    if optimized:
        steps[TORCHSCRIPT_STEP] = STEP_WEIGHTS[TORCHSCRIPT_STEP]
        steps["ONNX Runtime's optimizer"] = STEP_WEIGHTS["ONNX Runtime's optimizer"]
        steps[NATIVE_PLAIN_STEP] = STEP_WEIGHTS[NATIVE_PLAIN_STEP]  # where the optimizer does not fuse
    if quantize:
        steps[QUANTIZE_STEP] = QUANTIZE_WEIGHTS
    if check:
        steps["parity check"] = STEP_WEIGHTS["parity check"]
    if w < PROTO_LIMIT and TORCHSCRIPT_STEP in steps:
        steps[TORCHSCRIPT_STEP] = TORCHSCRIPT_INLINE_WEIGHTS
    fixed = {"parity check": PARITY_FIXED, "ONNX Runtime's optimizer": OPTIMIZER_CHILD, NATIVE_PLAIN_STEP: MASK_PROBE_FIXED}
    if exporter == "dynamo" and w >= RELEASE_FROM_BYTES:
        fixed["torch export (dynamo)"] = TORCH_CHILD
    per = {k: int(RUNTIME_BASE + v * w + fixed.get(k, 0)) for k, v in steps.items()}
    disk = DISK_WEIGHTS * w * (0.5 if fp16 else 1) + (w if inlined else 0)  # inlined graph: one more copy
    return MemoryEstimate(weights=w, steps=per, disk=int(disk),
                          options=dict(model_dir=model_dir, exporter=exporter, optimized=optimized, check=check,
                                       fp16=fp16, quantize=quantize, inlined=inlined))


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def check_fits(est: MemoryEstimate, out_parent: Path, *, optimized: bool, check: bool,
               available: int | None = None) -> None:
    """Refuse (ExportMemoryError, one line) an export whose estimate exceeds the memory or disk available."""
    available = available_bytes() if available is None else available
    if available is not None and est.peak > available:
        options = []  # (what to pass, why it needs less, the option changes)
        if est.options.get("quantize"):
            options.append(("no --quantize", "the int8 step holds each int8 graph while its digest is stamped",
                            dict(quantize=None)))
        if check:
            options.append(("--skip-check", "then run `attncal check` where more memory is free", dict(check=False)))
        if optimized:
            options.append(("--no-optimized", "no ORT-optimized graph, so no TorchScript export or optimizer run",
                            dict(optimized=False)))
        if check and optimized:
            options.append(("--skip-check --no-optimized", "no parity check and no optimized graph",
                            dict(check=False, optimized=False)))
        fits = []
        for flag, why, change in options:
            peak = estimate(**{**est.options, **change}).peak
            if peak <= available:
                fits.append(f"{flag} (about {_gib(peak)}; {why})")
        way = ("what would fit: " + ", or ".join(fits) if fits else
               "neither " + " nor ".join(flag for flag, _, _ in options) + " would fit" if options else "")
        raise ExportMemoryError(
            f"this export needs about {_gib(est.peak)} of memory at its largest step ({est.largest_step}; float32 "
            f"weights {_gib(est.weights)}) and {_gib(available)} is available; {way + '; ' if way else ''}--no-memory-check tries anyway")
    try:
        free = shutil.disk_usage(out_parent).free
    except OSError:
        return
    if est.disk > free:
        raise ExportMemoryError(f"this export needs about {_gib(est.disk)} of disk beside the output (graphs and "
                                f"their working copies) and {out_parent} has {_gib(free)} free: free some space or "
                                "write elsewhere (--no-memory-check to try anyway)")

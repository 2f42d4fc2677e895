"""What an export will do, decided and validated once, before anything is loaded or written.

`ExportPlan.make` reads the model's configuration (not its weights), refuses every conflict between the
options (`CONFLICTS`: one table, each entry with its message), resolves the pooling, the calibrated layers
and each graph's placement (`attncal.graphs.placements.plan`, which refuses a placement the calibration
config cannot take), and estimates the memory and disk of the export (`memory_plan`), refusing one that
does not fit.  The exporter's steps then only carry the plan out: a refusal never comes after a step has
started.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from ..calibration.config import CalibrationConfig
from ..graphs.placements.placement_names import CHOICES as PLACEMENTS
from ..modelinfo import ModelInfo, load_model_info
from ..pooling import Pooling
from . import chunk_vectors, memory_plan
from .memory_plan import MemoryEstimate
from .quantize import INT8_TARGETS, QUANTIZATIONS

EXPORTERS = ("dynamo", "torchscript")
# The stages an export's progress lines number ("[2/4] ..."), in the order its steps run them.
STAGES = (TORCH_EXPORT, GRAPHS, PARITY, WRITE) = ("torch export", "graphs", "parity", "write")
DEFAULT_OPSET = 18
MIN_OPSET = 18
# Placements that take a calibrated graph's precision as it is: an fp16 export converts the optimized graphs
# after placement (auto), and its portable graph takes softmax placement (the op computes in float32).
_FP32_PLACEMENTS = ("row", "split", "attention", "projected-attention")
_OPTIMIZED_ONLY = ("attention", "projected-attention")  # rewrite ONNX Runtime's fused attention


@dataclass
class ExportOptions:
    # Its pooling (attncal.pooling.Pooling; lmk / multi-cls / mean-every with their tokenization,
    # attncal.runtime.landmarks) applies even uncalibrated.
    config: CalibrationConfig = field(default_factory=CalibrationConfig)
    calibrate: bool = True
    opset: int = DEFAULT_OPSET
    fp16: bool = False
    max_length: int | None = None
    exporter: str = "dynamo"
    overwrite: bool = False
    check: bool = True
    placement: str = "auto"  # one of PLACEMENTS (attncal.graphs.placements)
    optimized: bool = True  # also write onnx/model_optimized.onnx where ORT's transformer optimizer applies
    # also write onnx/model_inlined.onnx, the portable graph's functions inlined (attncal.exporting.inline), where
    # the portable graph has functions (a calibrated export, but --placement split); one more copy of the weights
    inlined: bool = False
    quantize: str | None = None  # "int8": every written graph quantized (attncal.exporting.quantize)
    int8_target: str = "auto"  # the CPUs an int8 export is made for: one of INT8_TARGETS (attncal.exporting.quantize)
    memory_check: bool = True  # refuse before step 1 when the estimate exceeds the memory available (memory_plan)
    # every graph also takes chunk token spans and returns one vector per chunk (attncal.exporting.chunk_vectors)
    chunk_vectors: bool = False


@dataclass(frozen=True)
class Conflict:
    """Options an export refuses together: `applies` says when, `message` what the user reads, `example` a
    set of options that has this conflict and no earlier one (the documentation's and the tests' case)."""

    applies: Callable[[ExportOptions], bool]
    message: Callable[[ExportOptions], str]
    example: dict


def _one_of(what: str, choices: tuple[str, ...], value: object) -> str:
    return f"{what} must be one of {', '.join(choices)}, got {value!r}"


# In the order they are checked: the first that applies is the one reported.
CONFLICTS: tuple[Conflict, ...] = (
    Conflict(lambda o: o.exporter not in EXPORTERS, lambda o: _one_of("exporter", EXPORTERS, o.exporter),
             dict(exporter="jit")),
    Conflict(lambda o: o.opset < MIN_OPSET,
             lambda o: f"opset {o.opset} is not supported; attncal exports at opset >= {MIN_OPSET}", dict(opset=17)),
    Conflict(lambda o: o.placement not in PLACEMENTS, lambda o: _one_of("placement", PLACEMENTS, o.placement),
             dict(placement="nowhere")),
    Conflict(lambda o: o.placement in _FP32_PLACEMENTS and o.fp16 and o.calibrate,
             lambda o: f"--placement {o.placement} with --fp16: use --placement auto (softmax on the portable "
                       "graph, auto's choice on the optimized graphs, converted to fp16 after placement) or "
                       "--placement softmax", dict(placement="row", fp16=True)),
    Conflict(lambda o: o.quantize is not None and o.quantize not in QUANTIZATIONS,
             lambda o: _one_of("quantize", QUANTIZATIONS, o.quantize), dict(quantize="int4")),
    Conflict(lambda o: o.int8_target not in INT8_TARGETS, lambda o: _one_of("int8_target", INT8_TARGETS, o.int8_target),
             dict(int8_target="arm")),
    Conflict(lambda o: o.int8_target != "auto" and o.quantize is None,
             lambda o: f"--int8-target {o.int8_target} applies to int8 exports: add --quantize int8",
             dict(int8_target="vnni")),
    Conflict(lambda o: o.quantize is not None and o.fp16,
             lambda o: "--quantize int8 and --fp16 exclude each other (int8 weights, fp32 activations)",
             dict(quantize="int8", fp16=True)),
    Conflict(lambda o: o.max_length is not None and o.max_length < 2,
             lambda o: f"max_length must be >= 2, got {o.max_length}", dict(max_length=1)),
    Conflict(lambda o: o.placement in _OPTIMIZED_ONLY and o.calibrate and not o.optimized,
             lambda o: f"--placement {o.placement} rewrites the ORT-optimized graph; drop --no-optimized",
             dict(placement="attention", optimized=False)),
    Conflict(lambda o: o.placement == "projected-attention" and o.quantize is not None and o.calibrate,
             lambda o: "--placement projected-attention with --quantize int8: the int8 quantizer quantizes only "
                       "separate projection MatMuls; use --placement attention (or auto)",
             dict(placement="projected-attention", quantize="int8")),
)


def check_options(opts: ExportOptions) -> None:
    """Raise ValueError with the message of the first conflict in `CONFLICTS` that `opts` has."""
    for conflict in CONFLICTS:
        if conflict.applies(opts):
            raise ValueError(conflict.message(opts))


@dataclass(frozen=True)
class ExportPlan:
    """Everything the export's steps need to know before the first one starts."""

    info: ModelInfo
    opts: ExportOptions
    out: Path
    pooling: Pooling  # concrete; a landmark kind's token resolved against the model's tokenizer
    config: CalibrationConfig | None  # None: an uncalibrated export
    layers: list[int]
    placement: object | None  # attncal.graphs.placements.Plan of a calibrated export
    estimate: MemoryEstimate

    @property
    def precision(self) -> str:
        return "fp16" if self.opts.fp16 else (self.opts.quantize or "fp32")

    def off_config(self) -> CalibrationConfig:
        """No calibration (strength 0) with this export's pooling: what an uncalibrated native graph places."""
        return CalibrationConfig.off(self.pooling)

    @property
    def max_seq_length(self) -> int | None:
        """The export's max length (attncal.json's `max_seq_length`): the option's, else the model's."""
        return self.opts.max_length or self.info.max_seq_length

    @classmethod
    def make(cls, model, out, opts: ExportOptions) -> "ExportPlan":
        """Validate `opts` for `model` (a path or Hub id) and output `out`; raises before anything is written
        but an empty output directory's parent."""
        check_options(opts)
        import torch  # noqa: F401 - every export runs it: a runtime-only install stops here, before any read

        info = load_model_info(model)
        if opts.chunk_vectors:
            chunk_vectors.check_model(info)
        out = Path(out).expanduser().resolve()
        _check_out_dir(out, opts.overwrite)
        estimate = memory_plan.estimate(info.path, exporter=opts.exporter, optimized=opts.optimized,
                                        check=opts.check, fp16=opts.fp16, quantize=opts.quantize,
                                        inlined=opts.inlined and opts.calibrate)
        if opts.memory_check:
            memory_plan.check_fits(estimate, out.parent, optimized=opts.optimized, check=opts.check)
        pooling = _resolve_pooling(info, opts.config.pooling.bind(info.pooling))
        plan = cls(info, opts, out, pooling, None, [], None, estimate)
        config = replace(opts.config, pooling=pooling) if opts.calibrate else None
        layers = config.layer_indices(info.num_layers) if config is not None else []  # range errors first
        plan = replace(plan, config=config, layers=layers)
        return replace(plan, placement=_placement_plan(plan)) if config is not None else plan


def _resolve_pooling(info: ModelInfo, pooling: Pooling) -> Pooling:
    """The landmark token of `pooling` (its default: the model's SEP for lmk, CLS for multi-cls) and its id, from
    the model's tokenizer."""
    if not pooling.inserts:
        return pooling
    from transformers import AutoTokenizer

    return pooling.resolve(AutoTokenizer.from_pretrained(str(info.path)))


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists():
        if not out.is_dir():
            raise FileExistsError(f"output path {out} exists and is a file")
        if any(out.iterdir()) and not overwrite:
            raise FileExistsError(f"output directory {out} is not empty; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)


def _placement_plan(plan: ExportPlan):
    """Each graph's placement (`attncal.graphs.placements.plan`); an fp16 export's portable graph takes softmax
    placement, whose op computes in float32."""
    from ..graphs import placements  # lazy: onnx_ir and sympy, which ExportOptions and the CLI do not need

    chosen = placements.plan(plan.opts.placement, plan.config.resolve(), plan.precision)
    if plan.opts.fp16 and chosen.portable != "softmax":
        chosen = replace(chosen, portable="softmax", reason=chosen.reason + "; --fp16: the portable graph takes "
                         "softmax placement (its op computes in float32)")
    return chosen


def stage_label(stage: str) -> str:
    """"[i/n]": where `stage` comes among the export's `STAGES`."""
    return f"[{STAGES.index(stage) + 1}/{len(STAGES)}]"

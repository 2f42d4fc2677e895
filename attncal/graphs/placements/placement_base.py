"""The placement protocol, and the read-only graph helpers the placements' rules share.

A **placement** (`Placement`) is one way of inserting the calibration into an exported encoder graph,
named by `--placement`; the registry, `attncal.graphs.placements`, holds them all.  A placement is made
of **rules** (`Rule`), one rewrite each, each rule in a module of its own.  A rule rewrites one kind of
graph:

* `PLAIN`: explicit attention (scores MatMul -> scale/mask chain -> Softmax -> value MatMul), as
  torch.onnx exports it: the portable graph, standard ONNX that any runtime runs;
* `FUSED`: ONNX Runtime's optimized graph, each layer's attention one `com.microsoft::Attention` node.

A placement with a rule for each kind (row, split) picks the rule from the graph it is given (fused
attention nodes present or not); a placement with one rule hands it every graph, and the rule refuses
the other kind with a message that names the graph it needs.

Every rule works in two steps, as onnxscript's rewrite rules (`check`, then `rewrite`) and ONNX
Runtime's fusions (collect the nodes, then apply them) do:

* `check(model, config, num_layers) -> PlacementPlan | Refusal` runs every refusal, for every
  calibrated layer, and makes no edit, accepted or refused (the model serializes to the same bytes
  afterwards): a refused placement leaves the graph exactly as it was, and a caller may try another;
* `apply(model, plan) -> PlacementResult` makes the edits the plan lists, and cannot refuse.

`Placement.place(model, config, num_layers)` is the two together, raising the refusal as its error:
what the exporter calls.

The checks reuse helpers that raise (the attention walks, the softmax search, the ones below); a rule
names the error types that are its refusals (`Rule.refuses`), and its `check` turns exactly those into
a `Refusal`.  Any other exception is a bug and propagates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Generic, TypeVar

import onnx_ir as ir

from .attention_chain import inferred_shapes
from ..builder import graph_input
from ..ops.contract import ATTENTION_OP_TYPES, DOMAIN, PROJECTED_OP_TYPES
from .softmax_pattern import FUSED_ATTENTION_OPS

if TYPE_CHECKING:
    import numpy as np

    from ...calibration.config import CalibrationConfig, ResolvedCalibration
    from ..builder import Ops

PLAIN, FUSED = "plain", "fused"  # the kind of graph a rule rewrites
PORTABLE, OPTIMIZED = "portable", "optimized"  # the written graphs (onnx/model.onnx; the ORT-optimized ones)
PRECISIONS = frozenset({"fp32", "fp16", "int8"})  # export precisions

E = TypeVar("E")  # a rule's record of its edits
T = TypeVar("T")


@dataclass(frozen=True)
class PlacementResult:
    layers: list[int]
    op_type: str | None  # the ai.attncal op in the graph, None when the graph needs no custom op
    attrs: dict = field(default_factory=dict)  # the op's attributes (or the resolved config), without `layer`
    fused_attention: int = 0  # fused attention nodes outside subgraphs after placement


@dataclass(frozen=True)
class Refusal:
    """Why a placement does not apply: the error type callers catch, and the one-line message."""

    error: type[Exception]
    message: str

    def exception(self) -> Exception:
        return self.error(self.message)


def refused(call: Callable[[], T], refuses: tuple[type[Exception], ...]) -> T | Refusal:
    """`call()`, or the `Refusal` of the error it raised when that error is one of `refuses`."""
    try:
        return call()
    except refuses as exc:
        return Refusal(type(exc), str(exc))


@dataclass(frozen=True)
class PlacementPlan(Generic[E]):
    """What a rule's check found: everything its rewrite needs, so applying it neither searches nor refuses.

    Valid for the model it was made on, as it was then: the edits hold that model's nodes and values."""

    rule: Rule[E]  # the rule that made the plan, and applies it
    edits: E  # the rule's own record (a dataclass of the rule's module)


def accepted(outcome: PlacementPlan[E] | Refusal) -> PlacementPlan[E]:
    """The plan of a check, or its refusal raised as its error."""
    if isinstance(outcome, Refusal):
        raise outcome.exception()
    return outcome


@dataclass(frozen=True)
class Rule(Generic[E]):
    """One rewrite of one kind of graph (`PLAIN` or `FUSED`).

    `find(model, config, num_layers)` runs every refusal, raising one of `refuses`, and returns what to
    insert without editing the model; `rewrite(model, edits)` inserts it and returns the result."""

    graph: str
    find: Callable[[ir.Model, CalibrationConfig, int], E]
    rewrite: Callable[[ir.Model, E], PlacementResult]
    refuses: tuple[type[Exception], ...]

    def __post_init__(self) -> None:
        if self.graph not in (PLAIN, FUSED):
            raise ValueError(f"a rule rewrites a {PLAIN} or a {FUSED} graph, not {self.graph!r}")

    def check(self, model: ir.Model, config: CalibrationConfig, num_layers: int) -> PlacementPlan[E] | Refusal:
        edits = refused(lambda: self.find(model, config, num_layers), self.refuses)
        return edits if isinstance(edits, Refusal) else PlacementPlan(self, edits)

    def apply(self, model: ir.Model, plan: PlacementPlan[E]) -> PlacementResult:
        if plan.rule is not self:
            raise ValueError("a placement plan is applied by the rule that made it")
        return self.rewrite(model, plan.edits)


def no_request_refusal(rc: ResolvedCalibration, precision: str) -> Refusal | None:
    """A placement that takes every calibration config at every precision it lists."""
    return None


@dataclass(frozen=True)
class Placement:
    """A calibration placement: its rules, and what the exporter needs to know to use it.

    * `name`: what `--placement` and `attncal.json` call it (`placement_names`).
    * `rules`: at most one per kind of graph (`Rule.graph`); `rule_for` picks one for a model.
    * `graphs`: the written graphs it may be planned for: `PORTABLE` (onnx/model.onnx) and/or `OPTIMIZED`
      (the ORT-optimized graph and the native graph).  A placement that rewrites ONNX Runtime's fused
      attention only (attention, projected-attention) lists `OPTIMIZED` alone, and `placements.plan` gives
      the portable graph another placement.
    * `precisions`: the export precisions (`PRECISIONS`) it may be planned for.
    * `optimize_first`: how its ORT-optimized graph is made.  True: optimize the uncalibrated export, then
      place (row, split, attention: the placement keeps, or itself replaces, the fused attention nodes).
      False: place on the plain graph, then optimize (softmax, fused-softmax: the calibrated layers stay
      unfused, since the op sits between Softmax and the value MatMul where the fuser looks).
    * `float32_nodes`: the node-name prefix of the calibration math it writes in standard ops, which a
      float16 conversion of the optimized graph keeps in float32 (`attncal.exporting.fp16`); None where an
      ai.attncal op computes the calibration in float32 whatever its input type.
    * `check_request(rc, precision)`: the refusal of an explicit request for a calibration config and
      export precision, decided before any graph exists (`placements.plan` runs it), or None.
    """

    name: str
    rules: tuple[Rule, ...]
    graphs: frozenset[str]
    precisions: frozenset[str]
    optimize_first: bool
    float32_nodes: str | None
    check_request: Callable[[ResolvedCalibration, str], Refusal | None] = no_request_refusal

    def __post_init__(self) -> None:
        kinds = [r.graph for r in self.rules]
        if not kinds or len(set(kinds)) != len(kinds):
            raise ValueError(f"placement {self.name}: one or more rules, at most one per kind of graph; got {kinds}")
        if not self.graphs or not self.graphs <= {PORTABLE, OPTIMIZED}:
            raise ValueError(f"placement {self.name}: graphs must be {PORTABLE} and/or {OPTIMIZED}, got {self.graphs}")
        if not self.precisions or not self.precisions <= PRECISIONS:
            raise ValueError(f"placement {self.name}: precisions must be among {sorted(PRECISIONS)}, "
                             f"got {sorted(self.precisions)}")

    def rule_for(self, model: ir.Model) -> Rule:
        """The rule for this model's kind of graph; with one rule, that rule (which refuses the other kind)."""
        kind = FUSED if has_fused_attention(model) else PLAIN
        return next((r for r in self.rules if r.graph == kind), self.rules[0])

    def check(self, model: ir.Model, config: CalibrationConfig, num_layers: int) -> PlacementPlan | Refusal:
        """Every refusal of this placement on `model`, for every calibrated layer; makes no edit."""
        return self.rule_for(model).check(model, config, num_layers)

    def apply(self, model: ir.Model, plan: PlacementPlan) -> PlacementResult:
        """The edits of `plan`, made by `check` on this model as it still is."""
        if not any(r is plan.rule for r in self.rules):
            raise ValueError(f"the plan is not one of placement {self.name}'s rules")
        return plan.rule.apply(model, plan)

    def place(self, model: ir.Model, config: CalibrationConfig, num_layers: int) -> PlacementResult:
        """Check, raise the refusal, apply: calibrate `model` in place (or leave it untouched and raise)."""
        return self.apply(model, accepted(self.check(model, config, num_layers)))


def checked_on_inferred_shapes(model: ir.Model, check: Callable[[], T]) -> T:
    """`check()` run while `model` carries ONNX's inferred shapes and types, which are taken off again
    afterwards whatever the outcome.

    Why: the plain rules' checks need ranks and dtypes that exports leave unannotated, and a check makes
    no edit.  Its rewrite infers them again (`keep_inferred_shapes`): the same annotations, since the
    model is unchanged in between, and the rewrite's own reads of ranks see what the check saw.
    `attention_chain.inferred_shapes` keeps its annotations only when its block completes; `_Undo` ends
    the block of a check that passed, so that one restoring code serves both outcomes."""
    outcome: list[T] = []
    try:
        with inferred_shapes(model):
            outcome.append(check())
            raise _Undo
    except _Undo:
        pass
    return outcome[0]


class _Undo(Exception):
    """Ends an `inferred_shapes` block whose check passed, so that its annotations are taken off."""


def keep_inferred_shapes(model: ir.Model) -> None:
    """Annotate `model` with ONNX's inferred shapes and types, as its plain rule's check saw them; the
    rewrite reads ranks from them, and the written graph keeps them."""
    with inferred_shapes(model):
        pass


# Read-only graph helpers of the rules' checks and rewrites: none of them edits the model.
def count_fused_attention(model: ir.Model) -> int:
    """Fused attention nodes that compute a layer's attention (the ones a calibration must not lose):
    ONNX Runtime's, and the calibrated attention ops that replace them (one pass over the keys too)."""
    # Main graph only: split placement's per-basket calls live inside a Loop body.
    return sum(1 for n in model.graph if (n.domain == "com.microsoft" and n.op_type in FUSED_ATTENTION_OPS)
               or (n.domain == DOMAIN and n.op_type in ATTENTION_OP_TYPES + PROJECTED_OP_TYPES))


def fused_attention_nodes(graph: ir.Graph) -> list[ir.Node]:
    """The ORT-fused `com.microsoft::Attention` nodes of a graph, in graph (= layer) order."""
    return [n for n in graph if n.op_type == "Attention" and n.domain == "com.microsoft"]


def has_fused_attention(model: ir.Model) -> bool:
    return bool(fused_attention_nodes(model.graph))


def fused_layers(model: ir.Model, num_layers: int, mask_input: str, error: type[Exception], need: str,
                 hint: str = "") -> tuple[list[ir.Node], ir.Value]:
    """(one fused Attention node per layer, the attention-mask input) of an uncalibrated optimized graph,
    or `error` saying what is wrong: `need` starts the message, `hint` ends it."""
    graph = model.graph
    if any(n.domain == DOMAIN for n in graph):
        raise error("the graph already contains attncal calibration nodes")
    atts = fused_attention_nodes(graph)
    if len(atts) != num_layers:
        raise error(f"{need} one fused com.microsoft::Attention node per layer ({num_layers}); found {len(atts)}{hint}")
    return atts, graph_input(graph, mask_input, error)


def fused_attention_parts(att: ir.Node, error: type[Exception]) -> tuple[ir.Value, np.ndarray, np.ndarray, int, float]:
    """(x, packed QKV weight [hidden, 3*hidden], bias [3*hidden], num_heads, scale) of an ORT-fused
    `com.microsoft::Attention` encoder node; raises `error` for anything else (the placements
    rebuild the layer from these alone, so anything they do not carry would be lost)."""
    import numpy as np

    x, w, bias = att.inputs[0], att.inputs[1], att.inputs[2]
    if w is None or w.const_value is None or bias is None or bias.const_value is None:
        raise error(f"fused Attention {att.name}: packed QKV weight and bias must be initializers")
    if len(att.inputs) > 4 and att.inputs[4] is not None:
        raise error(f"fused Attention {att.name} has a past state; not an encoder layer")
    extra = {a for a in att.attributes} - {"num_heads", "scale", "mask_filter_value"}
    if extra:
        raise error(f"fused Attention {att.name} has unsupported attributes {sorted(extra)}")
    heads = att.attributes.get_int("num_heads")
    W, bvec = w.const_value.numpy(), bias.const_value.numpy()
    head = W.shape[1] // 3 // heads
    scale = att.attributes.get_float("scale", 0.0) or 1.0 / float(np.sqrt(head))
    return x, W, bvec, heads, scale


def qkv_projections(ops: Ops, x: ir.Value, W: np.ndarray, bias: np.ndarray) -> tuple[ir.Value, ir.Value, ir.Value]:
    """The Q, K and V projections a fused `Attention` node packs ([hidden, 3*hidden] weight), as three
    MatMul + Add: the same FLOPs as inside the fused node, and [B,S,hidden] outputs in the BSD layout
    that `MultiHeadAttention` and the calibrated attention ops take."""
    import numpy as np

    hidden = W.shape[1] // 3
    out = []
    for i, name in enumerate("qkv"):
        Wi = np.ascontiguousarray(W[:, i * hidden : (i + 1) * hidden])
        bi = np.ascontiguousarray(bias[i * hidden : (i + 1) * hidden])
        out.append(ops("Add", ops("MatMul", x, ops.const(f"w{name}", Wi)), ops.const(f"b{name}", bi)))
    return out[0], out[1], out[2]

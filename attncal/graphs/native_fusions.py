"""Fusions of a plain export's native graph into ONNX Runtime's own ops: the RMS normalization of the hidden
state into `SimplifiedLayerNormalization`, the tanh GELU into `com.microsoft.FastGelu`.

Why: ONNX Runtime fuses neither at load time in torch's export of Gemma3, Qwen3 or T5 (the export writes
the norm as Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul; the GELU with Pow and Tanh), so every norm
and activation runs as separate element-wise passes over the hidden state.  The rules are onnxscript's
(`onnxscript.rewriter.ort_fusions`); this module picks which apply.

Only the native graph gets them: it already needs ONNX Runtime (with the attncal library), while the
portable graph stays standard ONNX.  The per-head norms of Q and K (Qwen3's and Gemma3's q_norm / k_norm,
rank 4) stay unfused: they sit inside the rotary chain, where ONNX Runtime moves transposes through
element-wise ops and merges the rotation's two Slices into one Split; a contrib op there stops both, and
ONNX Runtime's profile showed those losses eating the fusion's gain.  Run before
`load_time_fusions.drop_intermediate_shapes`: the rank comes from the shapes torch's exporter records.

`SimplifiedLayerNormalization` is registered by ONNX Runtime in the ONNX domain, where `onnx.checker` does not
know it; `describe_to_onnx_checker` gives the checker ONNX Runtime's signature of it, so the exporter's check
of the graph still runs on every other node."""

from __future__ import annotations

from dataclasses import dataclass

HIDDEN_RANK = 3  # [batch, sequence, hidden]
RMS_NORM_OP = "SimplifiedLayerNormalization"  # ONNX Runtime's, in the ONNX domain (contrib_defs.cc)


@dataclass(frozen=True)
class FusionCounts:
    rms_normalization: int
    fast_gelu: int

    def as_dict(self) -> dict[str, int]:
        return {RMS_NORM_OP: self.rms_normalization, "FastGelu": self.fast_gelu}


def _hidden_state_rms_rules():
    """onnxscript's RMS-normalization rules, restricted to an input of rank HIDDEN_RANK."""
    from onnxscript.rewriter import pattern
    from onnxscript.rewriter.ort_fusions.rms_normalization import RmsNormFusion

    class HiddenStateRmsNorm(RmsNormFusion):
        def check(self, op, x, scale, epsilon, compute_dtype, target_dtype, **rest):
            result = super().check(op, x, scale, epsilon, compute_dtype, target_dtype, **rest)
            rank = None if x.shape is None else x.shape.rank()
            if result and rank != HIDDEN_RANK:
                return result.fail(f"input of rank {rank}, not the hidden state's {HIDDEN_RANK}", x)
            return result

    return pattern.RewriteRuleSet([HiddenStateRmsNorm.rule("HiddenStateRmsNorm1", _mul_order=False),
                                   HiddenStateRmsNorm.rule("HiddenStateRmsNorm2", _mul_order=True)])


def fuse_for_onnxruntime(model) -> FusionCounts:
    """Fuse `model` (an onnx_ir.Model, the native graph of a plain export, shapes still recorded) in place."""
    from onnxscript.rewriter import pattern
    from onnxscript.rewriter.ort_fusions.gelu import GeluTanhFusion

    rms = _hidden_state_rms_rules().apply_to_model(model)
    gelu = pattern.RewriteRuleSet([GeluTanhFusion.rule()]).apply_to_model(model)
    return FusionCounts(rms, gelu)


def describe_to_onnx_checker() -> None:
    """Register ONNX Runtime's signature of `SimplifiedLayerNormalization` (ONNX domain, version 1) with
    `onnx.defs` unless it is known; the checker then checks those nodes' inputs and outputs too."""
    import onnx.defs as defs

    if defs.has(RMS_NORM_OP):
        return
    P, A = defs.OpSchema.FormalParameter, defs.OpSchema.Attribute
    optional = defs.OpSchema.FormalParameterOption.Optional
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]
    defs.register_schema(defs.OpSchema(
        RMS_NORM_OP, "", 1, "ONNX Runtime's RMS normalization (contrib_defs.cc).",
        inputs=[P("X", "T"), P("scale", "V")],
        outputs=[P("Y", "V"), P("inv_std_var", "U", param_option=optional)],
        type_constraints=[("T", floats, "input"), ("U", ["tensor(float)", "tensor(double)"], "statistics"),
                          ("V", floats, "output and scale")],
        attributes=[A("axis", defs.OpSchema.AttrType.INT, "normalized from this axis on", required=False),
                    A("epsilon", defs.OpSchema.AttrType.FLOAT, "added to the mean square", required=False),
                    A("stash_type", defs.OpSchema.AttrType.INT, "type of the statistics", required=False)]))

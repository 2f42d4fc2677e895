"""Fusions of a plain export's native graph into ONNX Runtime's own ops: the rotary embeddings of Q and K into
`com.microsoft.RotaryEmbedding` (`rotary_fusion`), the RMS normalizations into `SimplifiedLayerNormalization`,
the tanh GELU into `com.microsoft.FastGelu`.

Why: ONNX Runtime fuses none of them at load time in torch's export of Gemma3, Qwen3, ModernBERT or T5 (the
export writes the norm as Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul; the GELU with Pow and Tanh; the
rotation with Slices, Neg, Concat), so each runs as separate element-wise passes.  The norm and GELU rules are
onnxscript's (`onnxscript.rewriter.ort_fusions`); this module picks which apply.

Only the native graph gets them: it already needs ONNX Runtime (with the attncal library), while the
portable graph stays standard ONNX.  The rotations go first: fused, they feed the attention op in [B,S,N·D]
without Transposes, so the per-head norms of Q and K (Qwen3's q_norm / k_norm, rank 4) then sit between
Reshapes and fuse too.  A per-head norm that reads a Transpose's output (Gemma3 normalises after transposing
to [B,N,S,D]) stays unfused: ONNX Runtime moves Transposes through its element-wise ops and cancels them,
which a fused node would stop.  Run before `load_time_fusions.drop_intermediate_shapes`: ranks and head
counts come from the shapes torch's exporter records.

`SimplifiedLayerNormalization` is registered by ONNX Runtime in the ONNX domain, where `onnx.checker` does not
know it; `describe_to_onnx_checker` gives the checker ONNX Runtime's signature of it, so the exporter's check
of the graph still runs on every other node."""

from __future__ import annotations

HIDDEN_RANK = 3  # [batch, sequence, hidden]
PER_HEAD_RANK = 4  # [batch, sequence, heads, head size], or heads before sequence after a Transpose
RMS_NORM_OP = "SimplifiedLayerNormalization"  # ONNX Runtime's, in the ONNX domain (contrib_defs.cc)


def _rms_rules():
    """onnxscript's RMS-normalization rules, restricted to the hidden state (rank HIDDEN_RANK) and to per-head
    norms (rank PER_HEAD_RANK) with no Transpose on either side."""
    from onnxscript.rewriter import pattern
    from onnxscript.rewriter.ort_fusions.rms_normalization import RmsNormFusion

    class LayoutAwareRmsNorm(RmsNormFusion):
        def check(self, context, x, scale, epsilon, compute_dtype, target_dtype, **rest):
            result = super().check(context, x, scale, epsilon, compute_dtype, target_dtype, **rest)
            rank = None if x.shape is None else x.shape.rank()
            if result and rank not in (HIDDEN_RANK, PER_HEAD_RANK):
                return result.fail(f"input of rank {rank}, neither the hidden state's nor per head", x)
            neighbours = [x.producer()] + [use.node for out in context.output_values for use in out.uses()]
            if result and rank == PER_HEAD_RANK and any(n is not None and n.op_type == "Transpose"
                                                        for n in neighbours):
                return result.fail("a per-head norm beside a Transpose, which ONNX Runtime moves through the "
                                   "unfused norm's element-wise ops", x)
            return result

    return pattern.RewriteRuleSet([LayoutAwareRmsNorm.rule("LayoutAwareRmsNorm1", _mul_order=False),
                                   LayoutAwareRmsNorm.rule("LayoutAwareRmsNorm2", _mul_order=True)])


def fuse_norms_and_gelus(model) -> dict[str, int]:
    """Fuse the RMS norms and tanh GELUs of `model` (an onnx_ir.Model, the native graph of a plain export, shapes
    still recorded, its rotations already fused: `rotary_fusion`) in place; how many of each op it wrote."""
    from onnxscript.rewriter import pattern
    from onnxscript.rewriter.ort_fusions.gelu import GeluTanhFusion

    from onnx_ir.passes.common import RemoveUnusedNodesPass

    rms = _rms_rules().apply_to_model(model)
    gelu = pattern.RewriteRuleSet([GeluTanhFusion.rule()]).apply_to_model(model)
    # The rules leave the constants only the replaced nodes read (ONNX Runtime warns of each at load).
    RemoveUnusedNodesPass()(model)
    return {RMS_NORM_OP: rms, "FastGelu": gelu}


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

"""Fusions of a plain export's native graph into ONNX Runtime's own ops: the rotary embeddings of Q and K into
`com.microsoft.RotaryEmbedding` (`rotary_fusion`), the RMS normalizations into `SimplifiedLayerNormalization`,
the tanh GELU into `com.microsoft.FastGelu`.

Why: ONNX Runtime fuses none of them at load time in torch's export of Gemma3, Qwen3, ModernBERT or T5 (the
export writes the norm as Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul; the GELU with Pow and Tanh; the
rotation with Slices, Neg, Concat), so each runs as separate element-wise passes.  The GELU rule is onnxscript's
(`onnxscript.rewriter.ort_fusions`), the norm rule onnxscript's pattern with this module's layout checks.

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
    """RMS-normalization rules, restricted to the hidden state (rank HIDDEN_RANK) and to per-head norms (rank
    PER_HEAD_RANK) with no Transpose on either side.

    The pattern, the checks of the types and the rewrite are onnxscript's `RmsNormFusion`'s (0.7), written
    against its public pattern API: onnxscript chooses the final product's operand order with a private keyword
    of its constructor, which this rule takes as its own `scale_first`."""
    import onnx_ir as ir
    from onnxscript.rewriter import pattern

    floats = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}
    compute_floats = {ir.DataType.FLOAT, ir.DataType.DOUBLE}

    def scalar(value) -> float | None:
        tensor = value.const_value if value is not None else None
        if tensor is None or tensor.size != 1:
            return None
        item = tensor.numpy().reshape(()).item()
        return item if isinstance(item, float) else None

    class LayoutAwareRmsNorm(pattern.RewriteRuleClassBase):
        def __init__(self, name: str, scale_first: bool) -> None:
            super().__init__(name)
            self.scale_first = scale_first

        def pattern(self, op, x, scale, epsilon, compute_dtype, target_dtype):
            x = pattern.OrValue([op.Cast(x, to=compute_dtype), x])
            mean_square = op.ReduceMean(op.Pow(x, 2.0), [-1], keepdims=1, noop_with_empty_axes=0)
            normalized = op.Mul(x, op.Reciprocal(op.Sqrt(op.Add(mean_square, epsilon))))
            normalized = pattern.OrValue([op.Cast(normalized, to=target_dtype), normalized])
            scale = pattern.OrValue([op.Cast(scale, to=compute_dtype), scale])
            return op.Mul(scale, normalized) if self.scale_first else op.Mul(normalized, scale)

        def check(self, context, x, scale, epsilon, compute_dtype, target_dtype, **rest):
            result = pattern.MatchResult()
            if scalar(epsilon) is None:
                return result.fail("epsilon is not a float scalar", epsilon)
            if x.dtype not in floats or scale.dtype not in floats:
                return result.fail("input or scale is not a float type", x)
            self.stash_type = compute_dtype.as_int() if compute_dtype is not None else x.dtype
            if self.stash_type not in compute_floats:
                return result.fail("the normalization is not computed in float or double")
            rank = None if x.shape is None else x.shape.rank()
            if rank not in (HIDDEN_RANK, PER_HEAD_RANK):
                return result.fail(f"input of rank {rank}, neither the hidden state's nor per head", x)
            neighbours = [x.producer()] + [use.node for out in context.output_values for use in out.uses()]
            if rank == PER_HEAD_RANK and any(n is not None and n.op_type == "Transpose" for n in neighbours):
                return result.fail("a per-head norm beside a Transpose, which ONNX Runtime moves through the "
                                   "unfused norm's element-wise ops", x)
            return result

        def rewrite(self, op, x, scale, epsilon, **_):
            return op.SimplifiedLayerNormalization(x, scale, axis=-1, epsilon=scalar(epsilon),
                                                   stash_type=self.stash_type)

    return pattern.RewriteRuleSet([LayoutAwareRmsNorm.rule("LayoutAwareRmsNorm1", scale_first=True),
                                   LayoutAwareRmsNorm.rule("LayoutAwareRmsNorm2", scale_first=False)])


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

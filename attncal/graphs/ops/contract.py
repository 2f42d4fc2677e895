"""The calibration op contract: a fixed interface shared by the function body, the ORT custom-op
library and the TensorRT plugin.

Domain `ai.attncal`, version 1: four calibration op types (`OP_TYPES`, below) and
two calibrated attention ops (`ATTENTION_OP_TYPES`, at the end of this text).

* `PooledRowCalibration`: calibrates the pooling row only (cls or last pooling).
* `AllRowsCalibration`: calibrates every valid query row (mean pooling), or with
  `marked_rows` = 1 the marked rows (lmk, multi-cls and mean-every pooling; below).

Inputs: `probs` T[B,H,Q,K] (post-softmax attention of one layer, Q == K; for
`PooledRowCalibration` also Q == 1, meaning the single row *is* the pooling row,
as produced by row placement) and
`attention_mask` int64[B,K]; T is float or float16.  Output: T[B,H,Q,K]; only
the calibrated rows differ from `probs`.  Every attribute below is present on
every exported node.

* `SoftmaxPooledRowCalibration`, `SoftmaxAllRowsCalibration`: the same two
  calibrations fused with the attention Softmax.  Input `scores` T[B,H,Q,K] is
  the Softmax's input (scaled, masked logits); the output is
  `<op>(Softmax(scores, axis=-1), attention_mask)` with `<op>`'s attributes.
  Why: a separate op costs one more read and write of the probabilities; fused,
  the calibration rides on the softmax's own pass over the row.

Marked rows (landmark, multi-CLS and Mean@k pooling pool many rows, and those are the
rows to calibrate).  The all-rows ops take four optional attributes, written only
where they differ from their defaults (`ROW_SET_DEFAULTS`), so graphs without them
keep their meaning and run on libraries built before them:

* `marked_rows` (0): 1 = calibrate only the query rows q whose `attention_mask[b,q]`
  is `ROW_MARK` (2): a valid token marked as pooled.  Every non-zero mask value
  is a valid key as before; the graph derives the marks from `input_ids` and
  `attention_mask` (`attncal.graphs.placements.row_marks`), so the ops keep their inputs.
  Why in the mask and not an input of its own: the calibrated attention ops'
  `relative_bias` is already an optional input, and ONNX Runtime's custom-op API
  and TensorRT's plugins take no absent input before a present one; the mask is
  read by every kernel anyway, so the rows cost no extra pass.
* `isolate_self` (0), `self_mode` (0 = equal, 1 = original, 2 = fixed),
  `self_weight` (0.0): 1 = each calibrated row's own key (key q of query row q:
  its pooling token) is isolated with that share.  Where the own key is the
  isolated first or last key, it takes the self share in that key's place;
  otherwise it leaves its basket (the basket's mass A_k is summed without it)
  and t counts it as one more isolated key.  Step 8 (the budget) applies where
  one of the row's isolated keys takes a share that is not `equal`.  The baskets
  themselves stay the item's, the same for every row.  Needs `marked_rows` = 1.
* The pooled-row ops take the four at their defaults only.

Rows that are fully masked or not finite.  The ops follow the graph they
replace.  The function body, the native CPU kernels (in place and out of
place) and the PyTorch path `attncal.calibration.apply` give what the float64
oracle `attncal.calibration.reference` gives, row kind by row kind
(`tests/test_masked_rows.py`); the CUDA kernels follow the same rules
(`plugins/kernels/cuda/calibration_cuda.h`; compiled in CI, never run here):

* Scores all -inf (a fully masked row of an additive -inf mask), or holding a
  NaN or +inf: ONNX Softmax has no value for such a row; ONNX Runtime's Softmax
  and torch.softmax give NaN at every key.  So do the Softmax-fused ops, for
  every key of the row, calibrated or not: exactly Softmax followed by the
  separate op.
* Scores all the dtype's lowest finite value (how transformers masks): the
  softmax is the uniform row, 1/K at each of the K keys, masked keys included;
  a calibrated such row is then calibrated as usual (masked keys are excluded
  by `attention_mask`, not by the scores: they come out 0).  Scores partly
  -inf with the valid keys finite are ordinary rows (exp(-inf) = 0).
* Separate ops: a calibrated row that holds a NaN or an infinity at any of its
  K keys, masked keys included, comes back NaN at every key (no probability
  row holds either; the ones after a fully masked Softmax are all NaN).  A row
  that is not calibrated (another query row, a padding query row, an item too
  short to calibrate, strength 0) is returned as it is, NaN included.
* No op turns a NaN into a finite value or a finite row into NaN, and one
  row's NaN never reaches another row or head.

A one-pass attention op (Softmax and the product with V in one kernel) must
state its own rule for a fully masked row: FlashAttention returns 0 for it,
ONNX Runtime's MultiHeadAttention and torch's scaled_dot_product_attention
differ by backend, so "the graph it replaces" does not decide it by itself.
The calibrated attention ops below state theirs.

Calibrated attention: `PooledRowCalibratedAttention` and
`AllRowsCalibratedAttention`, the whole attention of one layer with the
calibration of `PooledRowCalibration` / `AllRowsCalibration` inside.  The
attention placement (`attncal.graphs.placements.attention_placement`) writes them into the
ORT-optimized graph; the native CPU kernel is
`plugins/kernels/cpu/calibrated_attention.h` (tests/test_calibrated_attention_kernel.py),
the CUDA kernel `plugins/kernels/cuda/attention_tiled.cuh` (compiled in CI,
never run on a GPU yet).

* Inputs (ONNX Runtime `com.microsoft::MultiHeadAttention`'s unpacked layout,
  BSNH stored as BSD): `query` T[B,S_q,N*D], `key` T[B,S_k,N*D], `value`
  T[B,S_k,N*D_v], `attention_mask` int64[B,S_k] (1 = valid key, 0 = padding,
  as the other ops take it); T is float or float16.  `AllRowsCalibratedAttention`
  needs S_q == S_k (self-attention: query row q is token q);
  `PooledRowCalibratedAttention` S_q == S_k or S_q == 1 (the single query is
  the pooling token's, as row placement computes it).
* Attributes: every attribute of the calibration op (`pool_last` on the pooled
  op only), plus `num_heads` (N >= 1; the last dimension of `query` is N·D),
  `scale` (0 means 1/sqrt(D)), and the optional geometry (`AttentionGeometry`;
  written only where it differs from its default):
  - `num_kv_heads` (N_kv, dividing N; 0 means N): `key` is [B,S_k,N_kv*D] and
    `value` [B,S_k,N_kv*D_v]; query head h reads key/value head
    h // (N / N_kv) (grouped-query attention, as transformers' repeat_kv).
  - `window_left`, `window_right` (-1 = no limit): query row q sees key k only
    when q - window_left <= k <= q + window_right (window_right 0 is causal
    attention; both are sliding windows).  Needs S_q == S_k.
  - `relative_max_distance` (0 = none): a relative position bias (T5's encoder,
    MPNet), with the optional fifth input `relative_bias` T[num_buckets,N], the
    model's bias table: every score of head h at query q and key k gets
    relative_bias[bucket(k - q), h], the bucket function being T5's bidirectional
    one with `num_buckets` (>= 4) and this max distance (above num_buckets // 4;
    written once, in `attncal.calibration.relative_position`).  Needs S_q == S_k.
    The op computes the buckets itself, so no [N,S_q,S_k] bias tensor exists.  A
    node takes the input exactly when the attribute is set; the model's function
    for the op then has the five inputs (`make_function(..., relative_bias=True)`).
* Output: `context` T[B,S_q,N*D_v], heads merged in the same layout.
* Semantics, per batch item b and head h (q, k, v: that head's D or D_v
  columns), computed in float32 for both T (float16 inputs are cast to float32
  exactly, only the context is rounded to float16; the calibration math is in
  float32 for float16 inputs as in every body):
      scores[b,h] = scale·q·kᵀ + rel_bias[h] + mask_bias[b]   float32 [S_q,S_k]
      rel_bias[h,q,k] = float32(relative_bias[bucket(k - q), h]), or 0 without it
      mask_bias[b,q,k] = 0 for a valid key inside q's window, float32's
                       lowest finite value (-3.4028235e38) for a masked key
                       or one outside the window (once, not twice), added
                       (as transformers masks, in its compute dtype)
      probs = <Softmax-fused op>(scores, attention_mask)   (same attributes)
      context[b,:,h] = probs[b,h]·v
  The middle step is exactly `SoftmaxPooledRowCalibration` /
  `SoftmaxAllRowsCalibration` on the [B,N,S_q,S_k] scores: the same rows are
  calibrated, with the same rules for fully masked and non-finite rows.  The
  calibration's baskets come from `attention_mask` alone, as in the graphs the
  op replaces (their calibration op reads the windowed probabilities and the
  padding mask): a key outside a calibrated row's window has probability 0 and
  takes its basket's share like any valid key of probability 0.
  A row that sees no valid key (a fully masked item, or a window holding only
  padding) has every score at the lowest value: it is uniform over all S_k
  keys, as transformers' masked softmax gives.
* Fully masked rows.  With the lowest-finite additive mask, a row whose keys are
  all masked (an item with no valid key: every row of it) has all scores equal
  to the lowest value (s + lowest rounds to lowest for any |s| < 1e31), so its
  softmax is the uniform row 1/S_k and its context is the mean of v over all
  S_k keys; it is never calibrated (an item without a valid token has no
  calibrated row).  Not 0 as in FlashAttention, not NaN.  A padding query row
  (the query at a padding position, with valid keys) is an ordinary row: plain
  attention over the valid keys, not calibrated.  A row whose scores hold a NaN
  or +inf (a NaN in its query or in any key of the item, masked keys included,
  gives one) has the Softmax-fused op's all-NaN probabilities, hence a NaN
  context row; scores that are -inf at some keys only make an ordinary row
  (exp(-inf) = 0).  A NaN or an infinity in `value` makes that item's and
  head's context non-finite in every row (0·NaN and 0·inf are NaN at keys of
  probability 0), as the unfused graph's MatMul does.

Calibrated attention with the projection inside: `PooledRowCalibratedProjectedAttention` and
`AllRowsCalibratedProjectedAttention`, what ONNX Runtime's `com.microsoft::Attention` is to its
`MultiHeadAttention`.  Why: ONNX Runtime plans the separate Q, K and V projections of the graph as
tensors of its memory pattern, which needs 6-27 % more peak memory than the fused `Attention`,
whose projection lives in scratch (docs/native-kernels.md); this op keeps it in scratch too.

* Inputs: `input` float[B,S,H_in] (the layer's hidden states), `weight` float[H_in,3*N*D] and
  `bias` float[3*N*D] (ONNX Runtime `Attention`'s packed layout: the Q, K and V columns one after
  the other), `attention_mask` int64[B,S].  float32 only.
* Attributes and output: those of the calibrated attention op of the same calibration; the output
  is `context` float[B,S,N*D].
* Semantics: qkv = input·weight + bias in float32 (a float32 matrix product, whose summation
  order is the implementation's as for MatMul, then the bias added), split into query, key and
  value along the last axis, then exactly the calibrated attention op above on them (S_q == S_k).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...calibration.config import ResolvedCalibration
from ...pooling import Pooling

DOMAIN = "ai.attncal"
VERSION = 1
POOLED_OP = "PooledRowCalibration"
ALL_ROWS_OP = "AllRowsCalibration"
SOFTMAX_POOLED_OP = "SoftmaxPooledRowCalibration"
SOFTMAX_ALL_ROWS_OP = "SoftmaxAllRowsCalibration"
OP_TYPES = (POOLED_OP, ALL_ROWS_OP, SOFTMAX_POOLED_OP, SOFTMAX_ALL_ROWS_OP)
ATTENTION_POOLED_OP = "PooledRowCalibratedAttention"
ATTENTION_ALL_ROWS_OP = "AllRowsCalibratedAttention"
# The attention placement writes these; native CPU and CUDA kernels in plugins/kernels/.
ATTENTION_OP_TYPES = (ATTENTION_POOLED_OP, ATTENTION_ALL_ROWS_OP)
PROJECTED_POOLED_OP = "PooledRowCalibratedProjectedAttention"
PROJECTED_ALL_ROWS_OP = "AllRowsCalibratedProjectedAttention"
# The same attention with the Q, K and V projection inside (float32; native CPU kernel only).
PROJECTED_OP_TYPES = (PROJECTED_POOLED_OP, PROJECTED_ALL_ROWS_OP)
ALL_OP_TYPES = OP_TYPES + ATTENTION_OP_TYPES + PROJECTED_OP_TYPES
_WITH_SOFTMAX = {POOLED_OP: SOFTMAX_POOLED_OP, ALL_ROWS_OP: SOFTMAX_ALL_ROWS_OP}
_WITH_ATTENTION = {POOLED_OP: ATTENTION_POOLED_OP, ALL_ROWS_OP: ATTENTION_ALL_ROWS_OP}
_WITH_PROJECTED = {POOLED_OP: PROJECTED_POOLED_OP, ALL_ROWS_OP: PROJECTED_ALL_ROWS_OP}
_CALIBRATION_OF = {v: k for k, v in (*_WITH_SOFTMAX.items(), *_WITH_ATTENTION.items(), *_WITH_PROJECTED.items())}
ATTENTION_INPUTS = ("query", "key", "value", "attention_mask")
RELATIVE_BIAS_INPUT = "relative_bias"  # the attention ops' optional fifth input (with `relative_max_distance`)
PROJECTED_INPUTS = ("input", "weight", "bias", "attention_mask")

# name -> ("int" | "float", meaning); `pool_last` only on the pooled-row ops, `num_heads` and `scale`
# only on the calibrated attention ops.
ATTRIBUTES: dict[str, tuple[str, str]] = {
    "pool_last": ("int", "0 = row of the first valid token, 1 = row of the last valid token"),
    "basket_size": ("int", ">= 1"),
    "strength": ("float", "λ"),
    "isolate_first": ("int", "0 or 1"),
    "isolate_last": ("int", "0 or 1"),
    "first_mode": ("int", "0 = equal, 1 = original, 2 = fixed"),
    "last_mode": ("int", "0 = equal, 1 = original, 2 = fixed"),
    "first_weight": ("float", "used by fixed"),
    "last_weight": ("float", "used by fixed"),
    "skip_short": ("int", "0 or 1"),
    "layer": ("int", "informational"),
    "marked_rows": ("int", "0 or 1: calibrate only the rows whose attention_mask value is ROW_MARK; all-rows ops"),
    "isolate_self": ("int", "0 or 1: isolate each calibrated row's own key; with marked_rows"),
    "self_mode": ("int", "0 = equal, 1 = original, 2 = fixed: the own key's share"),
    "self_weight": ("float", "the own key's share under fixed"),
    "num_heads": ("int", ">= 1; calibrated attention ops only"),
    "scale": ("float", "score scale; 0 = 1/sqrt(head_size); calibrated attention ops only"),
    "num_kv_heads": ("int", "key/value heads (GQA / MQA), divides num_heads; 0 = num_heads; attention ops only"),
    "window_left": ("int", "keys at most this many positions before the query; -1 = no limit; attention ops only"),
    "window_right": ("int", "keys at most this many positions after the query; -1 = no limit, 0 = causal; "
                            "attention ops only"),
    "relative_max_distance": ("int", "relative position bias: the bucket function's max distance, with the "
                                     "relative_bias input; 0 = no bias; attention ops only"),
}
# The attention geometry: optional, with these defaults (plain multi-head attention over every key), and
# written only where a node differs from them, so that graphs without a window or GQA stay what they were
# and run on libraries built before these attributes.
GEOMETRY_DEFAULTS: dict[str, int] = {"num_kv_heads": 0, "window_left": -1, "window_right": -1,
                                     "relative_max_distance": 0}
_ATTENTION_ONLY = ("num_heads", "scale", *GEOMETRY_DEFAULTS)
# The marked rows and the own key's isolation: optional on every op (the pooled-row ops take them at these
# defaults only), with these defaults, written only where a node differs from them.
ROW_SET_DEFAULTS: dict[str, int | float] = {"marked_rows": 0, "isolate_self": 0, "self_mode": 0, "self_weight": 0.0}
OPTIONAL_DEFAULTS: dict[str, int | float] = {**ROW_SET_DEFAULTS, **GEOMETRY_DEFAULTS}


def _check(op_type: str) -> str:
    if op_type not in ALL_OP_TYPES:
        raise ValueError(f"unknown calibration op {op_type!r}; the {DOMAIN} ops are {', '.join(ALL_OP_TYPES)}")
    return op_type


def takes_scores(op_type: str) -> bool:
    """True for the ops fused with the Softmax (first input: scores, not probabilities)."""
    return _check(op_type) in _WITH_SOFTMAX.values()


def is_attention(op_type: str) -> bool:
    """True for the calibrated attention ops, projected or not (output: the context; attributes
    `num_heads` and `scale`)."""
    return _check(op_type) in ATTENTION_OP_TYPES + PROJECTED_OP_TYPES


def is_projected(op_type: str) -> bool:
    """True for the calibrated attention ops that also compute the Q, K and V projection (inputs
    input, weight, bias, attention_mask)."""
    return _check(op_type) in PROJECTED_OP_TYPES


def calibration_of(op_type: str) -> str:
    """The calibration a (fused, attention or plain) op applies: PooledRowCalibration or
    AllRowsCalibration."""
    return _CALIBRATION_OF.get(_check(op_type), op_type)


def with_softmax(op_type: str) -> str:
    """The fused counterpart of a plain calibration op."""
    return _WITH_SOFTMAX[calibration_of(op_type)]


def with_attention(op_type: str, projected: bool = False) -> str:
    """The calibrated attention op (with the Q, K and V projection inside when `projected`) that
    applies the same calibration."""
    return (_WITH_PROJECTED if projected else _WITH_ATTENTION)[calibration_of(op_type)]


def is_all_rows(op_type: str) -> bool:
    return calibration_of(op_type) == ALL_ROWS_OP


def first_input(op_type: str) -> str:
    if is_attention(op_type):
        return input_names(op_type)[0]
    return "scores" if takes_scores(op_type) else "probs"


def input_names(op_type: str, relative_bias: bool = False) -> list[str]:
    """The op's inputs in order (with the attention ops' optional `relative_bias` where asked)."""
    if is_projected(op_type):
        names = list(PROJECTED_INPUTS)
    else:
        names = list(ATTENTION_INPUTS) if is_attention(op_type) else [first_input(op_type), "attention_mask"]
    if relative_bias:
        if not is_attention(op_type) or is_projected(op_type):
            raise ValueError(f"{op_type} takes no {RELATIVE_BIAS_INPUT} input (only the calibrated attention ops do)")
        names.append(RELATIVE_BIAS_INPUT)
    return names


def attribute_names(op_type: str) -> list[str]:
    names = list(ATTRIBUTES)
    if is_all_rows(op_type):
        names.remove("pool_last")
    if not is_attention(op_type):
        names = [n for n in names if n not in _ATTENTION_ONLY]
    return names


@dataclass(frozen=True)
class OpSpec:
    """One calibration node: its op type and attribute values."""

    op_type: str
    attrs: dict[str, int | float]


def op_spec(rc: ResolvedCalibration, layer: int, *, fused_softmax: bool = False) -> OpSpec:
    """The node that implements the resolved calibration `rc` in layer `layer` (fused with the
    Softmax: takes the scores)."""
    attrs: dict[str, int | float] = {
        "basket_size": int(rc.basket_size),
        "strength": float(rc.strength),
        "isolate_first": int(rc.isolate_first),
        "isolate_last": int(rc.isolate_last),
        "first_mode": int(rc.first_mode),
        "last_mode": int(rc.last_mode),
        "first_weight": float(rc.first_weight),
        "last_weight": float(rc.last_weight),
        "skip_short": int(rc.skip_short),
        "layer": int(layer),
    }
    if rc.row_set:
        rows = {"marked_rows": 1, "isolate_self": int(rc.isolate_self), "self_mode": int(rc.self_mode),
                "self_weight": float(rc.self_weight)}
        spec = OpSpec(ALL_ROWS_OP, {**attrs, **{k: v for k, v in rows.items() if v != ROW_SET_DEFAULTS[k]}})
    elif rc.all_rows:
        spec = OpSpec(ALL_ROWS_OP, attrs)
    else:
        spec = OpSpec(POOLED_OP, {"pool_last": int(rc.pool_last), **attrs})
    return OpSpec(with_softmax(spec.op_type), spec.attrs) if fused_softmax else spec


@dataclass(frozen=True)
class AttentionGeometry:
    """Which keys a query row sees, how many key/value heads there are, and the relative position bias:
    the attention ops' optional attributes.  A key k is visible to the query at position q when
    q - window_left <= k <= q + window_right (a bound of -1 is no bound; window_right 0 is causal
    attention).  `relative_max_distance` > 0: the node takes the `relative_bias` table.  Windows and the
    bias need self-attention (S_q == S_k)."""

    num_kv_heads: int = 0  # 0 = num_heads (multi-head attention)
    window_left: int = -1
    window_right: int = -1
    relative_max_distance: int = 0  # 0 = no relative position bias

    @property
    def windowed(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    @property
    def relative(self) -> bool:
        return self.relative_max_distance > 0

    def attrs(self) -> dict[str, int]:
        """The attributes that differ from the defaults (`GEOMETRY_DEFAULTS`)."""
        return {k: int(v) for k, v in vars(self).items() if int(v) != GEOMETRY_DEFAULTS[k]}

    def check(self, num_heads: int) -> None:
        if self.num_kv_heads < 0 or (self.num_kv_heads and num_heads % self.num_kv_heads):
            raise ValueError(f"num_kv_heads must divide num_heads={num_heads} (0 = num_heads), got {self.num_kv_heads}")
        if self.window_left < -1 or self.window_right < -1:
            raise ValueError(f"window_left and window_right must be >= 0, or -1 for no limit; got "
                             f"{self.window_left} and {self.window_right}")
        if self.relative_max_distance < 0:
            raise ValueError(f"relative_max_distance must be >= 1, or 0 for no relative position bias; got "
                             f"{self.relative_max_distance}")


FULL_ATTENTION = AttentionGeometry()


def attention_op_spec(rc: ResolvedCalibration, layer: int, num_heads: int, scale: float = 0.0,
                      projected: bool = False, geometry: AttentionGeometry = FULL_ATTENTION) -> OpSpec:
    """The calibrated attention node for `rc` in layer `layer` (with the Q, K and V projection inside
    when `projected`): `op_spec`'s attributes plus `num_heads`, `scale` (0 = 1/sqrt(head_size)) and
    the geometry's attributes where they differ from the defaults."""
    if int(num_heads) < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    geometry.check(int(num_heads))
    if projected and geometry.num_kv_heads not in (0, int(num_heads)):
        raise ValueError("the projected attention ops take ONNX Runtime's packed Q|K|V weight, which has as many "
                         f"key/value heads as query heads; got num_kv_heads={geometry.num_kv_heads}")
    if projected and geometry.relative:
        raise ValueError("the projected attention ops take no relative position bias")
    spec = op_spec(rc, layer)
    return OpSpec(with_attention(spec.op_type, projected),
                  {**spec.attrs, "num_heads": int(num_heads), "scale": float(scale), **geometry.attrs()})


def geometry_from_attrs(attrs: dict[str, int | float]) -> AttentionGeometry:
    """The geometry a calibrated attention node's attributes give (absent ones: the defaults)."""
    return AttentionGeometry(**{k: int(attrs.get(k, v)) for k, v in GEOMETRY_DEFAULTS.items()})


def resolved_from_attrs(op_type: str, attrs: dict[str, int | float]) -> ResolvedCalibration:
    """Inverse of `op_spec`: what a node with these attributes computes."""
    rows = {k: attrs.get(k, v) for k, v in ROW_SET_DEFAULTS.items()}
    if not is_all_rows(op_type):
        kind = "last" if int(attrs["pool_last"]) else "cls"
    elif int(rows["marked_rows"]):  # the op reads its rows from the marked mask: no token id or k of its own
        kind = "lmk" if int(rows["isolate_self"]) else "mean-every"
    else:
        kind = "mean"
    return ResolvedCalibration(
        pooling=Pooling(kind),
        strength=float(attrs["strength"]),
        basket_size=int(attrs["basket_size"]),
        isolate_first=bool(attrs["isolate_first"]),
        isolate_last=bool(attrs["isolate_last"]),
        first_mode=int(attrs["first_mode"]),
        first_weight=float(attrs["first_weight"]),
        last_mode=int(attrs["last_mode"]),
        last_weight=float(attrs["last_weight"]),
        skip_short=bool(attrs["skip_short"]),
        isolate_self=bool(rows["isolate_self"]),
        self_mode=int(rows["self_mode"]),
        self_weight=float(rows["self_weight"]),
    )

"""Calibration of marked rows: landmark (LMK), multi-CLS and Mean@k pooling pool many rows, and those are the rows
calibrated (attncal/graphs/ops/contract.py, "Marked rows"; docs/calibration.md, "Landmark rows").

* the spec: a landmark row's own key leaves its basket and takes the variant's share, worked by hand against the
  float64 oracle; the first-key and last-key coincidences; unmarked rows untouched;
* the PyTorch implementations (`apply`, `naive_apply`) and the function bodies against the oracle;
* the native CPU kernels through the ONNX Runtime library: >= 20,000 random cases per dtype for the calibration
  ops (every instruction-set path in turn) and for the calibrated attention op (every batch on every path),
  thread-count independence, the refusals of bad attributes, and the C++ host test on each path
  (tests/cpp/landmark_rows_test.cpp);
* the marks built in the graph from `input_ids` (attncal.graphs.placements.row_marks) equal `marked_mask`; the
  placements that take a row set and the ones that refuse it.

A case is one batch item under one attribute set, all of its heads and marked rows compared with the oracle."""

from __future__ import annotations

import random
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from attncal.calibration import CalibrationConfig, apply, reference
from attncal.calibration.config import MODE_EQUAL, MODE_FIXED, MODE_ORIGINAL, ROW_MARK
from attncal.calibration.naive import naive_apply
from attncal.graphs import placements
from attncal.graphs.placements import row_marks
from attncal.graphs.ops.contract import attention_op_spec, op_spec, resolved_from_attrs
from attncal.graphs.ops.single_op import single_op_model
from attncal.runtime import oplib
from attncal.pooling import Pooling
from support.cases import calibrated_rows, mark_rows, random_config, row_set_config
from support.cpu import run_on_each_path
from support.masks import mixed_mask, random_mask
from support.oracle_loop import attention_oracle_errors, random_attention_batch, run_oracle_loop
from support.tensors import random_probs, random_scores
from test_calibrated_attention import feeds
from test_native_kernel import cpu_path, library  # noqa: F401  (the built-library and CPU-path fixtures)

REPO = Path(__file__).resolve().parents[1]


def session(model: onnx.ModelProto, library: Path | None, threads: int = 1) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if library is not None:
        so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def own_kinds(mask: torch.Tensor, rc) -> dict[str, int]:
    """How many marked rows have their own key as the isolated first key, the isolated last key, or a content
    key (isolate_self), from the spec."""
    out = {"own_first": 0, "own_last": 0, "own_content": 0}
    if not rc.isolate_self:
        return out
    for b in range(mask.shape[0]):
        valid = mask[b].nonzero().flatten()
        if len(valid) == 0:
            continue
        start, end = int(valid[0]), int(valid[-1])
        for q in (mask[b] == ROW_MARK).nonzero().flatten().tolist():
            kind = ("own_first" if rc.isolate_first and q == start else
                    "own_last" if rc.isolate_last and q == end else "own_content")
            out[kind] += 1
    return out


def tally_marked(seen: dict, mask: torch.Tensor, rc, S: int) -> None:
    """Adds one batch's coverage to `seen`: items by padding side and holes, partial baskets, items of each
    row-set pooling, the own key's place and the self share's mode, marked rows."""
    B, K = mask.shape
    valid = mask != 0
    lengths = valid.sum(1)
    first, last = valid.int().argmax(1), K - 1 - valid.int().flip(1).argmax(1)
    counts = {"left": int((valid[:, -1] & ~valid[:, 0]).sum()), "right": int((valid[:, 0] & ~valid[:, -1]).sum()),
              "holes": int(((last - first + 1 != lengths) & (lengths > 0)).sum()),
              "partial": int((((lengths - rc.n_isolated) % S != 0) & (lengths > rc.n_isolated)).sum()),
              "landmark" if rc.pooling.inserts else rc.pooling.kind: B, "marked_rows": int((mask == ROW_MARK).sum()), **own_kinds(mask, rc)}
    if rc.isolate_self:
        counts[{MODE_EQUAL: "self_equal", MODE_ORIGINAL: "self_original", MODE_FIXED: "self_fixed"}[rc.self_mode]] = B
    for key, n in counts.items():
        if key in seen:
            seen[key] += n


MARKED_TALLIES = ("left", "right", "holes", "partial", "landmark", "mean-every", "marked_rows", "own_first",
                  "own_last", "own_content", "self_equal", "self_original", "self_fixed")


# ------------------------------------------------------------------ the spec
def test_a_landmark_row_takes_its_own_key_out_of_its_basket():
    """Eight valid tokens, baskets of 2, the first token isolated (`equal`), a landmark at row 4 with the cls-hard
    share w of its own key, strength 1.  Content keys 1-7 make baskets {1,2} {3,4} {5,6} {7}; key 4 leaves the
    second, which keeps key 3 alone; t = 4 baskets + 2 isolated keys.  The budget 1 - 1/t - w is spread equally
    over the four baskets, each keeping its internal shape; the marked row's other rows are untouched."""
    w, S = 0.3, 2
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, 4] = ROW_MARK
    probs = random_probs(torch.Generator().manual_seed(3), mask, H=1)
    cfg = CalibrationConfig(variant="cls-hard", self_weight=w, basket_size=S, strength=1.0,
                            pooling=Pooling("lmk", token_id=9))
    out = reference(probs, mask, cfg)[0, 0]
    a = probs[0, 0, 4].double()
    t = 4 + 2
    per_basket = (1 - 1 / t - w) / 4
    want = torch.zeros(8, dtype=torch.float64)
    want[0], want[4] = 1 / t, w
    for keys in ([1, 2], [3], [5, 6], [7]):
        want[keys] = per_basket * a[keys] / a[keys].sum()
    torch.testing.assert_close(out[4], want, rtol=0, atol=1e-15)
    rows = [q for q in range(8) if q != 4]
    assert torch.equal(out[rows], probs[0, 0, rows])


@pytest.mark.parametrize("where", ["first", "last"])
def test_an_own_key_that_is_the_isolated_first_or_last_key_takes_the_self_share_in_its_place(where):
    """Multi-CLS marks the first token (isolated by cls pooling), LMK the last one (the closing SEP): there the
    own key takes the self share instead of the first / last key's, and t counts it once."""
    K, q = 11, (0 if where == "first" else 10)
    mask = torch.ones(1, K, dtype=torch.long)
    mask[0, q] = ROW_MARK
    probs = random_probs(torch.Generator().manual_seed(4), mask, H=1)
    cfg = CalibrationConfig(variant="cls-soft", basket_size=3, strength=1.0, pooling=Pooling("lmk", token_id=1),
                            isolate_first=True, isolate_last=True)
    rc = cfg.resolve()
    assert (rc.first_mode, rc.last_mode, rc.self_mode) == (MODE_EQUAL, MODE_EQUAL, MODE_ORIGINAL)
    out = reference(probs, mask, cfg)[0, 0, q]
    a = probs[0, 0, q].double()
    t = 3 + 2  # content keys 1-9: three baskets; two isolated keys, the own key one of them
    other = K - 1 - q  # the isolated key that is not the own key
    budget = 1 - a[q] - 1 / t
    assert out[q].item() == pytest.approx(a[q].item(), abs=1e-15)
    assert out[other].item() == pytest.approx(1 / t, abs=1e-15)
    for b in range(3):
        keys = list(range(1 + 3 * b, 4 + 3 * b))
        assert out[keys].sum().item() == pytest.approx(budget.item() / 3, abs=1e-15)


def test_mean_every_marks_calibrate_as_mean_pooling_calibrates_those_rows():
    """Mean@k takes ordinary tokens: no own key is isolated, and a marked row is calibrated exactly as mean
    pooling calibrates it."""
    rng, gen = random.Random(8), torch.Generator().manual_seed(8)
    mask = mark_rows(rng, random_mask(rng, 4, 20, left=False, min_len=8))
    probs = random_probs(gen, mask, H=2)
    every = reference(probs, mask, CalibrationConfig(pooling=Pooling("mean-every", 3), basket_size=4))
    mean = reference(probs, mask, CalibrationConfig(pooling="mean", basket_size=4))
    marked = (mask == ROW_MARK)[:, None, :, None].expand_as(probs)
    assert torch.equal(every[marked], mean[marked]) and marked.any()
    assert torch.equal(every[~marked], probs[~marked])


# ------------------------------------------------------------------ PyTorch and the function bodies
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.float16, 2e-3)], ids=str)
def test_apply_and_naive_match_the_oracle(dtype, tol):
    rng, gen = random.Random(31), torch.Generator().manual_seed(31)
    seen = dict.fromkeys(MARKED_TALLIES, 0)
    torch.set_num_threads(1)
    for _ in range(600):
        S = rng.choice([1, 2, 3, 4, 8])
        cfg = row_set_config(rng, random_config(rng, S))
        K = rng.randint(1, 24)
        mask = mark_rows(rng, mixed_mask(rng, rng.randint(1, 4), K) if rng.random() < 0.2
                         else random_mask(rng, rng.randint(1, 4), K, rng.random() < 0.5))
        holes = bool(((mask != 0).cumsum(1).diff(dim=1) == 0)[:, :].any())
        probs = random_probs(gen, mask, rng.randint(1, 2), dtype, temp=rng.choice([0.5, 2.0, 6.0]))
        if rng.random() < 0.2:  # exact zeros: empty baskets
            probs[..., rng.randrange(K):][..., : 2 * S] = 0
        ref = reference(probs.double(), mask, cfg)
        outs = [naive_apply(probs.clone(), mask, cfg)]
        if not holes or not (mask != 0).any():  # apply refuses a mask with holes (its geometry needs one run)
            try:
                outs.append(apply(probs.clone(), mask, cfg))
            except ValueError as exc:
                assert "holes" in str(exc)
        for out in outs:
            assert (out.double() - ref).abs().max().item() <= tol, cfg
        untouched = ~calibrated_rows(mask, cfg.resolve())[:, None, :, None].expand_as(probs)
        assert torch.equal(outs[0][untouched], probs[untouched])
        tally_marked(seen, mask, cfg.resolve(), S)
    assert min(seen.values()) > 0, seen


@pytest.mark.parametrize("fused", [False, True], ids=["probs", "softmax-fused"])
def test_function_body_of_the_calibration_ops_matches_the_oracle(fused):
    rng, gen = random.Random(41 + fused), torch.Generator().manual_seed(41)
    seen = dict.fromkeys(MARKED_TALLIES, 0)
    for _ in range(60):
        S = rng.choice([1, 2, 3, 4, 8])
        spec = op_spec(row_set_config(rng, random_config(rng, S)).resolve(), 3, fused_softmax=fused)
        rc = resolved_from_attrs(spec.op_type, spec.attrs)
        sess = session(single_op_model(spec), None)
        for _ in range(2):
            K = rng.randint(1, 16)
            mask = mark_rows(rng, mixed_mask(rng, rng.randint(4, 12), K))
            if fused:
                x = random_scores(gen, mask, 2)
                ref = reference(torch.softmax(x.double(), -1), mask, rc)
            else:
                x = random_probs(gen, mask, 2, torch.float32)
                ref = reference(x.double(), mask, rc)
            (out,) = sess.run(None, {"scores" if fused else "probs": x.numpy(), "attention_mask": mask.numpy()})
            assert np.abs(out - ref.numpy()).max(initial=0.0) <= 1e-6, spec
            tally_marked(seen, mask, rc, S)
    assert min(seen.values()) > 0, seen


def test_function_body_of_the_attention_op_matches_the_oracle():
    rng, gen = random.Random(51), torch.Generator().manual_seed(51)
    worst = 0.0
    for _ in range(40):
        S = rng.choice([1, 2, 3, 4, 8])
        N, D = rng.randint(1, 2), rng.choice([2, 4, 8])
        spec = attention_op_spec(row_set_config(rng, random_config(rng, S)).resolve(), 2, num_heads=N)
        rc = resolved_from_attrs(spec.op_type, spec.attrs)
        sess = session(single_op_model(spec), None)
        K = rng.randint(1, 20)
        mask, _, _, q, k, v = random_attention_batch(rng, gen, rc, S, N, D, D, False, torch.float32,
                                                     rng.randint(2, 8), K, holes=0.1)
        mask = mark_rows(rng, mask)
        (out,) = sess.run(None, feeds(q, k, v, mask))
        err, rounding = attention_oracle_errors(out, q, k, v, mask, rc, N, 0.0, False, False)
        assert np.all(err <= 2e-6 + rounding), spec  # the body's float32 sums, in ONNX Runtime's order
        worst = max(worst, float(err.max()))
    print(f"\nfunction body, attention op with marked rows: max abs err {worst:.3g}")


# ------------------------------------------------------------------ the native CPU kernels
def random_marked_op(rng, fused: bool):
    S = rng.choice([1, 2, 3, 4, 5, 8, 16])
    spec = op_spec(row_set_config(rng, random_config(rng, S)).resolve(), layer=rng.randint(0, 30), fused_softmax=fused)
    return S, spec, resolved_from_attrs(spec.op_type, spec.attrs)


@pytest.mark.parametrize("float16,tol", [(False, 1e-6), (True, 2e-3)], ids=["fp32", "fp16"])
def test_calibration_ops_match_the_oracle_on_20000_cases(library, float16, tol):
    """The separate and the Softmax-fused op, in turn per attribute set; each batch on every instruction-set path
    this CPU runs, against one float64 oracle."""
    rng, gen = random.Random(6101 + float16), torch.Generator().manual_seed(61)
    dtype = torch.float16 if float16 else torch.float32
    paths, widest = oplib.cpu_paths(library), oplib.cpu_path(library)
    worst = dict.fromkeys(paths, 0.0)

    def configure():
        fused = rng.random() < 0.5
        S, spec, rc = random_marked_op(rng, fused)
        # Without the function body: only the native kernel can run the node.
        return S, spec, rc, fused, session(single_op_model(spec, float16=float16, with_function=False), library)

    def run(config, seen):
        S, spec, rc, fused, sess = config
        K, B = rng.randint(1, 24), rng.randint(16, 40)
        mask = mark_rows(rng, mixed_mask(rng, B, K))
        if fused:
            x = random_scores(gen, mask, 2, dtype)
            ref = reference(torch.softmax(x.double(), -1), mask, rc).numpy()
        else:
            x = random_probs(gen, mask, 2, dtype, temp=rng.choice([0.5, 2.0, 6.0]))
            if rng.random() < 0.2:
                x[..., rng.randrange(K):][..., : 2 * S] = 0  # empty baskets
            ref = reference(x.double(), mask, rc).numpy()
        untouched = (~calibrated_rows(mask, rc))[:, None, :].expand(B, 2, K).numpy()
        for path in paths:
            oplib.set_cpu_path(library, path)
            (out,) = sess.run(None, {"scores" if fused else "probs": x.numpy(), "attention_mask": mask.numpy()})
            err = np.abs(out.astype(np.float64) - ref).max(axis=(1, 2, 3), initial=0.0)
            assert err.max() <= tol, (path, float(err.max()), spec, K, int(err.argmax()))
            worst[path] = max(worst[path], float(err.max()))
            if not fused:  # rows the spec leaves alone, unmarked ones included, are bit-identical
                assert np.array_equal(out[untouched].view(np.uint8), x.numpy()[untouched].view(np.uint8)), path
        oplib.set_cpu_path(library, widest)
        seen["fused"] += B * fused
        tally_marked(seen, mask, rc, S)
        return B, float(max(worst.values()))

    loop = run_oracle_loop(20000, configure, run, runs_per_config=2, seen=("fused", *MARKED_TALLIES))
    print(f"\ncalibration ops, marked rows, {'fp16' if float16 else 'fp32'}: {loop.cases} cases in {loop.runs} runs, "
          f"max abs err per path {worst}, {loop.seen}")
    assert loop.cases >= 20000 and min(loop.seen.values()) > 200, loop.seen


@pytest.mark.parametrize("float16,tol", [(False, 0.0), (True, 2e-3)], ids=["fp32", "fp16"])
def test_attention_op_matches_the_oracle_on_20000_cases(library, float16, tol):
    """Each batch on every instruction-set path this CPU runs, against one float64 oracle; the bound is `tol` plus
    the float32 rounding of the scores and of the kernel's sums (`attention_oracle_errors`), as for the other
    attribute sets (test_calibrated_attention_kernel.py).  Now and then one long item: its unmarked rows run over
    key tiles and its marked ones in gathered whole-row blocks."""
    rng, gen = random.Random(7101 + float16), torch.Generator().manual_seed(71)
    dtype = torch.float16 if float16 else torch.float32
    paths, widest = oplib.cpu_paths(library), oplib.cpu_path(library)
    worst = dict.fromkeys(paths, 0.0)

    def configure():
        S = rng.choice([1, 2, 3, 4, 5, 8, 16])
        N, D, D_v = rng.randint(1, 2), rng.randint(1, 8), rng.randint(1, 6)
        exact = rng.random() < 0.5
        scale = rng.choice([0.125, 0.5, 1.0] if exact and D not in (1, 4) else [0.0, 0.125, 0.5, 1.0])
        spec = attention_op_spec(row_set_config(rng, random_config(rng, S)).resolve(), layer=1, num_heads=N,
                                 scale=scale)
        rc = resolved_from_attrs(spec.op_type, spec.attrs)
        return S, N, D, D_v, exact, scale, rc, spec, session(single_op_model(spec, float16=float16,
                                                                             with_function=False), library, 2)

    def run(config, seen):
        S, N, D, D_v, exact, scale, rc, spec, sess = config
        long = rng.random() < 0.01
        K = rng.randint(1100, 1300) if long else rng.randint(1, 24)
        B = 1 if long else rng.randint(8, 24)
        mask, _, dead, q, k, v = random_attention_batch(rng, gen, rc, S, N, D, D_v, exact, dtype, B, K, holes=0.15)
        mask = mark_rows(rng, mask, p=0.01 if long else None)
        outs = []
        for path in paths:
            oplib.set_cpu_path(library, path)
            outs.append(sess.run(None, feeds(q, k, v, mask))[0])
        oplib.set_cpu_path(library, widest)
        errs, rounding = attention_oracle_errors(outs, q, k, v, mask, rc, N, scale, exact, float16, sums=True)
        for path, err in zip(paths, errs):
            assert np.all(err <= tol + rounding), (path, float(err.max()), spec, K)
            worst[path] = max(worst[path], float(err.max()))
        seen["long"] += long
        seen["empty_basket"] += B * (dead is not None)
        tally_marked(seen, mask, rc, S)
        return B, float(max(e.max() for e in errs))

    loop = run_oracle_loop(20000, configure, run, runs_per_config=3, seen=("long", "empty_basket", *MARKED_TALLIES))
    print(f"\ncalibrated attention, marked rows, {'fp16' if float16 else 'fp32'}: {loop.cases} cases in {loop.runs} "
          f"runs, max abs err per path {worst}, {loop.seen}")
    long = loop.seen.pop("long")
    assert loop.cases >= 20000 and long >= 3 and min(loop.seen.values()) > 100, (long, loop.seen)


@pytest.mark.parametrize("float16", [False, True], ids=["fp32", "fp16"])
def test_threads_and_in_place_give_identical_bits(library, cpu_path, float16):
    rng, gen = random.Random(81), torch.Generator().manual_seed(81)
    dtype = torch.float16 if float16 else torch.float32
    cfg = CalibrationConfig(pooling=Pooling("lmk", token_id=5), basket_size=8)
    mask = mark_rows(rng, mixed_mask(rng, 6, 300, min_len=100), p=1 / 64)
    probs = random_probs(gen, mask, 4, dtype)
    spec = op_spec(cfg.resolve(), 1)
    model = single_op_model(spec, float16=float16)
    outs = [session(model, library, threads).run(None, {"probs": probs.numpy(), "attention_mask": mask.numpy()})[0]
            for threads in (1, 2, 4)]
    assert all(np.array_equal(o.view(np.uint8), outs[0].view(np.uint8)) for o in outs[1:])
    spec = attention_op_spec(cfg.resolve(), 1, num_heads=2)
    mask = mark_rows(rng, mixed_mask(rng, 2, 1200, min_len=900), p=1 / 128)
    q, k, v = (torch.randn(2, 1200, 16, generator=gen).to(dtype) for _ in range(3))
    model = single_op_model(spec, float16=float16)
    outs = [session(model, library, threads).run(None, feeds(q, k, v, mask))[0] for threads in (1, 2, 4)]
    assert all(np.array_equal(o.view(np.uint8), outs[0].view(np.uint8)) for o in outs[1:])


@pytest.mark.parametrize("attrs,message", [
    ({"marked_rows": 1}, "marked_rows and isolate_self are the all-rows ops'"),
    ({"isolate_self": 1, "marked_rows": 0}, "isolate_self needs marked_rows = 1"),
    ({"marked_rows": 2}, "marked_rows and isolate_self must be 0 or 1"),
    ({"self_mode": 3}, "self_mode must be 0 (equal), 1 (original) or 2 (fixed), got 3"),
])
def test_bad_marked_row_attributes_are_refused_with_the_reason(library, attrs, message):
    pooled = "marked_rows" in attrs and attrs["marked_rows"] == 1 and len(attrs) == 1
    rc = CalibrationConfig(pooling="cls" if pooled else "mean").resolve()
    spec = op_spec(rc, 0)
    spec.attrs.update(attrs)
    sess = session(single_op_model(spec), library)
    mask = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(Exception, match=re.escape(message)):
        sess.run(None, {"probs": random_probs(torch.Generator(), mask, 1, torch.float32).numpy(),
                        "attention_mask": mask.numpy()})


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++)")
def test_host_kernels_match_the_double_reference_on_each_path(tmp_path):
    exe = tmp_path / "landmark_rows_test"
    # The library's flags (CMake: -O3, gnu++17), with the built-in GEMM.
    subprocess.run(["g++", "-std=gnu++17", "-O3", "-Wall", "-Wextra", "-Werror", "-pthread",
                    "-I", str(REPO / "plugins" / "kernels"),
                    "-o", str(exe), str(REPO / "tests" / "cpp" / "landmark_rows_test.cpp")], check=True)
    for path, res in run_on_each_path([str(exe)]):
        assert res.returncode == 0, (path, res.stdout + res.stderr)
        assert res.stdout.strip().endswith(" 0 failure(s)"), (path, res.stdout)
        checked, calibrated = (int(w) for w in res.stdout.split()[:4:3])
        assert calibrated > 5000 and checked > calibrated, (path, res.stdout)


# ------------------------------------------------------------------ the marks in the graph, the placements
@pytest.mark.parametrize("cfg", [CalibrationConfig(pooling=Pooling("lmk", token_id=102)),
                                 CalibrationConfig(pooling=Pooling("mean-every", 3))], ids=["landmark", "mean-every"])
def test_graph_marks_equal_marked_mask(cfg):
    """row_marks.insert's nodes, run by ONNX Runtime, give `ResolvedCalibration.marked_mask` on both padding sides,
    with landmark ids under the padding."""
    import onnx_ir as ir

    rc = cfg.resolve()
    graph = helper.make_graph([helper.make_node("Identity", ["attention_mask"], ["plain"])], "g",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "S"]),
                               helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "S"])],
                              [helper.make_tensor_value_info("plain", TensorProto.INT64, ["B", "S"])])
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    g = model.graph
    ids = row_marks.find_ids(g, rc, ValueError)
    mask_in = next(v for v in g.inputs if v.name == "attention_mask")
    g.outputs.append(row_marks.insert(g, rc, mask_in, ids))
    rng = random.Random(3)
    short = torch.zeros(2, 30, dtype=torch.long)  # shorter than k = 3: Mean@k pools the last valid token
    short[0, :2], short[1, -2:] = 1, 1
    mask = torch.cat([random_mask(rng, 3, 30, left=True), random_mask(rng, 3, 30, left=False), short])
    input_ids = torch.randint(100, 104, mask.shape, generator=torch.Generator().manual_seed(3))
    (_, marked) = session(ir.serde.serialize_model(model), None).run(
        None, {"input_ids": input_ids.numpy(), "attention_mask": mask.numpy()})
    assert np.array_equal(marked, rc.marked_mask(input_ids, mask).numpy())
    assert (marked == ROW_MARK).any() and ((input_ids == 102) & (mask == 0)).any()
    if cfg.pooling.kind == "mean-every":
        assert marked[-2, 1] == marked[-1, -1] == ROW_MARK and (marked[-2:] == ROW_MARK).sum() == 2
        assert np.array_equal(rc.marked_mask(input_ids.numpy(), mask.numpy()), marked)  # numpy gives the same


def test_a_graph_without_token_ids_is_refused_by_name():
    import onnx_ir as ir

    graph = helper.make_graph([], "g", [helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "S"])],
                              [])
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    rc = CalibrationConfig(pooling=Pooling("lmk", token_id=1)).resolve()
    with pytest.raises(ValueError, match="lmk pooling marks its calibrated rows from the token ids: the graph "
                                         "has no input named 'input_ids'"):
        row_marks.find_ids(model.graph, rc, ValueError)
    off = CalibrationConfig.off(Pooling("lmk", token_id=1)).resolve()
    assert row_marks.find_ids(model.graph, off, ValueError) is None


@pytest.mark.parametrize("cfg", [CalibrationConfig(pooling=Pooling("lmk", token_id=2)),
                                 CalibrationConfig(pooling=Pooling("mean-every", 4))], ids=["landmark", "mean-every"])
def test_placements_take_the_row_set_in_one_pass_and_refuse_where_they_cannot(cfg):
    rc = cfg.resolve()
    plan = placements.plan("auto", rc, "fp32")
    assert (plan.portable, plan.optimized, plan.native) == ("fused-softmax", "softmax", "projected-attention")
    assert placements.plan("attention", rc).portable == "fused-softmax"
    for name, message in (("row", "row placement needs a single pooling row"),
                          ("split", "split placement calibrates one row or every row")):
        with pytest.raises(ValueError, match=message):
            placements.plan(name, rc)
    assert CalibrationConfig.off("lmk").resolve().all_rows  # no token yet: mean pooling's op at strength 0


def test_split_calibration_refuses_marked_rows():
    """The split identity's basket terms are attention over contiguous key ranges; a landmark row's own key leaves
    its basket, so the PyTorch split path refuses, naming what to use instead."""
    from attncal.calibration import compute_geometry
    from attncal.calibration.split import split_calibrated_attention

    rc = CalibrationConfig(pooling=Pooling("lmk", token_id=1), basket_size=2).resolve()
    mask = torch.ones(1, 6, dtype=torch.long)
    mask[0, 3] = ROW_MARK
    q = torch.randn(1, 1, 6, 4)
    with pytest.raises(ValueError, match="lmk pooling calibrates the rows marked in its mask: calibrate the "
                                         r"probabilities \(attncal.calibration.apply\)"):
        split_calibrated_attention(q, q, q, q.clone(), None, rc, compute_geometry(mask, rc), 0.5)


# ------------------------------------------------------------------ placed in an exported encoder
@pytest.fixture(scope="module")
def uncalibrated_bert(tmp_path_factory, library):
    """The portable and the ORT-optimized graph of an uncalibrated export of a random-weight BERT (mean pooling),
    its layer count, and a batch of token ids with both padding sides in which id 7 marks some tokens."""
    from attncal.exporting.exporter import ExportOptions, export
    from attncal.synthetic import save_synthetic_model

    root = tmp_path_factory.mktemp("landmark-placements")
    src = save_synthetic_model("bert", root / "src", seed=5, pooling="mean", max_positions=256)
    meta = export(src, root / "out", ExportOptions(calibrate=False, exporter="torchscript"), quiet=True)
    gen = torch.Generator().manual_seed(5)
    mask = torch.cat([random_mask(random.Random(5), 2, 96, left=True, min_len=60),
                      random_mask(random.Random(6), 2, 96, left=False, min_len=60)])
    ids = torch.randint(10, 60, mask.shape, generator=gen)
    ids[:, 15::16] = 7  # a landmark closing each chunk of 16 tokens (some under the padding)
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": np.zeros_like(ids.numpy())}
    return root / "out" / "onnx", meta["num_layers"], feeds


def placed(graph: Path, placement: str, cfg: CalibrationConfig, num_layers: int) -> onnx.ModelProto:
    import onnx_ir as ir

    model = ir.load(str(graph))
    placements.get(placement).place(model, cfg, num_layers)
    return ir.serde.serialize_model(model)


def outputs(model: onnx.ModelProto, feeds: dict, library) -> list[np.ndarray]:
    sess = session(model, library)
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def test_placed_marks_calibrate_the_landmark_rows_in_every_graph(uncalibrated_bert, library):
    """Landmark rows marked in the graph from `input_ids`: the portable graph's fused-softmax and softmax
    placements (function bodies, then the native kernels) and the optimized graph's attention placements (native
    kernel) compute the same embeddings.  Mean@k with k = 1 marks every valid token and equals mean pooling's
    calibration; a landmark id that no text holds calibrates nothing."""
    onnx_dir, layers, feeds = uncalibrated_bert
    portable, optimized = onnx_dir / "model.onnx", onnx_dir / "model_optimized.onnx"
    cfg = CalibrationConfig(pooling=Pooling("lmk", token_id=7), basket_size=16, layers="all")
    ref = outputs(placed(portable, "fused-softmax", cfg, layers), feeds, None)
    runs = {"fused-softmax, native": outputs(placed(portable, "fused-softmax", cfg, layers), feeds, library),
            "softmax, native": outputs(placed(portable, "softmax", cfg, layers), feeds, library),
            "attention, native": outputs(placed(optimized, "attention", cfg, layers), feeds, library),
            "projected-attention, native": outputs(placed(optimized, "projected-attention", cfg, layers), feeds,
                                                   library)}
    for name, outs in runs.items():
        for a, b in zip(outs, ref):
            assert np.abs(a - b).max() <= 1e-5, name
    plain = outputs(onnx.load(str(portable)), feeds, None)
    assert max(np.abs(a - b).max() for a, b in zip(ref, plain)) > 1e-3  # the landmark rows moved
    absent = CalibrationConfig(pooling=Pooling("lmk", token_id=3), basket_size=16, layers="all")
    for a, b in zip(outputs(placed(portable, "fused-softmax", absent, layers), feeds, library), plain):
        assert np.abs(a - b).max() <= 1e-5
    every = CalibrationConfig(pooling=Pooling("mean-every", 1), basket_size=16, layers="all")
    mean = CalibrationConfig(pooling="mean", basket_size=16, layers="all")
    for a, b in zip(outputs(placed(portable, "fused-softmax", every, layers), feeds, library),
                    outputs(placed(portable, "fused-softmax", mean, layers), feeds, library)):
        assert np.abs(a - b).max() <= 1e-5


def test_the_native_kernels_read_the_same_row_mark():
    """ROW_MARK is written twice, once per language: the Python side's and the kernels' must agree."""
    header = (REPO / "plugins" / "kernels" / "common" / "attncal_params.h").read_text()
    assert re.search(r"\bATTNCAL_ROW_MARK\s*=\s*(\d+)", header).group(1) == str(ROW_MARK)


def test_the_patched_model_calibrates_the_rows_its_input_ids_mark(tmp_path):
    """PyTorch's reference (`calibrate`): the rows come from the forward's own input_ids.  Without the landmark
    token no row is calibrated (the uncalibrated model's states, bit for bit); with it the states move, and the
    efficient and naive implementations agree."""
    from transformers import AutoModel

    from attncal.calibration import calibrate
    from attncal.synthetic import save_synthetic_model

    src = save_synthetic_model("bert", tmp_path / "m", seed=5, layers=2, max_positions=64)
    model = AutoModel.from_pretrained(src, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 90, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    landmark = 99
    cfg = CalibrationConfig(pooling=Pooling("lmk", token_id=landmark), basket_size=8, strength=0.8)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).last_hidden_state
        with calibrate(model, cfg):
            unmarked = model(input_ids=ids, attention_mask=mask).last_hidden_state
        marked_ids = ids.clone()
        marked_ids[:, 9::10] = landmark
        plain_marked = model(input_ids=marked_ids, attention_mask=mask).last_hidden_state
        states = {}
        for impl in ("efficient", "naive"):
            with calibrate(model, cfg, implementation=impl):
                states[impl] = model(input_ids=marked_ids, attention_mask=mask).last_hidden_state
    assert torch.equal(unmarked, plain)
    assert (states["efficient"] - plain_marked).abs().max() > 1e-3
    torch.testing.assert_close(states["efficient"], states["naive"], atol=2e-5, rtol=0)

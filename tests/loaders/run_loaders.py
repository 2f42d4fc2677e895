"""Run inside the loader overlay: embed texts with optimum and sentence-transformers' ONNX backend.

Usage: python run_loaders.py EXPORT_DIR TEXTS_JSON OUT_NPZ [GRAPH_FILE]

GRAPH_FILE: the graph under onnx/ to load (default model.onnx), as a user names it to optimum (`file_name`)
and to sentence-transformers (`model_kwargs={"file_name": ...}`).

With --openvino, where openvino is installed, sentence-transformers' backend="openvino" (optimum-intel) loads the export's
standard-ONNX graph too: onnx/model_inlined.onnx where the export has it, else onnx/model.onnx.  It looks for
openvino*.xml files, so the graph is named with `export: False` (without it, it would export the model from
PyTorch weights, which an export directory does not hold), and float32 inference is asked for: OpenVINO
computes in bfloat16 by default on CPUs that have it.
"""

import importlib.util
import json
import os
import sys

import numpy as np


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--openvino"]
    out_dir, texts_file, result_file = args[:3]
    graph_file = args[3] if len(args) > 3 else "model.onnx"
    texts = json.loads(open(texts_file).read())
    meta = json.loads(open(f"{out_dir}/attncal.json").read())
    from optimum.onnxruntime import ORTModelForFeatureExtraction
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    model = ORTModelForFeatureExtraction.from_pretrained(out_dir, subfolder="onnx", file_name=graph_file)
    tok = AutoTokenizer.from_pretrained(out_dir)
    tok.padding_side = meta["padding_side"]
    batch = tok(texts, padding=True, truncation=True, max_length=meta["max_seq_length"], return_tensors="np")
    hidden = model(**{k: batch[k] for k in model.input_names}).last_hidden_state
    hidden = np.asarray(hidden)
    st = SentenceTransformer(out_dir, backend="onnx", device="cpu",
                             model_kwargs={"file_name": f"onnx/{graph_file}"} if graph_file != "model.onnx" else None)
    st_emb = st.encode(texts, convert_to_numpy=True, normalize_embeddings=False)
    results = dict(optimum_hidden=hidden, attention_mask=batch["attention_mask"], st=st_emb)
    if "--openvino" in sys.argv and importlib.util.find_spec("openvino") is not None:
        inlined = os.path.exists(f"{out_dir}/onnx/model_inlined.onnx")
        ov = SentenceTransformer(out_dir, backend="openvino", device="cpu", model_kwargs={
            "file_name": "onnx/model_inlined.onnx" if inlined else "onnx/model.onnx", "export": False,
            "ov_config": {"INFERENCE_PRECISION_HINT": "f32"}})
        results["st_openvino"] = ov.encode(texts, convert_to_numpy=True, normalize_embeddings=False)
    np.savez(result_file, **results)


if __name__ == "__main__":
    main()

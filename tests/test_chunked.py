"""Length-sorted chunked encoding gives the loss and gradients of the unchunked batch."""

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from retrieval_kit.collate import collate_biencoder, collate_rerank
from retrieval_kit.losses import contrastive_loss, listwise_loss
from retrieval_kit.models import BiEncoder, CrossEncoder, length_chunks, load_encoder, load_reranker, setup_pad_token

QUERIES = ["python library", "a graphical user interface for the command line tool", "server",
           "documentation of the data package"]
GROUPS = [["the python package for data", "a tool"],
          ["graphical user interface command line tool for files and data with documentation", "the server"],
          ["server client", "it is a library of the data package with python documentation and a tool"],
          ["documentation package", "files"]]


def loss_and_grads(module, params, loss_fn, backward=True):
    module.zero_grad()
    loss = loss_fn(module)
    if backward:
        loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in params if p.grad is not None}


def assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    assert la == pytest.approx(lb, abs=1e-5)
    assert ga.keys() == gb.keys() and ga
    scale = max(g.abs().max().item() for g in ga.values())
    for k in ga:
        assert (ga[k] - gb[k]).abs().max().item() <= 1e-5 * max(scale, 1.0), k


def test_chunks_cover_every_row_once_longest_first():
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in (2, 6, 3, 6, 1)])
    chunks, left = length_chunks(mask, chunk_tokens=12)
    assert not left and sorted(i for idx, _ in chunks for i in idx) == list(range(5))
    assert chunks[0] == ([1, 3], 6) and all(len(idx) * w <= 12 for idx, w in chunks)
    assert length_chunks(mask, 0) is None


@pytest.mark.parametrize("side", ["right", "left"])
def test_biencoder_chunked_equals_unchunked(tiny_model_dir, tiny_decoder_dir, side):
    path, pooling = (tiny_model_dir, "avg") if side == "right" else (tiny_decoder_dir, "last")
    tok = AutoTokenizer.from_pretrained(path)
    setup_pad_token(tok)
    tok.padding_side = side
    q, p = collate_biencoder(tok, QUERIES, GROUPS, 32, 32)
    assert (p["attention_mask"][:, -1 if side == "right" else 0] == 0).any()
    enc = load_encoder(path).eval()  # eval: dropout off, so both runs compute the same function
    results = []
    for chunk_tokens in (0, 24):
        model = BiEncoder(enc, pooling, True, chunk_tokens)
        results.append(loss_and_grads(model, enc.named_parameters(),
                                      lambda m: contrastive_loss(*m(q, p), 2, temperature=0.05)))
    assert_same(*results)


@pytest.mark.parametrize("side,pooling", [("right", "native"), ("right", "avg"), ("left", "last")])
def test_reranker_chunked_equals_unchunked(tiny_model_dir, tiny_decoder_dir, side, pooling):
    path = tiny_model_dir if side == "right" else tiny_decoder_dir
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    net = load_reranker(path).eval()
    setup_pad_token(tok, net)
    tok.padding_side = side
    batch = collate_rerank(tok, QUERIES, GROUPS, max_length=64, append_eos=side == "left")
    results = []
    for chunk_tokens in (0, 40):
        model = CrossEncoder(net, pooling, chunk_tokens)
        results.append(loss_and_grads(model, net.named_parameters(), lambda m: listwise_loss(m(batch), 2)))
    assert_same(*results)


def test_grad_cache_equals_plain_backward_with_dropout_on(tiny_model_dir):
    from retrieval_kit.encode import grad_cache_biencoder

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    q, p = collate_biencoder(tok, QUERIES, GROUPS, 32, 32)
    enc = load_encoder(tiny_model_dir).train()  # dropout on: GradCache must replay each chunk's RNG
    model = BiEncoder(enc, "avg", True, chunk_tokens=24)
    params = list(enc.named_parameters())

    def plain(seed):
        torch.manual_seed(seed)
        return loss_and_grads(model, params, lambda m: contrastive_loss(*m(q, p), 2, temperature=0.05))

    def cached(seed):
        torch.manual_seed(seed)
        return loss_and_grads(model, params, lambda m: grad_cache_biencoder(
            m, q, p, lambda qr, pr: contrastive_loss(qr, pr, 2, temperature=0.05), 24)[0], backward=False)

    assert_same(plain(5), cached(5))
    assert abs(plain(5)[0] - plain(6)[0]) > 1e-4  # dropout really is on: another seed, another loss
    assert model.chunk_tokens == 24


def test_activation_checkpointing_recomputes_and_gives_the_same_grads(tiny_model_dir):
    from retrieval_kit.dist import enable_activation_checkpointing

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    q, p = collate_biencoder(tok, QUERIES, GROUPS, 32, 32)
    results, saved = [], []
    for checkpointed in (False, True):
        enc = load_encoder(tiny_model_dir).train()  # dropout on: checkpointing replays the RNG too
        if checkpointed:
            enable_activation_checkpointing(enc)
        model = BiEncoder(enc, "avg", True)
        count = [0]

        def pack(t):
            count[0] += 1
            return t
        torch.manual_seed(3)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            results.append(loss_and_grads(model, enc.named_parameters(),
                                          lambda m: contrastive_loss(*m(q, p), 2, temperature=0.05)))
        saved.append(count[0])
    assert_same(*results)
    assert saved[1] < saved[0] / 2  # the layers' activations were not kept for backward


@pytest.mark.parametrize("side,pooling", [("right", "native"), ("left", "last")])
def test_reranker_grad_cache_equals_plain_backward_with_dropout_on(tiny_model_dir, tiny_decoder_dir, side, pooling):
    from retrieval_kit.encode import grad_cache_reranker

    path = tiny_model_dir if side == "right" else tiny_decoder_dir
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    net = load_reranker(path).train()
    for m in net.modules():  # Llama ships with attention dropout 0: turn it on to test the RNG replay
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.1
    setup_pad_token(tok, net)
    tok.padding_side = side
    batch = collate_rerank(tok, QUERIES, GROUPS, max_length=64, append_eos=side == "left")
    model = CrossEncoder(net, pooling, chunk_tokens=40)
    params = list(net.named_parameters())

    def plain(seed):
        torch.manual_seed(seed)
        return loss_and_grads(model, params, lambda m: listwise_loss(m(batch), 2))

    def cached(seed):
        torch.manual_seed(seed)
        return loss_and_grads(model, params, lambda m: grad_cache_reranker(
            m, batch, lambda s: listwise_loss(s, 2), 40)[0], backward=False)

    assert_same(plain(5), cached(5))
    assert abs(plain(5)[0] - plain(6)[0]) > 1e-5  # dropout really is on: another seed, another loss
    assert model.chunk_tokens == 40

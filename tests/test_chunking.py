"""retrieval_kit/chunking.py: length-sorted chunks give the loss and gradients of the unchunked batch."""

import pytest
import torch
from transformers import AutoTokenizer

from retrieval_kit.chunking import chunk_batch
from retrieval_kit.collate import collate_biencoder, collate_rerank
from retrieval_kit.losses import contrastive_loss, listwise_loss
from retrieval_kit.heads.classifier import Classifier, load as load_reranker
from retrieval_kit.heads.single_vector import BiEncoder
from retrieval_kit.models import load_encoder, setup_pad_token

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
    lengths = (2, 6, 3, 6, 1)
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in lengths])
    ids = torch.arange(30).view(5, 6) * mask
    c = chunk_batch({"input_ids": ids, "attention_mask": mask}, chunk_tokens=12)
    assert not c.left and c.order.tolist() == [1, 3, 2, 0, 4] and c.n_tokens == sum(lengths)
    assert c.chunks == ((0, 2, 6), (2, 5, 3))  # 12 // 6 = 2 rows of 6 tokens, then the last 3 rows (12 // 3 = 4 fit)
    covered = [r for s, e, _ in c.chunks for r in range(s, e)]
    assert covered == list(range(5)) and all((e - s) * w <= 12 for s, e, w in c.chunks)
    for (s, e, w), (s2, e2, sub) in zip(c.chunks, c.pieces()):  # each piece is its rows cut to its width
        assert (s, e) == (s2, e2) and torch.equal(sub["input_ids"], ids[c.order[s:e], :w])
        assert sub["attention_mask"].sum() == mask[c.order[s:e]].sum()  # only pad columns were cut
    rows = torch.cat([sub["input_ids"][:, 0] for _, _, sub in c.pieces()])
    assert torch.equal(c.restore(rows), ids[:, 0])  # back in batch order
    off = chunk_batch({"input_ids": ids, "attention_mask": mask}, 0)
    assert off.chunks == () and off.pieces()[0][2]["input_ids"] is ids


def test_chunk_widths_are_multiples_and_chunks_fit_the_budget():
    torch.manual_seed(0)
    for trial in range(20):
        lengths = torch.randint(1, 61, (13,)).tolist()
        width = -(-max(lengths) // 8) * 8  # the batch padded to a multiple of 8
        mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
        c = chunk_batch({"input_ids": mask.clone(), "attention_mask": mask}, 96, multiple=8)
        longest = [max(lengths[i] for i in c.order[s:e].tolist()) for s, e, _ in c.chunks]
        assert all(w % 8 == 0 and w <= width and w >= n for (_, _, w), n in zip(c.chunks, longest))
        assert all((e - s) * w <= 96 or e - s == 1 for s, e, w in c.chunks)


def test_same_chunk_count_on_every_rank_from_the_max_length():
    """FSDP2: each chunk's forward is a collective, so two ranks with the same batch size but different
    lengths must cut as many chunks; with max_length the count depends on the batch size alone."""
    counts = set()
    for lengths in ([3] * 16, [60] * 16, list(range(1, 17)), [64, 1] * 8):
        mask = torch.tensor([[1] * n + [0] * (64 - n) for n in lengths])
        c = chunk_batch({"input_ids": mask.clone(), "attention_mask": mask}, 256, multiple=8, max_length=64)
        counts.add(len(c.chunks))
        assert all((e - s) * w <= 256 for s, e, w in c.chunks)  # still within the budget
        assert [r for s, e, _ in c.chunks for r in range(s, e)] == list(range(16))
    assert counts == {4}  # 16 rows / (256 // 64)
    free = {len(chunk_batch({"input_ids": m, "attention_mask": m}, 256, 8).chunks)
            for m in (torch.ones(16, 8, dtype=torch.long), torch.ones(16, 64, dtype=torch.long))}
    assert len(free) == 2  # without it the count follows the lengths (1 chunk of short rows, 4 of long)


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
    model = BiEncoder(enc, pooling, True)
    for chunk_tokens in (0, 24, 40):
        multiple = 8 if chunk_tokens == 40 else None  # widths rounded up to a multiple: the same results
        qc, pc = chunk_batch(q, chunk_tokens, multiple), chunk_batch(p, chunk_tokens, multiple)
        assert len(pc.pieces()) == (1 if chunk_tokens == 0 else len(pc.chunks))
        assert chunk_tokens == 0 or len(pc.chunks) > 2
        results.append(loss_and_grads(model, enc.named_parameters(),
                                      lambda m: contrastive_loss(*m(q=qc, p=pc).values(), 2, temperature=0.05)))
    for other in results[1:]:
        assert_same(results[0], other)


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
    model = Classifier(net, pooling)
    for chunk_tokens in (0, 40, 48):
        pairs = chunk_batch(batch, chunk_tokens, 8 if chunk_tokens == 48 else None)
        assert chunk_tokens == 0 or (len(pairs.chunks) > 2 and pairs.left == (side == "left"))
        results.append(loss_and_grads(model, net.named_parameters(),
                                      lambda m: listwise_loss(m(pairs=pairs)["pairs"], 2)))
    for other in results[1:]:
        assert_same(results[0], other)

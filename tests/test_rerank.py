import math

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from retrieval_kit import data
from retrieval_kit.collate import DEFAULT_TEMPLATE, collate_rerank, encode_pair
from retrieval_kit.losses import listwise_loss
from retrieval_kit.models import CrossEncoder, load_reranker, make_bidirectional, setup_pad_token


def test_group_to_pairs_positive_first():
    assert data.group_to_pairs("q", ["pos", "n1", "n2"]) == [("q", "pos"), ("q", "n1"), ("q", "n2")]


@pytest.mark.parametrize("B,n", [(1, 1), (2, 3), (5, 2), (3, 4)])
def test_collate_rerank_shapes_and_order(tokenizer, B, n):
    queries = [f"query {i}" for i in range(B)]
    groups = [[f"positive {i}"] + [f"negative {i} {j}" for j in range(1, n)] for i in range(B)]
    batch = collate_rerank(tokenizer, queries, groups, max_length=64, pad_to_multiple_of=8)
    assert batch["input_ids"].shape[0] == B * n and batch["input_ids"].shape[1] % 8 == 0
    texts = tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True)
    for i in range(B):
        assert f"query {i}" in texts[i * n] and f"positive {i}" in texts[i * n]
        for j in range(1, n):
            assert f"negative {i} {j}" in texts[i * n + j]
    logits = torch.randn(B * n, requires_grad=True)
    loss = listwise_loss(logits, n)  # labels come from the batch shape alone
    loss.backward()
    assert logits.grad.view(B, n)[:, 0].le(0).all()  # the positive is pushed up


def test_truncation_keeps_the_query(tokenizer):
    query = "how do i compress files with a fast algorithm"
    passage = "zstd is a compression tool " * 40
    ids = encode_pair(tokenizer, query, passage, DEFAULT_TEMPLATE, max_length=32)
    assert len(ids) == 32
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert query in text and "passage" in text and ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
    short = encode_pair(tokenizer, query, "zstd", DEFAULT_TEMPLATE, max_length=512)
    assert len(short) < 32  # nothing cut when it fits
    full = tokenizer("question:" + query + " \n \n passage:zstd")["input_ids"]
    assert short == full  # same ids as tokenizing the whole templated text
    with pytest.raises(ValueError, match="template"):
        encode_pair(tokenizer, query, passage, "{query} only", 32)


def naive_listwise(logits, n):
    total = 0.0
    rows = logits.view(-1, n).tolist()
    for row in rows:
        total += -row[0] + math.log(sum(math.exp(x) for x in row))
    return total / len(rows)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_listwise_loss_matches_naive_loop(n):
    torch.manual_seed(n)
    logits = torch.randn(3 * n, dtype=torch.float64)
    assert listwise_loss(logits, n).item() == pytest.approx(naive_listwise(logits, n), rel=1e-6)
    with pytest.raises(ValueError, match="groups of"):
        listwise_loss(torch.randn(7), 2)


def test_decoder_pad_token_and_left_right_padding(tiny_decoder_dir):
    tok = AutoTokenizer.from_pretrained(tiny_decoder_dir)
    assert tok.pad_token is None
    net = load_reranker(tiny_decoder_dir).eval()
    setup_pad_token(tok, net)
    assert tok.pad_token == tok.eos_token and net.config.pad_token_id == tok.eos_token_id
    queries, groups = ["python library"], [["a python package for data", "the server"]]
    out = {}
    for side in ("left", "right"):
        tok.padding_side = side
        batch = collate_rerank(tok, queries, groups, max_length=64, append_eos=True)
        assert (batch["attention_mask"][:, 0 if side == "left" else -1] == 0).any()  # really padded
        for pooling in ("last", "avg"):
            with torch.no_grad():
                out[side, pooling] = CrossEncoder(net, pooling)(batch)
    for pooling in ("last", "avg"):
        assert torch.allclose(out["left", pooling], out["right", pooling], atol=1e-5), pooling


def hidden_states(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state


def test_bidirectional_attention_sees_later_tokens(tiny_decoder_dir):
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    changed = ids.clone()
    changed[0, -1] = 10  # change only the last token
    causal = AutoModel.from_pretrained(tiny_decoder_dir).eval()
    h0, h1 = hidden_states(causal, ids), hidden_states(causal, changed)
    assert torch.allclose(h0[0, :-1], h1[0, :-1], atol=1e-6)  # causal: earlier tokens blind to it
    bidir = make_bidirectional(AutoModel.from_pretrained(tiny_decoder_dir).eval())
    b0, b1 = hidden_states(bidir, ids), hidden_states(bidir, changed)
    assert (b0[0, 0] - b1[0, 0]).abs().max() > 1e-4  # the first token now sees the last one
    # with padding too (an explicit mask goes through the bidirectional mask path)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    with torch.no_grad():
        pad0 = bidir(input_ids=torch.cat([ids, ids]), attention_mask=mask).last_hidden_state
        pad1 = bidir(input_ids=torch.cat([changed, ids]), attention_mask=mask).last_hidden_state
    assert (pad0[0, 0] - pad1[0, 0]).abs().max() > 1e-4
    assert torch.allclose(pad0[1, :4], pad1[1, :4], atol=1e-6)  # masked tokens stay invisible

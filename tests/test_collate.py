"""retrieval_kit/collate.py: shapes, order, prefixes, padding and the pair encodings."""

import pytest
import torch
from transformers import AutoTokenizer

from retrieval_kit.collate import collate_biencoder, collate_rerank
from retrieval_kit.pairs import DEFAULT_TEMPLATE, encode_pair, PAIR, pair_layout
from retrieval_kit.losses import listwise_loss

LONG = "zstd is a fast lossless compression algorithm with a very long description " * 30


def test_collate_shapes_order_prefix_and_padding(tokenizer):
    queries = ["first query", "a second, longer query here"]
    groups = [["pos zero", "neg zero a", "neg zero b"], ["pos one is long " * 5, "neg one a", "neg one b"]]
    q, p = collate_biencoder(tokenizer, queries, groups, 16, 24, "query: ", "passage: ", pad_to_multiple_of=8)
    assert q["input_ids"].shape[0] == 2 and p["input_ids"].shape[0] == 6
    assert q["input_ids"].shape[1] % 8 == 0 and p["input_ids"].shape[1] % 8 == 0
    assert p["input_ids"].shape[1] <= 24
    decoded = tokenizer.batch_decode(p["input_ids"], skip_special_tokens=True)
    assert decoded[0].startswith("passage : pos zero") or decoded[0].startswith("passage: pos zero")
    assert "pos one" in decoded[3] and "neg zero b" in decoded[2]  # positive of query i at row i * n
    assert tokenizer.decode(q["input_ids"][1], skip_special_tokens=True).startswith("query")
    # pads to the longest in the batch, not to max length
    q2, _ = collate_biencoder(tokenizer, ["a", "b"], [["x"], ["y"]], 64, 64)
    assert q2["input_ids"].shape[1] < 64
    with pytest.raises(ValueError, match="same size"):
        collate_biencoder(tokenizer, queries, [["a", "b"], ["c"]], 8, 8)


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


def test_pair_encoding_matches_the_tokenizer_and_keeps_the_query(tokenizer):
    q, short = "how do i compress files", "zstd tool"
    for p in (short, LONG):  # the reference: the tokenizer's own pair encoding, passage truncated
        ref = tokenizer(q, p, truncation="only_second", max_length=48)
        batch = collate_rerank(tokenizer, [q], [[p]], PAIR, 48)
        n = int(batch["attention_mask"].sum())
        assert batch["input_ids"][0, :n].tolist() == ref["input_ids"]
        assert batch["token_type_ids"][0, :n].tolist() == ref["token_type_ids"]
    long_q = "compress files quickly " * 30  # the query alone is too long: cut from its end, no passage
    q_ids = tokenizer(long_q, add_special_tokens=False)["input_ids"]
    ids = encode_pair(tokenizer, long_q, short, PAIR, 32)
    assert ids == [tokenizer.cls_token_id] + q_ids[:29] + [tokenizer.sep_token_id] * 2
    with pytest.raises(ValueError, match="no room"):
        pair_layout(tokenizer, "a very long template " * 20 + "{query} {passage}").check(32)


def test_no_over_length_tokenizer_warning(tokenizer, caplog):
    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)  # fresh: transformers warns once per tokenizer
    with caplog.at_level("WARNING"):
        collate_rerank(tok, ["q"], [["word " * 2000]], PAIR, 64)
        assert "longer than the specified maximum" not in caplog.text
        tok("word " * 2000)  # the reference: an untruncated encoding does warn, and is caught here
        assert "longer than the specified maximum" in caplog.text

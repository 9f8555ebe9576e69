import pytest
import torch
import torch.nn.functional as F

from retrieval_kit.collate import collate_biencoder, tokenize
from retrieval_kit.models import BiEncoder, encode, load_encoder, pool


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


def naive_pool(hidden, mask, mode):
    out = []
    for h, m in zip(hidden, mask):
        idx = [i for i in range(len(m)) if m[i] == 1]
        if mode == "avg":
            out.append(torch.stack([h[i] for i in idx]).mean(0))
        elif mode == "cls":
            out.append(h[0])
        else:
            out.append(h[idx[-1]])
    return torch.stack(out)


@pytest.mark.parametrize("mode", ["avg", "cls", "last"])
def test_pooling_modes_match_naive_loop(mode):
    torch.manual_seed(0)
    hidden = torch.randn(3, 5, 4)
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    left = right.flip(1)
    for mask in (right, left):
        if mode == "cls" and mask is left:
            continue  # cls means position 0 by definition
        assert torch.allclose(pool(hidden, mask, mode), naive_pool(hidden, mask, mode), atol=1e-6)


def test_last_pooling_left_and_right_padding_pick_the_same_token():
    torch.manual_seed(0)
    tokens = torch.randn(2, 3, 4)
    right_h = torch.cat([tokens, torch.zeros(2, 2, 4)], 1)
    left_h = torch.cat([torch.zeros(2, 2, 4), tokens], 1)
    right_m = torch.tensor([[1, 1, 1, 0, 0]] * 2)
    assert torch.equal(pool(right_h, right_m, "last"), pool(left_h, right_m.flip(1), "last"))
    assert torch.equal(pool(right_h, right_m, "last"), tokens[:, -1])


def test_encode_normalizes_and_biencoder_matches(tiny_model_dir, tokenizer):
    model = load_encoder(tiny_model_dir).eval()
    batch = tokenize(tokenizer, ["hello world", "a longer sentence with more words"], 32)
    reps = encode(model, batch, "avg", normalize=True)
    assert torch.allclose(reps.norm(dim=-1), torch.ones(2), atol=1e-5)
    raw = encode(model, batch, "avg", normalize=False)
    assert torch.allclose(F.normalize(raw, dim=-1), reps, atol=1e-6)
    q, p = BiEncoder(model, "avg", True)(batch, batch)
    assert torch.allclose(q, reps) and torch.allclose(p, reps)
    with pytest.raises(ValueError, match="pooling"):
        BiEncoder(model, "max")

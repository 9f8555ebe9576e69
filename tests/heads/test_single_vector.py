"""--head single-vector (issue 63: one test file per kind): the pooled vector against a naive computation
for each pooling, its dir read by its own reader (a Dense claimed, a plain dir not), and the real MiniLM dir
as sentence-transformers itself embeds it (the consumer, as a user's dir comes in). 2 ranks = 1 process:
tests/test_dist.py; the export read back by SentenceTransformer: tests/test_st_format.py; golden runs:
tests/test_golden.py (bi/* configs)."""

import json
import os

import pytest
import torch

from retrieval_kit import heads
from retrieval_kit.heads import single_vector
from tests.conftest import minilm_dir


def naive(hidden, mask, pooling):
    """Each text's vector by a loop over its tokens: the mean of its real tokens, the first, or the last."""
    out = []
    for h, m in zip(hidden, mask):
        real = [i for i in range(len(m)) if m[i]]
        v = {"avg": sum(h[i] for i in real) / len(real), "cls": h[0], "last": h[real[-1]]}[pooling]
        out.append(v / v.norm())
    return torch.stack(out)


@pytest.mark.parametrize("pooling", ["avg", "cls", "last"])
def test_the_vector_is_the_pooled_and_normalized_hidden_state(tiny_model_dir, tokenizer, pooling):
    model = single_vector.load(tiny_model_dir).eval()
    batch = tokenizer(["a short text", "a somewhat longer text than the first"], padding=True, return_tensors="pt")
    with torch.no_grad():
        got = single_vector.embedder(model, {"pooling": pooling, "normalize": True})(q=batch)["q"]
        hidden = model(**batch).last_hidden_state
    assert torch.allclose(got, naive(hidden, batch["attention_mask"], pooling), atol=1e-6)


def test_its_reader_claims_a_sentence_transformers_dir_with_its_dense_and_not_a_plain_dir(tiny_model_dir, tmp_path):
    from safetensors.torch import save_file

    assert single_vector.read_dir(tiny_model_dir) is None  # no modules.json: not a sentence-transformers dir
    d = tmp_path / "st"
    os.makedirs(d / "1_Pooling")
    os.makedirs(d / "2_Dense")
    for name in os.listdir(tiny_model_dir):
        if os.path.isfile(os.path.join(tiny_model_dir, name)):
            (d / name).write_bytes(open(os.path.join(tiny_model_dir, name), "rb").read())
    hidden = json.load(open(d / "config.json"))["hidden_size"]
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    (d / "2_Dense" / "config.json").write_text(json.dumps({"in_features": hidden, "out_features": 6, "bias": True}))
    save_file({"linear.weight": torch.randn(6, hidden), "linear.bias": torch.zeros(6)}, d / "2_Dense" / "model.safetensors")
    st, own = single_vector.read_dir(str(d))
    assert st["pooling"] == "cls" and st["normalize"] is False
    assert own["dense"]["out_features"] == 6 and own["linear"] == [(own["dense"], "Dense")]
    spec = heads.read_spec(str(d))  # the registry asks the other kinds first, then this one
    assert spec.head == "single-vector" and spec.own["dense"]["in_features"] == hidden
    assert single_vector.embedding_size(single_vector.load(str(d), spec=spec)) == 6


def test_the_real_minilm_dir_embeds_as_sentence_transformers_embeds_it():
    from sentence_transformers import SentenceTransformer

    from retrieval_kit.evaluate import load_biencoder

    texts = ["How do I list open ports on Debian?", "ss -tulpn shows listening sockets and their processes."]
    model, tok, settings, head = load_biencoder(minilm_dir())
    assert head is single_vector and settings["pooling"] == "avg" and settings["normalize"] is True
    batch = tok(texts, padding=True, truncation=True, max_length=settings["passage_max_length"], return_tensors="pt")
    with torch.no_grad():
        ours = model(p=batch)["p"]
    theirs = SentenceTransformer(minilm_dir(), device="cpu").encode(texts, convert_to_tensor=True)
    assert torch.allclose(ours, theirs, atol=1e-5)

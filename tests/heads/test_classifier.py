"""--head classifier (issue 63: one test file per kind): the pair's score is the stock
AutoModelForSequenceClassification's logit (native pooling) and the classification head over pooled states
(another pooling), computed by hand; what starts fresh is the head alone; what it leaves out reads as the
registry's defaults. 2 ranks = 1 process and the export read back by CrossEncoder: tests/test_dist.py,
tests/test_train_reranker.py; golden runs: tests/test_golden.py (rerank/* configs)."""

import torch

from retrieval_kit import heads
from retrieval_kit.heads import classifier


def pairs(tokenizer):
    return tokenizer(["what is ss", "list ports"], ["ss shows sockets", "a recipe for bread and butter"],
                     padding=True, return_tensors="pt")


def test_native_scores_are_the_stock_models_logits(tiny_model_dir, tokenizer):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    net = classifier.load(tiny_model_dir).eval()
    batch = pairs(tokenizer)
    stock = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).eval()
    stock.load_state_dict(net.state_dict())
    with torch.no_grad():
        got = classifier.scorer(net, "native")(pairs=batch)["pairs"]
        want = stock(**batch).logits.view(-1)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-6)


def test_pooled_scores_are_the_head_over_the_mean_of_the_real_tokens(tiny_model_dir, tokenizer):
    torch.manual_seed(0)
    net = classifier.load(tiny_model_dir).eval()
    batch = pairs(tokenizer)
    with torch.no_grad():
        got = classifier.scorer(net, "avg")(pairs=batch)["pairs"]
        hidden = net.base_model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        mean = (hidden * mask).sum(1) / mask.sum(1)
        want = classifier.rerank_head(net)(mean).view(-1)
    assert torch.allclose(got, want, atol=1e-6)


def test_only_the_head_starts_fresh_and_the_rest_reads_as_the_registrys_defaults(tiny_model_dir):
    net = classifier.load(tiny_model_dir)
    fresh = {n for n, p in net.named_parameters() if any(p is q for q in classifier.fresh_params(net))}
    assert fresh and all(n.startswith(("classifier.", "bert.pooler.")) for n in fresh)
    assert heads.get("classifier") is classifier and heads.default("reranker") is classifier
    assert classifier.token_ids(None, ["yes", "no"]) is None and classifier.memory_note(net) is None
    assert classifier.finish_export("stage", {"a": 1}, False, False) == {"a": 1}
    assert classifier.token_ids is heads.DEFAULTS["token_ids"]  # (left out of the module: the registry's)

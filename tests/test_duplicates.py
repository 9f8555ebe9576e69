"""Duplicate-safe in-batch negatives (issue 18): a query's own positive, wherever its text appears
again in the batch, is not one of its negatives - against a naive loop that drops those candidates
by hand; GradCache gives the plain step's masked loss; the count is logged. (2 ranks with the
gather: tests/dist_worker.py, `masked_gather`.)"""

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from retrieval_kit import loop
from retrieval_kit.collate import biencoder_inputs, text_keys
from retrieval_kit.losses import contrastive_loss, duplicate_mask
from retrieval_kit.heads.single_vector import BiEncoder
from retrieval_kit.models import load_encoder
from tests.conftest import ROOT, read_jsonl, run_script


def naive_masked_infonce(q, p, keys, n, temperature, in_batch):
    """Mean over queries of -log softmax over the candidates, each query's duplicates of its own
    positive (same key, another row) dropped by hand."""
    total = 0.0
    for i, qi in enumerate(q.tolist()):
        rows = range(len(p)) if in_batch else range(i * n, (i + 1) * n)
        pos = i * n
        keep = [j for j in rows if j == pos or keys[j] != keys[pos]]
        logits = {j: sum(a * b for a, b in zip(qi, p[j].tolist())) / temperature for j in keep}
        top = max(logits.values())
        total += top + math.log(sum(math.exp(v - top) for v in logits.values())) - logits[pos]
    return total / len(q)


@pytest.mark.parametrize("in_batch", [True, False])
def test_masked_loss_equals_a_naive_loop_that_drops_the_duplicates(in_batch):
    torch.manual_seed(0)
    q, p = F.normalize(torch.randn(3, 8), dim=-1), F.normalize(torch.randn(9, 8), dim=-1)
    texts = ["A", "x", "A", "B", "A", "y", "C", "B", "z"]  # 3 queries x 3 passages, positives A, B, C
    keys = text_keys(texts)
    # query 0 (positive "A", row 0): "A" again at rows 2 (its own negative) and 4; query 1 ("B", row 3):
    # at row 7; query 2 ("C"): none. Without in-batch negatives only a query's own group counts: row 2.
    mask = duplicate_mask(keys, 3, in_batch)
    assert int(mask.sum()) == (3 if in_batch else 1)
    got = contrastive_loss(q, p, 3, 0.1, in_batch, mask=mask).item()
    assert got == pytest.approx(naive_masked_infonce(q, p, keys.tolist(), 3, 0.1, in_batch), rel=1e-5)
    unmasked = contrastive_loss(q, p, 3, 0.1, in_batch).item()
    assert abs(got - unmasked) > 1e-3


@pytest.mark.slow
def test_keys_are_the_same_in_every_process():
    import os
    import subprocess
    import sys

    code = "from retrieval_kit.collate import text_keys; print(text_keys(['a text', 'ü']).tolist())"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                           env=dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=ROOT)).stdout
            for seed in ("1", "2")}
    assert len(outs) == 1 and outs.pop().strip() == str(text_keys(["a text", "ü"]).tolist())


def test_grad_cache_step_gives_the_plain_steps_masked_loss_and_grads(tiny_model_dir):
    from retrieval_kit.losses import biencoder_loss

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    enc = load_encoder(tiny_model_dir).train()
    model = BiEncoder(enc)
    queries = ["a tool", "a library", "a server"]
    groups = [["text one", "text two"], ["text three", "text one"], ["text four", "text three"]]  # twins
    batch = biencoder_inputs(queries, groups, tokenizer=tok, query_max_length=16, passage_max_length=16,
                             chunk_tokens=16)
    assert len(batch["p"].chunks) > 1

    def run(step, mask_duplicates):
        model.zero_grad()
        torch.manual_seed(3)
        loss_fn = functools.partial(biencoder_loss, n_passages=2, temperature=0.05, mask_duplicates=mask_duplicates)
        loss, acc, counts = step(model, batch, loss_fn, 1, True)
        return loss.item(), {n: x.grad.clone() for n, x in enc.named_parameters() if x.grad is not None}, counts

    plain, cached = run(loop.plain_step, True), run(loop.grad_cache_step, True)
    assert plain[0] == pytest.approx(cached[0], rel=1e-6) and int(plain[2]["duplicates_masked"]) == 2
    scale = max(g.abs().max().item() for g in plain[1].values())
    assert all((plain[1][k] - cached[1][k]).abs().max().item() <= 1e-5 * scale for k in plain[1])
    off = run(loop.plain_step, False)
    assert off[0] > plain[0] and int(off[2]["duplicates_masked"]) == 0  # the twins were pushing the positives away


@pytest.mark.slow
def test_the_script_logs_the_duplicates_it_masked(tiny_model_dir, tmp_path):
    import json

    records = [{"query": f"q{i}", "pos_doc": [f"passage {i}"], "neg_doc": [f"passage {(i + 1) % 8}"]}
               for i in range(8)]  # every negative is another query's positive
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    run_script("train_biencoder.py", ["--model", tiny_model_dir, "--train-file", train, "--val-file", "",
                                      "--batch-size", 8, "--max-steps", 1, "--warmup-steps", 0, "--passage-max-length", 16,
                                      "--output-dir", tmp_path / "run"])
    row = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["split"] == "train"][0]
    assert row["duplicates_masked"] == 8  # each query's positive is the next query's negative


def test_validation_leaves_a_copy_of_the_positive_out_of_its_group(tiny_model_dir):
    """Reference: the same query scored against its group with the copy dropped by hand."""
    import functools

    from retrieval_kit.loop import biencoder_group_scores
    from retrieval_kit.metrics import group_metric_sums

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = BiEncoder(load_encoder(tiny_model_dir).eval())
    collate = functools.partial(biencoder_inputs, tokenizer=tok, query_max_length=16, passage_max_length=16)
    score = functools.partial(biencoder_group_scores, model, collate=collate, temperature=0.05, device=torch.device("cpu"),
                              autocast_dtype=None)
    queries, groups = ["a tool", "a server"], [["text one", "text one", "text two"], ["text three", "a", "b"]]
    with torch.no_grad():
        masked, masked_loss = score(queries, groups)
        unmasked, _ = score(queries, groups, mask_duplicates=False)
        dropped, dropped_loss = score(queries[:1], [["text one", "text two"]])
        others, _ = score(queries[1:], groups[1:], mask_duplicates=False)
    assert masked[0, 1] == float("-inf") and torch.allclose(masked[0, [0, 2]], dropped[0], atol=1e-6)
    assert torch.allclose(masked[1], others[0], atol=1e-6)  # a group without a copy is untouched
    naive = (dropped_loss.item() + F.cross_entropy(others / 0.05, torch.zeros(1, dtype=torch.long)).item()) / 2
    assert masked_loss.item() == pytest.approx(naive, rel=1e-5)
    assert group_metric_sums(masked)[0] == group_metric_sums(dropped)[0] + group_metric_sums(others)[0]
    assert group_metric_sums(unmasked[:1])[0] == 0  # unmasked, the copy ties the positive: counted a miss

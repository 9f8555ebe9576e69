"""Reranker exports score the same in transformers and sentence-transformers as in the kit.

The references are the real consumers: AutoModelForSequenceClassification with the exported
tokenizer on (query, passage) pairs, and sentence-transformers' CrossEncoder.predict.
"""

import json
import os

import pytest
import torch
from transformers import AutoTokenizer

from retrieval_kit import data
from retrieval_kit.records import read_records
from retrieval_kit.pairs import DEFAULT_TEMPLATE, encode_pair, PAIR
from retrieval_kit.encode import rerank_groups
from retrieval_kit.export import export_reranker, load_exported_reranker
from retrieval_kit.heads.classifier import load as load_reranker, rerank_head
from retrieval_kit.models import setup_pad_token
from tests.conftest import reference_pair_ids, ROOT, stock_scores


LONG = "zstd is a fast lossless compression algorithm with a very long description " * 30


def val_groups(n_groups=6, n=4):
    val, _ = read_records(os.path.join(ROOT, "data", "val.jsonl"), n)
    val = val[:n_groups]
    groups = [data.fixed_group(r, n) for r in val]
    groups[0][1] = LONG  # one passage past the max length: truncated
    return [r.query for r in val], groups


def export_fresh(model_dir, tmp_path, template, pooling="native", append_eos=False, max_length=64):
    torch.manual_seed(0)
    net = load_reranker(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    setup_pad_token(tok, net)
    with torch.no_grad():  # a random model at init scale scores near-constant: spread the scores apart
        for m in net.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0.0, 0.15)
        rerank_head(net).weight.mul_(10.0)
    settings = {"kind": "reranker", "pooling": pooling, "bidirectional": False, "prompt_template": template,
                "rerank_max_length": max_length, "append_eos": append_eos, "padding_side": tok.padding_side,
                "pad_to_multiple_of": 8}
    out = str(tmp_path / "final")
    written = export_reranker(out, net, tok, settings)
    return out, written


@pytest.mark.parametrize("template", [PAIR, "Q: {query} | P: {passage}"])
def test_encoder_export_scores_the_same_in_transformers_and_sentence_transformers(tiny_model_dir, tmp_path, template):
    out, settings = export_fresh(tiny_model_dir, tmp_path, template)
    assert settings["portable"] and settings["tokenizer_pairs"] and settings["kit_only"] == []
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["sentence_transformers"]["activation_fn"] == "torch.nn.modules.linear.Identity"
    queries, groups = val_groups()
    model, tok, saved = load_exported_reranker(out)
    kit = rerank_groups(model, tok, queries, groups, saved)
    assert kit.std() > 0.1  # the comparison below is not between constants
    s_hf, s_st = stock_scores(out, queries, groups)
    assert (kit - s_hf).abs().max() < 1e-5
    assert (kit - s_st).abs().max() < 1e-5


@pytest.mark.parametrize("append_eos", [False, True])
def test_decoder_export_with_a_template_scores_the_same(tiny_decoder_dir, tmp_path, append_eos):
    out, settings = export_fresh(tiny_decoder_dir, tmp_path, DEFAULT_TEMPLATE, append_eos=append_eos)
    assert settings["portable"] and settings["tokenizer_pairs"]
    queries = ["python library for data", "graphical user interface tool"]
    groups = [["a python package for data files", "the server", "command line tool " * 30],
              ["a graphical tool for the user", "documentation of the library", "data"]]
    model, tok, saved = load_exported_reranker(out)
    kit = rerank_groups(model, tok, queries, groups, saved)
    assert kit.std() > 0.1
    # the trained input, token for token: the kit's template ids from the exported tokenizer's chat template
    train_tok = AutoTokenizer.from_pretrained(tiny_decoder_dir)
    setup_pad_token(train_tok)
    for p in (groups[0][0], groups[0][2]):  # as it fits, and cut to 64 tokens
        ids = encode_pair(train_tok, queries[0], p, DEFAULT_TEMPLATE, 64, append_eos)
        assert reference_pair_ids(AutoTokenizer.from_pretrained(out), queries[0], p, 64) == ids
    assert len(ids) == 64 and (ids[-1] == train_tok.eos_token_id) == append_eos
    s_hf, s_st = stock_scores(out, queries, groups)
    assert (kit - s_hf).abs().max() < 1e-5
    assert (kit - s_st).abs().max() < 1e-5


def test_kit_only_pooling_is_recorded(tiny_model_dir, tmp_path):
    out, settings = export_fresh(tiny_model_dir, tmp_path, PAIR, pooling="avg")
    assert not settings["portable"] and "--pooling avg" in settings["kit_only"][0]
    queries, groups = val_groups(3)
    model, tok, saved = load_exported_reranker(out)
    kit = rerank_groups(model, tok, queries, groups, saved)
    s_hf, _ = stock_scores(out, queries, groups)
    assert (kit - s_hf).abs().max() > 1e-3  # really scored differently: the flag is needed


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_pairs_scored_in_length_sorted_batches_equal_each_pair_scored_alone(tiny_model_dir, tiny_decoder_dir,
                                                                            tmp_path, kind):
    from retrieval_kit.encode import score_pairs

    out, _ = export_fresh(tiny_model_dir if kind == "encoder" else tiny_decoder_dir, tmp_path, DEFAULT_TEMPLATE)
    model, tok, saved = load_exported_reranker(out)
    queries, groups = val_groups()
    qs = [q for q, g in zip(queries, groups) for _ in g]
    ps = [p for g in groups for p in g]
    together = score_pairs(model, tok, qs, ps, saved, batch_size=5)  # batches of 5 mixed pairs, in length order
    alone = torch.tensor([score_pairs(model, tok, [q], [p], saved, batch_size=1)[0].item() for q, p in zip(qs, ps)])
    assert together.std() > 0.1 and (together - alone).abs().max() < 1e-5  # no padding in `alone`; back in order
    assert (rerank_groups(model, tok, queries, groups, saved, batch_size=2).flatten() - alone).abs().max() < 1e-5

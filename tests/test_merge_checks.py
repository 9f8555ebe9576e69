"""Issue 61: the merge tool and --merge-alphas as a user misuses them. merge --out never an input (a
checkpoint's run export included), never a folder merge did not write, never a file it did not write
deleted; a checkpoint read only as --resume would read it (digests, every tensor, finite values); a base
that shares under half of the tuned model's tensors refused with the counts; no flag dropped in silence;
--merge-alphas keeping the export's adapter/ (at alpha, as peft reads it) and seq_cls/ (as transformers
reads it)."""

import hashlib
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from retrieval_kit import ckpt, merge
from tests.conftest import python_run, run_script
from tests.heads.test_lm import causal_dir, lm_tokenizer  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow  # each test runs the tool or a training run


def digest(folder):
    h = hashlib.sha256()
    for root, _, names in sorted(os.walk(folder)):
        for n in sorted(names):
            h.update(n.encode())
            h.update(open(os.path.join(root, n), "rb").read())
    return h.hexdigest()


def merge_run(*argv):
    return python_run(["-m", "retrieval_kit.merge", *[str(a) for a in argv]])


def refused(out, *says, code=None):
    assert out.returncode != 0 and (code is None or out.returncode == code), out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    for s in says:
        assert s in out.stderr, (s, out.stderr[-2000:])


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir, small_train_file):
    """A 2-step bi-encoder run of the tiny BERT with a checkpoint (and its EMA) at every step."""
    out = tmp_path_factory.mktemp("merge_checks") / "run"
    run_script("train_biencoder.py", ["--model", tiny_model_dir, "--train-file", small_train_file, "--val-file", "",
                                      "--batch-size", 4, "--max-steps", 2, "--ckpt-every", 1, "--lr", 1e-2,
                                      "--ema-decay", 0.5, "--query-max-length", 8, "--passage-max-length", 32,
                                      "--output-dir", out])
    return out


def test_merge_never_writes_over_an_input_or_a_folder_it_did_not_write(run, tiny_model_dir, tmp_path):
    final = run / "final"
    before = digest(final)
    # the run's own export, which the merge reads for the checkpoint's architecture
    refused(merge_run("--models", run / "step_000002" / "ema.safetensors", "--out", final),
            "--out", "its run's export, read for the architecture")
    assert digest(final) == before
    # another run's export, with a file the user added: not a merge's folder
    other = tmp_path / "other_export"
    shutil.copytree(final, other)
    (other / "NOTES.txt").write_text("mine")
    refused(merge_run("--base", tiny_model_dir, "--tuned", final, "--alpha", 0.5, "--out", other),
            "not a merge's folder", "an export of a training run")
    assert (other / "NOTES.txt").read_text() == "mine"
    # an earlier merge is replaced; the same with a file added since is not
    out = tmp_path / "merged"
    for alpha in (0.5, 0.7):
        assert merge_run("--base", tiny_model_dir, "--tuned", final, "--alpha", alpha, "--out", out).returncode == 0
    record = json.load(open(out / "retrieval_kit.json"))["merge"]
    assert record["alpha"] == 0.7 and "model.safetensors" in record["files"] and "retrieval_kit.json" in record["files"]
    (out / "NOTES.txt").write_text("mine")
    refused(merge_run("--base", tiny_model_dir, "--tuned", final, "--alpha", 0.3, "--out", out),
            "files merge did not write (NOTES.txt)")
    assert (out / "NOTES.txt").exists() and json.load(open(out / "retrieval_kit.json"))["merge"]["alpha"] == 0.7


def test_flags_merge_would_not_use_are_one_sentence(run, tiny_model_dir, small_beir, tmp_path):
    final, out = run / "final", tmp_path / "x"
    one = ["--base", tiny_model_dir, "--tuned", final, "--alpha", 0.5]
    many = ["--base", tiny_model_dir, "--tuned", final, "--alpha", "0.5,1", "--dev-beir", small_beir]
    for argv, says in (([*one, "--dev-beir", small_beir], "--dev-beir: only when several --alpha"),
                       ([*one, "--report-beir", small_beir], "--report-beir: only when several --alpha"),
                       ([*one, "--tolerance", 0.1], "--tolerance: only when several --alpha"),
                       ([*many, "--biencoder", final], "--biencoder: " + str(final) + " is a bi-encoder"),
                       (["--models", f"{final},{final}", "--alpha", 0.5], "--alpha weighs --tuned against --base"),
                       (["--models", f"{final},{final}", "--slerp", 0.5, "--weights", "1,2"], "--weights with --slerp"),
                       (["--models", f"{final},{final}", "--tolerance", 0.1], "this merge averages --models")):
        refused(merge_run(*argv, "--out", out), says, code=2)
        assert not out.exists()


def test_a_base_of_another_architecture_is_refused_with_the_counts(run, tiny_decoder_dir, tmp_path):
    out = merge_run("--base", tiny_decoder_dir, "--tuned", run / "final", "--alpha", 0.5, "--out", tmp_path / "x")
    refused(out, f"--base {tiny_decoder_dir}: shares 0 of", "not the model it was tuned from")


def rewrite(ckpt_dir, change):
    """A checkpoint's weights changed by `change(state)`, and its recorded digests made to match (as if written so)."""
    path = os.path.join(ckpt_dir, "model.safetensors")
    state = load_file(path)
    change(state)
    save_file(state, path)
    meta = ckpt.load_meta(ckpt_dir)
    meta["files"] = ckpt.file_sums(ckpt_dir)
    with open(os.path.join(ckpt_dir, "meta.json"), "w") as f:
        json.dump(meta, f)
    assert ckpt.verify(ckpt_dir) is None


def test_a_checkpoint_is_read_only_as_resume_would_read_it(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    flipped = copy / "step_000001" / "model.safetensors"
    data = bytearray(flipped.read_bytes())
    data[-5] ^= 0xFF  # one byte of the last tensor
    flipped.write_bytes(bytes(data))
    refused(merge_run("--models", copy / "step_000001", "--out", tmp_path / "a"), "sha256 differs",
            "merge reads only a checkpoint that --resume would")
    key = "encoder.layer.0.attention.self.query.weight"
    rewrite(copy / "step_000002", lambda s: s[key].fill_(float("nan")))
    refused(merge_run("--models", copy / "step_000002", "--out", tmp_path / "b"), f"{key} holds NaN or infinite")
    rewrite(copy / "step_000002", lambda s: s.pop(key))
    refused(merge_run("--models", copy / "step_000002", "--out", tmp_path / "c"), f"holds no {key}",
            "nothing is taken from elsewhere")
    for name in "abc":
        assert not (tmp_path / name).exists()


def adapter_weights(base_loader, base_dir, adapter_dir):
    """peft's model: the base dir with the adapter dir on it, merged into plain weights."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base_loader(base_dir), adapter_dir).merge_and_unload().state_dict()


def test_merge_alphas_keep_the_adapter_at_alpha_and_the_seq_cls_dir(run, tiny_model_dir, small_train_file,
                                                                    lm_tokenizer, tmp_path):  # noqa: F811
    """A LoRA bi-encoder, a classifier reranker (LoRA with a fresh head: peft's modules_to_save) and an LM
    reranker (LoRA, --export-seq-cls) with --merge-alphas 0.5 (--merge-tolerance 1 takes the smallest):
    final/adapter over the base in peft is final/'s merged weights; final/seq_cls scores as the merged LM; the
    record says both."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    from retrieval_kit.encode import rerank_groups
    from retrieval_kit.export import load_exported_reranker

    common = ["--train-file", small_train_file, "--val-file", "", "--batch-size", 2, "--n-passages", 2, "--max-steps",
              2, "--lr", 1e-2, "--lora-rank", 4, "--export-adapter", "--dev-queries", 6, "--dev-corpus-size", 30,
              "--merge-alphas", "0.5,1", "--merge-tolerance", 1]
    rr = ["--dev-biencoder", run / "final"]
    lm_dir = causal_dir("qwen3", lm_tokenizer, tmp_path / "qwen3")
    runs = {"biencoder": ("train_biencoder.py", tiny_model_dir, ["--passage-max-length", 32], AutoModel),
            "classifier": ("train_reranker.py", tiny_model_dir, [*rr, "--rerank-max-length", 64],
                           AutoModelForSequenceClassification),
            "lm": ("train_reranker.py", lm_dir, [*rr, "--head", "lm", "--prompt-template", "qwen3",
                                                 "--rerank-max-length", 192, "--export-seq-cls"], AutoModelForCausalLM)}
    for kind, (script, base, extra, loader) in runs.items():
        out = tmp_path / kind
        run_script(script, ["--model", base, *common, *extra, "--output-dir", out])
        final = out / "final"
        settings = json.load(open(final / "retrieval_kit.json"))
        assert settings["merge"]["alpha"] == 0.5 and "adapter/adapter_model.safetensors" in settings["merge"]["files"]
        assert settings["lora"]["adapter_alpha"] == 0.5
        want = load_file(final / "model.safetensors")
        got = adapter_weights(lambda d: loader.from_pretrained(d, **({"num_labels": 1} if kind == "classifier" else {})),
                              base, final / "adapter")
        assert set(want) <= set(got), sorted(set(want) - set(got))[:3]
        worst = max(float((got[k].float() - v.float()).abs().max()) for k, v in want.items() if k in got)
        assert worst < 1e-5, (kind, worst)
        if kind == "lm":  # seq_cls/ rebuilt from the merged weights: its one logit is the kit's score
            assert settings["seq_cls"]["written"] and os.path.isdir(final / "seq_cls")
            model, tok, s = load_exported_reranker(str(final))
            queries, groups = ["how do i list files"], [["ls lists files", "zstd compresses data"]]
            kit = rerank_groups(model, tok, queries, groups, s).view(-1)
            from retrieval_kit.collate import collate_rerank
            from retrieval_kit.pairs import rerank_layout

            batch = collate_rerank(tok, queries, groups, max_length=192, layout=rerank_layout(tok, s))
            seq = AutoModelForSequenceClassification.from_pretrained(final / "seq_cls").eval()
            with torch.no_grad():
                logits = seq(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.view(-1)
            assert (logits - kit).abs().max() < 1e-4, (logits, kit)


def test_merging_an_export_with_seq_cls_rebuilds_it(run, lm_tokenizer, small_train_file, tmp_path):  # noqa: F811
    """The tool on an LM reranker exported with --export-seq-cls: the merge's seq_cls/ is its own, as recorded."""
    lm_dir = causal_dir("qwen3", lm_tokenizer, tmp_path / "qwen3")
    out = tmp_path / "lm"
    run_script("train_reranker.py", ["--model", lm_dir, "--head", "lm", "--prompt-template", "qwen3", "--train-file",
                                     small_train_file, "--val-file", "", "--batch-size", 2, "--n-passages", 2,
                                     "--rerank-max-length", 192, "--max-steps", 1, "--export-seq-cls", "--output-dir",
                                     out])
    merged = tmp_path / "merged"
    assert merge_run("--base", lm_dir, "--tuned", out / "final", "--alpha", 0.5, "--out", merged).returncode == 0
    settings = json.load(open(merged / "retrieval_kit.json"))
    assert settings["seq_cls"]["written"] and os.path.isfile(merged / "seq_cls" / "config.json")
    a, b = load_file(merged / "model.safetensors"), load_file(merged / "seq_cls" / "model.safetensors")
    key = next(k for k in a if "layers.0.self_attn.q_proj.weight" in k)
    assert torch.equal(a[key], b[next(k for k in b if "layers.0.self_attn.q_proj.weight" in k)])


def test_merge_alone_reports_its_record_files_against_the_folder(run, tiny_model_dir, tmp_path):
    out = tmp_path / "m"
    assert merge_run("--base", tiny_model_dir, "--tuned", run / "final", "--alpha", 0.25, "--out", out).returncode == 0
    files = json.load(open(out / "retrieval_kit.json"))["merge"]["files"]
    on_disk = sorted(os.path.relpath(os.path.join(r, f), out) for r, _, fs in os.walk(out) for f in fs)
    assert files == on_disk
    assert merge.not_ours(str(out)) is None and merge.not_ours(str(run / "final"))

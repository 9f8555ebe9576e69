"""Issue 52: weight averaging. The EMA of the trained weights (retrieval_kit/ema.py) against a hand
computation, constant under constant weights, restored bitwise after a SIGKILL; merges
(retrieval_kit/merge.py) against the formula, alpha 0 and 1 giving the base's and the tuned model's
embeddings in the kit and in sentence-transformers, soups and spherical interpolation, every kind
merging, a mismatched pair one sentence; the weight chosen on dev, in the tool and at the end of a run."""

import json
import os
import shutil

import pytest
import torch

from retrieval_kit import merge
from retrieval_kit.ema import EMA
from tests.conftest import ROOT, python_run, read_jsonl, run_module, run_script


# ----- EMA -----------------------------------------------------------------------------------------

def test_the_ema_is_the_hand_computed_average_and_constant_under_constant_weights():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    model.bias.requires_grad_(False)  # only what is trained is averaged
    ema = EMA(model, 0.9)
    assert set(ema.shadow) == {"weight"}
    start = model.weight.detach().clone()
    for _ in range(5):  # constant weights: the average is them, exactly
        ema.update()
    assert torch.equal(ema.shadow["weight"], start)
    want = start.clone()
    for step in range(3):
        with torch.no_grad():
            model.weight.add_(0.1 * (step + 1))
        ema.update()
        want = 0.9 * want + 0.1 * model.weight.detach()
    assert torch.allclose(ema.shadow["weight"], want, atol=1e-6)
    last = model.weight.detach().clone()
    with ema.swapped():
        assert torch.allclose(model.weight, want, atol=1e-6)
    assert torch.equal(model.weight, last)  # swapped back
    state = ema.state_dict()
    other = EMA(model, 0.9)
    other.load_state_dict(state)
    assert torch.equal(other.shadow["weight"], ema.shadow["weight"])
    with pytest.raises(SystemExit, match="its EMA is not of this run's trained parameters"):
        other.load_state_dict({"bias": torch.zeros(3)})


def test_plan_counts_the_ema(tiny_model_dir):
    from retrieval_kit.models import load_encoder
    from retrieval_kit.plan import memory_plan

    model = load_encoder(tiny_model_dir)
    plain, with_ema = memory_plan(model), memory_plan(model, ema=True)
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert with_ema["ema"] == trained and with_ema["total"] - plain["total"] == trained


@pytest.mark.slow
def test_an_ema_run_killed_and_resumed_exports_the_uninterrupted_average(tiny_model_dir, small_train_file, tmp_path):
    """SIGKILL after the step-2 checkpoint, --resume auto: the exported average (--export-ema) is bitwise the
    uninterrupted run's, and it is not the last weights."""
    import signal

    from safetensors.torch import load_file

    from tests.test_ckpt import kill_after_checkpoint, launch

    common = ["--model", tiny_model_dir, "--train-file", small_train_file, "--val-file", "", "--batch-size", 4,
              "--max-steps", 4, "--ckpt-every", 1, "--lr", 1e-3, "--lr-schedule", "constant", "--ema-decay", 0.5,
              "--compute-dtype", "none", "--seed", 3]
    run_script("train_biencoder.py", [*common, "--export-ema", "--output-dir", tmp_path / "whole"])
    run_script("train_biencoder.py", [*common, "--output-dir", tmp_path / "last"])
    proc = launch("train_biencoder.py", [*common, "--export-ema", "--max-steps", 100000,
                                         "--output-dir", tmp_path / "killed"], 1)
    rc, _, _ = kill_after_checkpoint(proc, str(tmp_path / "killed" / "step_000002"), signal.SIGKILL)
    assert rc == -signal.SIGKILL
    run_script("train_biencoder.py", [*common, "--export-ema", "--resume", "auto", "--output-dir", tmp_path / "killed"])
    whole = load_file(str(tmp_path / "whole" / "final" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "killed" / "final" / "model.safetensors"))
    last = load_file(str(tmp_path / "last" / "final" / "model.safetensors"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert any(not torch.equal(whole[k], last[k]) for k in whole)
    assert json.load(open(tmp_path / "whole" / "final" / "retrieval_kit.json"))["selected"] == {"ema": 0.5}


# ----- merges --------------------------------------------------------------------------------------

def test_the_merges_are_the_formulas():
    gen = torch.Generator().manual_seed(0)
    a, b, c = ({"w": torch.randn(3, 4, generator=gen), "h": torch.randn(5, generator=gen)} for _ in range(3))
    mixed = merge.interpolate({"w": a["w"]}, b, 0.3)
    assert torch.allclose(mixed["w"], 0.7 * a["w"] + 0.3 * b["w"]) and torch.equal(mixed["h"], b["h"])  # no counterpart
    assert torch.equal(merge.interpolate(a, b, 0.0)["w"], a["w"]) and torch.equal(merge.interpolate(a, b, 1.0)["w"], b["w"])
    s = merge.soup([a, b, c], [2, 1, 1])
    assert torch.allclose(s["w"], (2 * a["w"] + b["w"] + c["w"]) / 4)
    half = merge.slerp(a, b, 0.5)["w"].flatten()
    u, v = a["w"].flatten(), b["w"].flatten()
    angle = torch.arccos(u @ v / (u.norm() * v.norm()))
    want = torch.sin(angle / 2) / torch.sin(angle) * (u / u.norm() + v / v.norm()) * (u.norm() + v.norm()) / 2
    assert torch.allclose(half, want, atol=1e-5)
    assert torch.allclose(merge.slerp(a, b, 0.0)["w"], a["w"], atol=1e-6)
    assert torch.allclose(merge.slerp(a, a, 0.5)["w"], a["w"], atol=1e-6)  # parallel: linear


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, tiny_model_dir, small_train_file):
    """Two short runs of each kind from the tiny BERT (seeds 1 and 2): {kind: [final, final]}."""
    out = {}
    root = tmp_path_factory.mktemp("tuned")
    kinds = {"single-vector": ("train_biencoder.py", []), "multi-vector": ("train_biencoder.py", ["--head",
             "multi-vector", "--multi-vector-dim", 8]), "sparse": ("train_biencoder.py", ["--head", "sparse"]),
             "classifier": ("train_reranker.py", ["--rerank-max-length", 64]),
             "lora": ("train_biencoder.py", ["--lora-rank", 4])}
    for kind, (script, extra) in kinds.items():
        out[kind] = []
        for seed in (1, 2):
            d = root / f"{kind}{seed}"
            run_script(script, ["--model", tiny_model_dir, "--train-file", small_train_file, "--val-file", "",
                                "--batch-size", 4, "--max-steps", 2, "--lr", 1e-2, "--seed", seed,
                                *(["--query-max-length", 8, "--passage-max-length", 32]
                                  if script == "train_biencoder.py" else []), "--output-dir", d, *extra])
            out[kind].append(str(d / "final"))
    return out


def kit_embeddings(path, texts):
    from retrieval_kit.encode import encode_texts
    from retrieval_kit.evaluate import load_biencoder

    model, tok, s, head = load_biencoder(path)
    sides = head.sides(tok, s)
    return encode_texts(model, tok, texts, s["passage_max_length"], s["passage_prefix"], side=sides["p"], head=head)


TEXTS = ["how do i list the files of a directory", "zstd is a fast compressor", "a python package manager"]


@pytest.mark.slow
def test_alpha_0_and_1_give_the_base_and_the_tuned_model_in_the_kit_and_sentence_transformers(tuned, tiny_model_dir,
                                                                                            tmp_path):
    from sentence_transformers import SentenceTransformer

    final = tuned["single-vector"][0]
    for alpha, want_dir in ((0.0, tiny_model_dir), (1.0, final)):
        out = str(tmp_path / f"a{alpha}")
        run_module(["-m", "retrieval_kit.merge", "--base", tiny_model_dir, "--tuned", final, "--alpha", alpha, "--out",
                    out])
        got = kit_embeddings(out, TEXTS)
        st = torch.as_tensor(SentenceTransformer(out, device="cpu").encode_document(TEXTS, convert_to_tensor=True))
        assert (got - st).abs().max() < 1e-5
        want = kit_embeddings(final, TEXTS) if alpha else kit_embeddings(tiny_model_dir, TEXTS)  # (the base: mean, 128)
        if alpha:
            assert (got - want).abs().max() < 1e-6
        else:  # the base's weights, the tuned model's settings (its lengths cut these short texts nowhere)
            assert (got - want).abs().max() < 1e-5
        saved = json.load(open(os.path.join(out, "retrieval_kit.json")))
        assert saved["merge"]["alpha"] == alpha and saved["head"] == "single-vector"
    mid = str(tmp_path / "mid")
    run_module(["-m", "retrieval_kit.merge", "--base", tiny_model_dir, "--tuned", final, "--alpha", 0.5, "--out", mid])
    from safetensors.torch import load_file

    b, t, m = (load_file(os.path.join(d, "model.safetensors")) for d in (tiny_model_dir, final, mid))
    key = "encoder.layer.0.attention.self.query.weight"
    assert torch.allclose(m[key], 0.5 * b[key] + 0.5 * t[key], atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["multi-vector", "sparse", "lora", "classifier"])
def test_every_kind_merges_into_an_export_its_consumer_reads(kind, tuned, tiny_model_dir, tmp_path):
    """A soup of two runs and the merge with the base: complete exports of the kind (MultiVectorEncoder,
    SparseEncoder, SentenceTransformer for a merged LoRA run, CrossEncoder), scoring as the kit does; what
    the base has no counterpart for kept from the tuned model."""
    from safetensors.torch import load_file

    a, b = tuned[kind]
    soup, based = str(tmp_path / "soup"), str(tmp_path / "based")
    run_module(["-m", "retrieval_kit.merge", "--models", f"{a},{b}", "--out", soup])
    run_module(["-m", "retrieval_kit.merge", "--base", tiny_model_dir, "--tuned", a, "--alpha", 0.5, "--out", based])
    wa, wb, ws = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b, soup))
    assert all(torch.allclose(ws[k], (wa[k] + wb[k]) / 2, atol=1e-6) for k in ws)
    kept = json.load(open(os.path.join(based, "retrieval_kit.json")))["merge"]["kept_from_tuned"]
    if kind == "classifier":
        from tests.conftest import stock_scores

        assert "classifier.weight" in kept
        from retrieval_kit.encode import rerank_groups
        from retrieval_kit.export import load_exported_reranker

        model, tok, s = load_exported_reranker(soup)
        kit = rerank_groups(model, tok, TEXTS, [TEXTS] * 3, s)
        hf, st = stock_scores(soup, TEXTS, [TEXTS] * 3)
        assert (kit - hf).abs().max() < 1e-5 and (kit - st).abs().max() < 1e-5
        return
    if kind == "multi-vector":
        assert "multi_vector.linear.weight" in kept
        from sentence_transformers import MultiVectorEncoder as Consumer
    elif kind == "sparse":
        assert any(k.startswith("cls.predictions.transform") for k in kept)
        from sentence_transformers import SparseEncoder as Consumer
    else:
        from sentence_transformers import SentenceTransformer as Consumer
    kit = kit_embeddings(soup, TEXTS)
    theirs = Consumer(soup, device="cpu").encode_document(TEXTS)
    if kind == "multi-vector":
        for row, t in zip(kit, theirs):
            mine = row[row[:, -1] == 1][:, :-1].float()
            assert (mine - torch.as_tensor(t).float()).abs().max() < 1e-2  # (the kit's corpus is kept in bf16)
    else:
        theirs = torch.as_tensor(theirs.to_dense() if hasattr(theirs, "to_dense") else theirs)
        assert (kit.to_dense() if kit.is_sparse else kit).sub(theirs).abs().max() < 1e-5


@pytest.mark.slow
def test_mismatched_models_are_one_sentence(tuned, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer, BertConfig, BertModel

    wide = tmp_path / "wide"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    BertModel(BertConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128)).save_pretrained(wide)
    tok.save_pretrained(wide)
    for argv, says in ((["--base", wide, "--tuned", tuned["single-vector"][0], "--alpha", 0.5],
                        "not of one architecture and size"),
                       (["--models", f"{tuned['multi-vector'][0]},{tuned['sparse'][0]}"], "models of one kind"),
                       (["--base", tuned["sparse"][0], "--tuned", tuned["multi-vector"][0], "--alpha", 0.5],
                        "the head it holds is sparse")):
        out = python_run(["-m", "retrieval_kit.merge", *argv, "--out", tmp_path / "x"])
        assert out.returncode != 0 and says in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
def test_the_alpha_is_chosen_on_dev_in_the_tool_and_at_the_end_of_a_run(tuned, tiny_model_dir, small_train_file,
                                                                      small_beir, tmp_path):
    out = tmp_path / "chosen"
    run_module(["-m", "retrieval_kit.merge", "--base", tiny_model_dir, "--tuned", tuned["single-vector"][0], "--alpha",
                "0,0.5,1", "--dev-beir", small_beir, "--report-beir", small_beir, "--tolerance", 0.5, "--out", out])
    record = json.load(open(out / "retrieval_kit.json"))["merge"]
    assert record["alpha"] == 0.0  # a tolerance of half the scale takes the smallest alpha
    assert [c["alpha"] for c in record["candidates"]] == [0.0, 0.5, 1.0]
    assert all(c["dev"] == c[small_beir] for c in record["candidates"])  # (the same set, reported apart)
    run = tmp_path / "run"
    run_script("train_biencoder.py", ["--model", tiny_model_dir, "--train-file", small_train_file, "--val-file", "",
                                      "--batch-size", 4, "--max-steps", 2, "--dev-queries", 8, "--dev-corpus-size", 60,
                                      "--eval-beir", small_beir, "--merge-alphas", "0.5,1", "--merge-tolerance", 0,
                                      "--output-dir", run])
    record = json.load(open(run / "final" / "retrieval_kit.json"))["merge"]
    best = max(c["dev"]["ndcg@10"] for c in record["candidates"])
    assert record["alpha"] == min(c["alpha"] for c in record["candidates"] if c["dev"]["ndcg@10"] >= best)
    assert all("beir" in c for c in record["candidates"])  # --eval-beir reported for every candidate


@pytest.mark.slow
def test_a_runs_checkpoints_and_their_ema_export_through_the_merge_tool(tuned, tiny_model_dir, small_train_file,
                                                                        tmp_path):
    """--models RUN/step_N exports that checkpoint's weights (a multi-vector or reranker run's last: bitwise its
    final/), RUN/step_N/ema.safetensors the average it keeps (bitwise the --export-ema run's final/), two
    checkpoints their mean; a checkpoint without its run's export, a LoRA one or a damaged one is one sentence."""
    from safetensors.torch import load_file

    for kind, n_files in (("multi-vector", 2), ("classifier", 1)):  # (backbone + fresh projection; a reranker)
        run = os.path.dirname(tuned[kind][0])
        run_module(["-m", "retrieval_kit.merge", "--models", os.path.join(run, "step_000002"), "--out",
                    tmp_path / kind])
        files = [os.path.relpath(os.path.join(d, f), os.path.join(run, "final")) for d, _, fs in
                 os.walk(os.path.join(run, "final")) for f in fs if f.endswith(".safetensors")]
        assert len(files) >= n_files
        for f in files:
            want, got = load_file(os.path.join(run, "final", f)), load_file(str(tmp_path / kind / f))
            assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want), (kind, f)

    common = ["--model", tiny_model_dir, "--train-file", small_train_file, "--val-file", "", "--batch-size", 4,
              "--max-steps", 2, "--ckpt-every", 1, "--lr", 1e-2, "--ema-decay", 0.5, "--seed", 5,
              "--query-max-length", 8, "--passage-max-length", 32]
    run_script("train_biencoder.py", [*common, "--output-dir", tmp_path / "run"])
    run_script("train_biencoder.py", [*common, "--export-ema", "--output-dir", tmp_path / "ema_run"])
    run_module(["-m", "retrieval_kit.merge", "--models", tmp_path / "run" / "step_000002" / "ema.safetensors",
                "--out", tmp_path / "ema"])
    want, got = load_file(str(tmp_path / "ema_run" / "final" / "model.safetensors")), load_file(str(tmp_path / "ema" / "model.safetensors"))
    assert all(torch.equal(want[k], got[k]) for k in want)
    run_module(["-m", "retrieval_kit.merge", "--models", f"{tmp_path / 'run' / 'step_000001'},"
                f"{tmp_path / 'run' / 'step_000002'}", "--out", tmp_path / "soup"])
    one, two = (load_file(str(tmp_path / "run" / f"step_00000{i}" / "model.safetensors")) for i in (1, 2))
    got = load_file(str(tmp_path / "soup" / "model.safetensors"))
    k = next(k for k in got if got[k].is_floating_point() and not torch.equal(one[k], two[k]))
    assert torch.allclose(got[k], (one[k] + two[k]) / 2, atol=1e-7)

    lora = os.path.dirname(tuned["lora"][0])
    (tmp_path / "orphan").mkdir()
    (tmp_path / "orphan" / "meta.json").write_text(json.dumps({"step": 1}))
    (tmp_path / "orphan" / "model.safetensors").write_bytes(b"")
    damaged = tmp_path / "damaged"  # a copy of the reranker run: weights cut short, then meta.json unreadable
    shutil.copytree(os.path.dirname(tuned["classifier"][0]), damaged)
    shutil.copytree(damaged / "step_000002", damaged / "step_000001")
    (damaged / "step_000001" / "model.safetensors").write_bytes(b"\x10\x00")
    (damaged / "step_000002" / "meta.json").write_text("{")
    for path, says in ((os.path.join(lora, "step_000002"), "a LoRA or sharded (DCP) checkpoint"),
                       (tmp_path / "orphan", "holds none"), (damaged / "step_000001", "a checkpoint that --resume would"),
                       (damaged / "step_000002", "not a complete checkpoint")):
        out = python_run(["-m", "retrieval_kit.merge", "--models", path, "--out", tmp_path / "x"])
        assert out.returncode != 0 and says in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]

"""Distillation (issue 17): the KL term against a hand computation, its zero gradient at the
teacher's own scores, GradCache and 2 ranks against one plain process, and the teacher-score
file (python -m retrieval_kit.score): its scores are the reranker's, killed and resumed or split
over 2 ranks it equals a file written in one go."""

import functools
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoTokenizer

from retrieval_kit import loop
from retrieval_kit.chunking import chunk_batch
from retrieval_kit.collate import collate_biencoder
from retrieval_kit.losses import contrastive_scores, distill_kl
from retrieval_kit.heads.single_vector import BiEncoder
from retrieval_kit.models import load_encoder
from tests.conftest import python_run, read_jsonl, ROOT, run_script
from tests.test_chunking import GROUPS, QUERIES


def kl_by_hand(student, teacher, t_s, t_t):
    """Mean over rows with a score of sum_j p_t log(p_t / p_s), NaN teacher entries dropped from both."""
    total, rows = 0.0, 0
    for s_row, t_row in zip(student, teacher):
        keep = [j for j, t in enumerate(t_row) if not math.isnan(t)]
        if not keep:
            continue
        zs = sum(math.exp(s_row[j] / t_s) for j in keep)
        zt = sum(math.exp(t_row[j] / t_t) for j in keep)
        for j in keep:
            pt, ps = math.exp(t_row[j] / t_t) / zt, math.exp(s_row[j] / t_s) / zs
            total += pt * math.log(pt / ps)
        rows += 1
    return total / rows


def test_kl_term_equals_a_hand_computation():
    student = [[0.9, 0.2, -0.3, 0.1], [0.5, 0.4, 0.0, -0.2], [0.3, 0.1, 0.2, 0.0]]
    nan = float("nan")
    teacher = [[4.0, 1.0, -2.0, 0.5], [nan, 2.0, 1.5, nan], [nan, nan, nan, nan]]  # row 3: no teacher score
    for t_s, t_t in ((0.05, 1.0), (0.1, 0.5), (1.0, 1.0)):
        got = distill_kl(torch.tensor(student), torch.tensor(teacher), t_s, t_t).item()
        assert got == pytest.approx(kl_by_hand(student, teacher, t_s, t_t), rel=1e-5)


def test_kl_term_is_zero_with_zero_gradient_at_the_students_own_scores(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    enc = load_encoder(tiny_model_dir).eval()
    q, p = collate_biencoder(tok, QUERIES, GROUPS, 32, 32)
    out = BiEncoder(enc)(q=q, p=p)
    own = contrastive_scores(out["q"], out["p"], 2, in_batch=False)
    kl = distill_kl(own, own.detach(), 0.05, 0.05)
    kl.backward(retain_graph=True)
    # Zero in exact arithmetic; in floats the gradient is softmax(s) - softmax(t) rounded, which some
    # kernels (AVX512 with AMX, AVX2) leave at a few ulps: compared with the gradient of another teacher.
    grads = [p.grad.abs().max().item() for p in enc.parameters() if p.grad is not None]
    enc.zero_grad()
    other = distill_kl(own, own.detach().flip(-1), 0.05, 0.05)  # another teacher: not 0
    other.backward()
    scale = max(p.grad.abs().max().item() for p in enc.parameters() if p.grad is not None)
    assert abs(kl.item()) <= 1e-6 * other.item() and other.item() > 0.01
    assert max(grads, default=0.0) <= 1e-5 * scale, (max(grads), scale)


def test_grad_cache_step_gives_the_plain_steps_loss_and_grads_with_the_kl_term(tiny_model_dir):
    from retrieval_kit.losses import biencoder_loss

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    enc = load_encoder(tiny_model_dir).train()  # dropout on: GradCache replays it
    model = BiEncoder(enc)
    q, p = collate_biencoder(tok, QUERIES, GROUPS, 32, 32)
    teacher = torch.linspace(-2, 3, 2 * len(QUERIES)).view(len(QUERIES), 2)
    teacher[-1, 1] = float("nan")  # a filled negative without a teacher score
    batch = {"q": chunk_batch(q, 24), "p": chunk_batch(p, 24), "teacher": teacher}
    params = list(enc.named_parameters())

    def run(step, weight):
        model.zero_grad()
        torch.manual_seed(3)
        loss_fn = functools.partial(biencoder_loss, n_passages=2, temperature=0.05, distill_weight=weight,
                                    teacher_temperature=0.5)
        loss, *_ = step(model, batch, loss_fn, 1, True)
        return loss.item(), {n: x.grad.clone() for n, x in params if x.grad is not None}

    plain, cached = run(loop.plain_step, 1.0), run(loop.grad_cache_step, 1.0)
    assert plain[0] == pytest.approx(cached[0], rel=1e-6)
    scale = max(g.abs().max().item() for g in plain[1].values())
    assert all((plain[1][k] - cached[1][k]).abs().max().item() <= 1e-5 * scale for k in plain[1])
    assert plain[0] > run(loop.plain_step, 0.0)[0] + 1e-3  # the KL term is really in the loss


def reranker_export(tiny_model_dir, out):
    from retrieval_kit.export import export_reranker
    from retrieval_kit.heads.classifier import load as load_reranker

    torch.manual_seed(0)
    net = load_reranker(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    export_reranker(str(out), net, tok, {"kind": "reranker", "pooling": "native", "bidirectional": False,
                                         "prompt_template": "pair", "rerank_max_length": 64, "append_eos": False,
                                         "padding_side": "right", "pad_to_multiple_of": 8})
    return str(out)


def run_score(args, nproc=1):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    launcher = [sys.executable, "-m"] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                            "--standalone", f"--nproc_per_node={nproc}", "-m"]
    return subprocess.Popen(launcher + ["retrieval_kit.score", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.fixture(scope="module")
def scored(tiny_model_dir, tmp_path_factory):
    """A reranker export, 30 training records, and their score file written in one go."""
    tmp = tmp_path_factory.mktemp("score")
    model = reranker_export(tiny_model_dir, tmp / "rr")
    inp = tmp / "train30.jsonl"
    with open(os.path.join(ROOT, "data", "train.jsonl")) as f:
        inp.write_text("".join(next(f) for _ in range(30)))
    out = tmp / "one_go.jsonl"
    proc = run_score(["--model", model, "--input", inp, "--out", out, "--block-size", 4, "--batch-size", 8])
    o, e = proc.communicate(timeout=300)
    assert proc.returncode == 0, e[-3000:]
    return model, inp, out, tmp


@pytest.mark.slow
def test_score_file_holds_the_rerankers_logits_in_flagembedding_fields(scored):
    from retrieval_kit.encode import rerank_groups
    from retrieval_kit.export import load_exported_reranker

    model, inp, out, _ = scored
    rows, src = read_jsonl(out), read_jsonl(inp)
    assert len(rows) == len(src) == 30
    net, tok, settings = load_exported_reranker(model)
    def texts(docs):  # the bundled file is NeMo's inline format: {"id", "text"} docs
        return [d["text"] if isinstance(d, dict) else d for d in docs]
    for row, rec in zip(rows[:3], src):
        assert row["query"] == rec["query"] and row["pos"] == texts(rec["pos_doc"])
        assert row["neg"] == texts(rec["neg_doc"])
        docs = row["pos"] + row["neg"]
        want = rerank_groups(net, tok, [row["query"]], [docs], settings)[0].tolist()
        assert row["pos_scores"] + row["neg_scores"] == pytest.approx(want, abs=1e-5)
    # the scripts read it back with the teacher scores
    from retrieval_kit.records import read_records
    records, _ = read_records(str(out))
    assert records.pos_scores is not None and "FlagEmbedding" in records.summary


@pytest.mark.slow
def test_score_file_killed_and_resumed_or_on_two_ranks_equals_one_written_in_one_go(scored):
    model, inp, one_go, tmp = scored
    args = ["--model", model, "--input", inp, "--block-size", 4, "--batch-size", 8]
    out = tmp / "resumed.jsonl"
    proc = run_score(args + ["--out", out])
    parts = tmp / "resumed.jsonl.parts"
    deadline = time.time() + 120
    while len(list(parts.glob("block_*.jsonl"))) < 3:  # killed after 3 of its 8 blocks
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists() and 3 <= len(list(parts.glob("block_*.jsonl"))) < 8
    # a restart that would score otherwise is refused, naming what differs: the batch, the model, the input
    def refused(extra, says):
        res = python_run(["-m", "retrieval_kit.score", *(extra or args), "--out", out])
        assert res.returncode == 1 and "Traceback" not in res.stderr and says in res.stderr, res.stderr[-2000:]
    refused(args[:-1] + ["16"], "batch_size: 8 then, 16 now")
    weights = os.path.join(model, "model.safetensors")
    st = os.stat(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))  # re-exported in place
    refused(None, "model_digest")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    text = inp.read_text()
    inp.write_text("".join(reversed(text.splitlines(keepends=True))))  # edited in place, same size
    refused(None, "input_digest")
    inp.write_text(text)
    damaged = sorted(parts.glob("block_*.jsonl"))[0]
    damaged.write_text("")  # emptied by hand: redone
    again = run_score(args + ["--out", out])
    o, e = again.communicate(timeout=300)
    assert again.returncode == 0 and "do not match their checksums" in o + e, e[-3000:]
    assert out.read_bytes() == one_go.read_bytes() and not parts.exists()
    # a file-size limit while the blocks are joined: one sentence, the blocks kept; then the same command ends it
    from tests.errors.test_runs import small_disk

    limited = tmp / "limited.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-m", "retrieval_kit.score", *map(str, args + ["--out", limited])], cwd=ROOT,
                         env=env, preexec_fn=small_disk(one_go.stat().st_size // 2), capture_output=True, text=True)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert f"cannot write {limited}" in res.stderr and "File too large" in res.stderr and "kept in" in res.stderr
    again = run_score(args + ["--out", limited])
    assert again.wait(timeout=300) == 0 and limited.read_bytes() == one_go.read_bytes()
    two = tmp / "two_ranks.jsonl"
    proc = run_score(args + ["--out", two], nproc=2)
    o, e = proc.communicate(timeout=300)
    assert proc.returncode == 0, e[-3000:]
    assert two.read_bytes() == one_go.read_bytes()


@pytest.mark.slow
def test_distilled_run_on_two_ranks_logs_the_losses_of_one_process(scored, no_dropout_dir, tmp_path):
    """train_biencoder.py --distill-weight, with Matryoshka sizes and duplicate masking (the
    default) too: 2 ranks x 4 queries (gathered negatives) log the losses of one process with 8
    (dropout off: the ranks draw their own masks), and the export lists the sizes."""
    from retrieval_kit.st_format import load_settings

    _, _, scores, _ = scored
    common = ["--model", no_dropout_dir, "--train-file", scores, "--val-file", "", "--max-steps", 2,
              "--warmup-steps", 1, "--n-passages", 3, "--passage-max-length", 48, "--chunk-tokens", 96,
              "--teacher-temperature", 0.5, "--matryoshka-dims", "32,16,8", "--matryoshka-weights", "1,1,0.5",
              "--compute-dtype", "none"]  # fp32: 1 x 8 and 2 x 4 agree to fp32 rounding (auto is bf16 on some CPUs)
    runs = {}
    for name, nproc, batch, weight in (("one", 1, 8, 1.0), ("two", 2, 4, 1.0)):
        run_script("train_biencoder.py", common + ["--batch-size", batch, "--distill-weight", weight,
                                                   "--output-dir", tmp_path / name], nproc)
        runs[name] = [r["loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl") if r["split"] == "train"]
    assert runs["one"] == pytest.approx(runs["two"], abs=1e-5)  # (the term's effect: the GradCache test above)
    assert load_settings(str(tmp_path / "one" / "final"))["matryoshka_dims"] == [32, 16, 8]


@pytest.mark.slow
def test_distill_weight_without_teacher_scores_is_one_sentence(tiny_model_dir, small_train_file, tmp_path):
    out = python_run([os.path.join(ROOT, "train_biencoder.py"), "--model", tiny_model_dir, "--train-file",
                      small_train_file, "--distill-weight", "1", "--output-dir", tmp_path], timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "has no teacher scores" in out.stderr and "retrieval_kit.score" in out.stderr


@pytest.mark.slow
def test_a_biencoder_export_scores_by_the_inner_product_of_its_embeddings(scored, tiny_model_dir):
    from retrieval_kit.encode import encode_texts
    from retrieval_kit.export import export_model

    _, inp, _, tmp = scored
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    enc = load_encoder(tiny_model_dir)
    settings = {"pooling": "avg", "normalize": True, "query_prefix": "", "passage_prefix": "",
                "query_max_length": 32, "passage_max_length": 48}
    model = export_model(str(tmp / "bi"), enc, tok, {"kind": "biencoder", **settings, "temperature": 0.05})
    out = tmp / "bi_scores.jsonl"
    proc = run_score(["--model", model, "--input", inp, "--out", out, "--block-size", 16, "--batch-size", 8])
    o, e = proc.communicate(timeout=300)
    assert proc.returncode == 0, e[-3000:]
    for row in read_jsonl(out)[:4]:
        docs = row["pos"] + row["neg"]
        q = encode_texts(BiEncoder(enc), tok, [row["query"]], 32)
        p = encode_texts(BiEncoder(enc), tok, docs, 48)
        assert row["pos_scores"] + row["neg_scores"] == pytest.approx((q @ p.T)[0].tolist(), abs=1e-5)


@pytest.mark.slow
def test_reranker_loss_adds_the_listwise_kl_of_its_logits(scored, tiny_model_dir, tmp_path):
    """train_reranker.py's loss_fn (losses.reranker_loss) with teacher scores: the listwise loss + weight x the KL of the
    logits (temperature 1) against the teacher; and a short run on the score file trains with it."""
    from retrieval_kit.losses import listwise_loss
    from retrieval_kit.losses import reranker_loss

    logits = torch.tensor([2.0, 0.5, -1.0, 0.3, 0.1, 0.9])  # 2 queries x 3 pairs
    teacher = torch.tensor([[5.0, 1.0, 0.0], [1.0, float("nan"), 2.0]])
    loss, _ = reranker_loss({"pairs": logits}, n_passages=3, loss=listwise_loss, distill_weight=0.5,
                            teacher_temperature=2.0, teacher=teacher)
    by_hand = listwise_loss(logits, 3).item() + 0.5 * kl_by_hand(logits.view(2, 3).tolist(), teacher.tolist(), 1.0, 2.0)
    assert loss.item() == pytest.approx(by_hand, rel=1e-6)
    _, _, scores, _ = scored
    run_script("train_reranker.py", ["--model", tiny_model_dir, "--train-file", scores, "--val-file", "",
                                     "--max-steps", 2, "--warmup-steps", 1, "--batch-size", 4, "--n-passages", 3,
                                     "--rerank-max-length", 64, "--distill-weight", 1, "--output-dir", tmp_path / "rr"])
    rows = [r for r in read_jsonl(tmp_path / "rr" / "metrics.jsonl") if r["split"] == "train"]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)

"""Exact resume after SIGKILL / SIGTERM, across world sizes, and checkpoints that must not be trusted."""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from retrieval_kit import ckpt
from tests.conftest import process_tree, python_run, read_jsonl, ROOT, run_script, save_published_splade

pytestmark = pytest.mark.slow  # every test here runs a script, a kill or a 2-rank launch


def launch(script, args, nproc=1, env=None):
    """Start a run in a session of its own, as a scheduler would (`env`: extra variables)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT, **(env or {}))
    cmd = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                               f"--nproc_per_node={nproc}"]
    return subprocess.Popen(cmd + [os.path.join(ROOT, script)] + [str(a) for a in args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def kill_after_checkpoint(proc, ckpt_dir, sig, timeout=300):
    """Kill the run once `ckpt_dir` (or, if it was already pruned, any later checkpoint) is complete."""
    deadline = time.time() + timeout
    latest = os.path.join(os.path.dirname(ckpt_dir), "latest")
    while not (os.path.isfile(os.path.join(ckpt_dir, "meta.json")) or os.path.isfile(latest)):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    for pid in process_tree(proc.pid):  # like a node going away: every process gets the signal
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def weights(run_dir):
    """The export's weights (an inference-free sparse export: its document model's and its query weights)."""
    final = os.path.join(run_dir, "final")
    if os.path.isfile(os.path.join(final, "router_config.json")):
        return {**load_file(os.path.join(final, "document_0_Transformer", "model.safetensors")),
                "query": load_file(os.path.join(final, "query_0_SparseStaticEmbedding", "model.safetensors"))["weight"]}
    return load_file(os.path.join(final, "model.safetensors"))


def losses(run_dir):
    """step -> every loss logged for it (a resumed run logs the steps after its checkpoint again)."""
    out = {}
    for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")):
        if r["split"] == "train":
            out.setdefault(r["step"], []).append(r["loss"])
    return out


def assert_same_run(ref_dir, run_dir, exact=True, tol=0.0):
    ref, got = weights(ref_dir), weights(run_dir)
    assert ref.keys() == got.keys()
    for k in ref:
        if exact:
            assert torch.equal(ref[k], got[k]), k
        else:
            assert torch.allclose(ref[k], got[k], atol=tol, rtol=0), (k, (ref[k] - got[k]).abs().max())
    ref_l, got_l = losses(ref_dir), losses(run_dir)
    assert set(got_l) <= set(ref_l) and max(got_l) == max(ref_l)
    for step, values in got_l.items():
        for v in values:
            assert (v == ref_l[step][0]) if exact else abs(v - ref_l[step][0]) <= 1e-5, (step, v, ref_l[step])


STEPS = 8


def bi_args(model_dir, train_file, out, *extra):
    return ["--model", model_dir, "--train-file", train_file, "--val-file", "", "--batch-size", 4,
            "--passage-max-length", 32, "--lr-schedule", "constant", "--warmup-steps", 2, "--lr", 1e-3,
            "--ckpt-every", 2, "--output-dir", out, *extra]


def rr_args(model_dir, train_file, out, *extra):
    return ["--model", model_dir, "--train-file", train_file, "--val-file", "", "--batch-size", 4,
            "--n-passages", 2, "--rerank-max-length", 48, "--lr-schedule", "constant", "--warmup-steps", 2,
            "--ckpt-every", 2, "--output-dir", out, *extra]


@pytest.fixture(scope="module")
def bi_ref(tiny_model_dir, small_train_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("bi_ref")
    run_script("train_biencoder.py", bi_args(tiny_model_dir, small_train_file, out, "--max-steps", STEPS, "--keep-last", 0))
    return str(out)


def wait_for_checkpoint(proc, ckpt_dir, timeout=300):
    deadline = time.time() + timeout
    while not os.path.isfile(os.path.join(ckpt_dir, "meta.json")):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.02)


def assert_second_writer_refused(proc, script, args):
    """A second run on the folder of the live run `proc` (--resume auto, as a user retrying would): one
    sentence. `proc` is stopped meanwhile (SIGSTOP: it holds its lock, and takes no step)."""
    for pid in process_tree(proc.pid):
        os.kill(pid, signal.SIGSTOP)
    out = python_run([os.path.join(ROOT, script), *args, "--resume", "auto"])
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "another run is writing there" in out.stderr, out.stderr[-2000:]


def test_sigkill_then_resume_is_bitwise_identical(bi_ref, tiny_model_dir, small_train_file, tmp_path):
    args = bi_args(tiny_model_dir, small_train_file, tmp_path)
    proc = launch("train_biencoder.py", args + ["--max-steps", 100000])  # constant LR: same path as STEPS
    wait_for_checkpoint(proc, tmp_path / "step_000002")
    assert_second_writer_refused(proc, "train_biencoder.py", args + ["--max-steps", STEPS])  # the run is still going
    rc, _, _ = kill_after_checkpoint(proc, tmp_path / "step_000002", signal.SIGKILL)
    assert rc == -signal.SIGKILL
    run_script("train_biencoder.py", args + ["--max-steps", STEPS, "--resume", "auto", "--keep-last", 2])
    assert_same_run(bi_ref, tmp_path)
    kept = sorted(d for d in os.listdir(tmp_path) if d.startswith("step_"))
    assert kept[-2:] == ["step_000006", "step_000008"] and len(kept) == 2  # --keep-last 2


@pytest.mark.parametrize("head", ["multi-vector", "sparse", "csr", "signals"])
def test_multi_vector_and_sparse_sigkill_then_resume_is_bitwise_identical(tiny_model_dir, small_train_file, tmp_path,
                                                                          head):
    """--head multi-vector (the token projection rides in the checkpoints) and --head sparse (SPLADE-tiny from
    a published-layout dir, inference-free: the MLM head, the query weights, the FLOPS weights' warm-up read
    from the loop state), with GradCache's cached gradients replayed:
    killed after step 2, resumed, the same weights and losses as a run in one go. "signals": the training
    signals of issue 64 together (every loss direction, the Qwen3 rule, a frozen guide: the base itself; a
    one-layer student of the base distilled from it through a fresh Dense, --dense-dim)."""
    extra = {"multi-vector": ("--head", head, "--multi-vector-dim", 8),
             "sparse": ("--head", head, "--flops-warmup-steps", 3, "--query-encoder", "static"),
             "csr": ("--head", head, "--csr-dim", 64, "--csr-k", 4),
             "signals": ("--loss-directions", "q2p,p2q,q2q,p2p", "--false-negative-margin", 0.0, "--guide-model",
                         tiny_model_dir, "--guide-margin-strategy", "relative", "--guide-margin", 0.01,
                         "--teacher-model", tiny_model_dir, "--distill-embeddings", "cosine", "--init-layers", 1,
                         "--dense-dim", 32)}[head]
    extra += ("--grad-cache", "--chunk-tokens", 64)
    # sparse: a real SPLADE (SPLADE-tiny) in the layout published ones have (MLMTransformer, log1p_relu)
    model = save_published_splade(tmp_path / "splade", "log1p_relu") if head == "sparse" else tiny_model_dir
    ref = tmp_path / "ref"
    run_script("train_biencoder.py", bi_args(model, small_train_file, ref, *extra, "--max-steps", 4))
    args = bi_args(model, small_train_file, tmp_path / "run", *extra)
    proc = launch("train_biencoder.py", args + ["--max-steps", 100000])
    rc, _, _ = kill_after_checkpoint(proc, tmp_path / "run" / "step_000002", signal.SIGKILL)
    assert rc == -signal.SIGKILL
    run_script("train_biencoder.py", args + ["--max-steps", 4, "--resume", "auto"])
    assert_same_run(ref, tmp_path / "run")
    if head == "multi-vector":  # the projection, exported apart
        dense = [load_file(os.path.join(d, "final", "1_Dense", "model.safetensors")) for d in (ref, tmp_path / "run")]
        assert torch.equal(dense[0]["linear.weight"], dense[1]["linear.weight"])
    elif head == "sparse":
        assert any(k.startswith("cls.") for k in weights(ref)) and "query" in weights(ref)  # its head, its queries
    elif head == "csr":  # the auto-encoder, exported apart, its dead-latent counters with it
        sae = [load_file(os.path.join(d, "final", "2_SparseAutoEncoder", "model.safetensors")) for d in (ref, tmp_path / "run")]
        assert sae[0].keys() == sae[1].keys() and all(torch.equal(sae[0][k], sae[1][k]) for k in sae[0])
        assert int(sae[0]["stats_last_nonzero"].max()) > 1  # (the counters moved, and were resumed)
    else:  # the rules left candidates out, and said so each step
        masked = [r["false_negatives_masked"] for r in read_jsonl(ref / "metrics.jsonl") if r["split"] == "train"]
        assert len(masked) == 4 and all(m > 0 for m in masked), masked
        config = json.load(open(ref / "final" / "config.json"))  # --init-layers 1: a student of one layer
        assert config["num_hidden_layers"] == 1 and not any(".layer.1." in k for k in weights(ref))


def test_sigterm_saves_a_checkpoint_that_resumes_exactly_reranker(tiny_model_dir, small_train_file, tmp_path):
    ref = tmp_path / "ref"
    run_script("train_reranker.py", rr_args(tiny_model_dir, small_train_file, ref, "--max-steps", STEPS))
    run = tmp_path / "run"
    args = rr_args(tiny_model_dir, small_train_file, run)
    # batches built in 2 DataLoader workers, which leave the signal to the training process
    proc = launch("train_reranker.py", args + ["--max-steps", 100000, "--num-workers", 2])
    rc, out, err = kill_after_checkpoint(proc, run / "step_000002", signal.SIGTERM)
    assert rc == 0, err[-3000:]
    assert "stopped by SIGTERM" in out
    stopped_at = int(open(run / "latest").read().split("_")[1])
    assert stopped_at >= 2 and os.path.isfile(run / f"step_{stopped_at:06d}" / "meta.json")
    run_script("train_reranker.py", args + ["--max-steps", STEPS, "--resume", "auto"])
    assert_same_run(ref, run)


def big_beir(folder, n_docs):
    """A BEIR set of `n_docs` generated 40-word passages and 50 queries: a validation that takes seconds."""
    import random

    rng = random.Random(0)
    words = "package install apt debian kernel module file system network socket shell user group disk".split()
    os.makedirs(os.path.join(folder, "qrels"))
    text = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    with open(os.path.join(folder, "corpus.jsonl"), "w") as f:
        f.writelines(json.dumps({"_id": f"d{i}", "title": "", "text": text(40)}) + "\n" for i in range(n_docs))
    with open(os.path.join(folder, "queries.jsonl"), "w") as f:
        f.writelines(json.dumps({"_id": f"q{i}", "text": text(6)}) + "\n" for i in range(50))
    with open(os.path.join(folder, "qrels", "test.tsv"), "w") as f:
        f.write("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(50)))
    return str(folder)


def wait_for_step(proc, metrics, step, timeout=300):
    """Until the run has logged training step `step` (metrics.jsonl)."""
    deadline = time.time() + timeout
    while not (os.path.isfile(metrics) and any(r["split"] == "train" and r["step"] == step for r in read_jsonl(metrics))):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"step {step} was never logged"
        time.sleep(0.05)


STOP_BOUND_S = 10  # a SIGTERM is honoured within this (schedulers give ~30 s before SIGKILL)


@pytest.mark.parametrize("nproc,n_docs", [(2, 6000)])  # (one process takes the same path without collectives)
def test_sigterm_during_a_long_validation_saves_the_step_and_resumes_bitwise(tiny_model_dir, small_train_file, tmp_path,
                                                                             nproc, n_docs):
    """Issue 61: SIGTERM one second into the step-2 validation (--eval-beir over n_docs passages: ~3 s on 2 ranks
    here; 24,000 take ~12 s on one, longer than the bound) leaves it at the next batch on every rank, saves step 2 and exits
    within STOP_BOUND_S; --resume auto validates step 2 again and finishes as the uninterrupted run: the
    same weights and losses (an uninterrupted run without the evaluation: it moves no weight), each evaluation
    logged once."""
    beir = big_beir(tmp_path / "beir", n_docs)
    extra = ["--max-steps", 2, "--val-every", 2, "--val-batch-size", 4, "--log-every", 1]
    ref = tmp_path / "ref"
    run_script("train_biencoder.py", bi_args(tiny_model_dir, small_train_file, ref, *extra), nproc=nproc)
    extra += ["--eval-beir", beir]
    run = tmp_path / "run"
    args = bi_args(tiny_model_dir, small_train_file, run, *extra)
    proc = launch("train_biencoder.py", args, nproc=nproc)
    wait_for_step(proc, run / "metrics.jsonl", 2)
    time.sleep(1.0)  # into the validation
    sent = time.time()
    for pid in process_tree(proc.pid):  # as a scheduler does: every process of the job
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    out, err = proc.communicate(timeout=300)
    took = time.time() - sent
    assert took < STOP_BOUND_S, (took, err[-3000:])
    assert "a stop signal during validation at step 2" in out and "stopped by SIGTERM after step 2" in out, out[-2000:]
    assert nproc > 1 or proc.returncode == 0, err[-3000:]  # (torchrun's own agent exits 1 on a SIGTERM of its own)
    assert os.path.isfile(run / "step_000002" / "meta.json") and not os.path.exists(run / "final")
    assert not [r for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "beir" and r["step"] == 2]  # left undone
    run_script("train_biencoder.py", args + ["--resume", "auto"], nproc=nproc)
    assert_same_run(ref, run)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "beir"] == [0, 2]


# DDP killed with SIGKILL on 2 ranks, then resumed bitwise, is test_nodes's run (one agent per node)
@pytest.mark.parametrize("parallel,sig,lora", [("fsdp2", signal.SIGTERM, 0), ("fsdp2", signal.SIGKILL, 4)])
def test_two_rank_kill_then_resume_is_bitwise_identical(tiny_model_dir, small_train_file, tmp_path, parallel, sig, lora):
    ref = tmp_path / "ref"
    extra = ["--parallel", parallel, "--lora-rank", lora]  # LoRA: the base built on the meta device, adapters restored
    run_script("train_biencoder.py", bi_args(tiny_model_dir, small_train_file, ref, "--max-steps", STEPS, *extra), nproc=2)
    run = tmp_path / "run"
    args = bi_args(tiny_model_dir, small_train_file, run, *extra)
    proc = launch("train_biencoder.py", args + ["--max-steps", 100000], nproc=2)
    if lora:  # rank 0 of the 2-rank run holds the folder
        wait_for_checkpoint(proc, run / "step_000002")
        assert_second_writer_refused(proc, "train_biencoder.py", args + ["--max-steps", STEPS])
    kill_after_checkpoint(proc, run / "step_000002", sig)
    run_script("train_biencoder.py", args + ["--max-steps", STEPS, "--resume", "auto"], nproc=2)
    assert_same_run(ref, run)


def test_checkpoints_resume_across_world_sizes(no_dropout_dir, small_train_file, tmp_path):
    # the same global batch of 8 queries: 1 rank x 8, or 2 ranks x 4 (negatives gathered)
    def one(out, *extra):  # lr 1e-5: Adam's sign-like first steps would magnify rounding in near-zero grads;
        # fp32 (not auto's bf16 on a CPU with AVX512-BF16): 1 x 8 and 2 x 4 agree to fp32 rounding, not bf16's
        return bi_args(no_dropout_dir, small_train_file, out, "--max-steps", 6, "--lr", 1e-5, "--compute-dtype", "none",
                       *extra)

    run_script("train_biencoder.py", one(tmp_path / "w1") + ["--batch-size", 8])
    run_script("train_biencoder.py", one(tmp_path / "w2"), nproc=2)
    run_script("train_biencoder.py", one(tmp_path / "w2_to_w1", "--resume", tmp_path / "w2" / "step_000002")
               + ["--batch-size", 8])
    run_script("train_biencoder.py", one(tmp_path / "w1_to_w2", "--resume", tmp_path / "w1" / "step_000002"), nproc=2)
    for a, b in (("w1", "w2_to_w1"), ("w2", "w1_to_w2"), ("w1", "w2")):
        ref_l, got_l = losses(tmp_path / a), losses(tmp_path / b)
        for step in range(3, 7):
            assert abs(ref_l[step][-1] - got_l[step][-1]) < 1e-5, (a, b, step)
        wa, wb = weights(tmp_path / a), weights(tmp_path / b)
        assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


def test_half_written_checkpoint_is_skipped(bi_ref, tiny_model_dir, small_train_file, tmp_path):
    for step in ("step_000002", "step_000004"):
        shutil.copytree(os.path.join(bi_ref, step), tmp_path / step)
    os.remove(tmp_path / "step_000004" / "meta.json")  # crashed before it was complete
    shutil.copytree(os.path.join(bi_ref, "step_000006"), tmp_path / ".tmp_step_000006")  # crashed mid-save
    out = run_script("train_biencoder.py", bi_args(tiny_model_dir, small_train_file, tmp_path, "--max-steps", STEPS,
                                                   "--resume", "auto"))
    assert f"warning: skipping checkpoint {tmp_path / 'step_000004'}: " in out.stdout
    assert "meta.json: missing (the checkpoint was not finished)" in out.stdout
    assert "resumed from" in out.stdout and "step_000002 at step 2" in out.stdout
    assert_same_run(bi_ref, tmp_path)


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_tampered_pickle_is_refused_not_executed(bi_ref, tiny_model_dir, small_train_file, tmp_path):
    ckpt_dir = tmp_path / "step_000002"
    shutil.copytree(os.path.join(bi_ref, "step_000002"), ckpt_dir)
    marker = tmp_path / "pwned"
    with open(ckpt_dir / "optimizer.pt", "wb") as f:
        pickle.dump(Payload(marker), f)
    env = dict(os.environ, PYTHONPATH=ROOT)

    def resume():
        return python_run([os.path.join(ROOT, "train_biencoder.py")] + bi_args(
            tiny_model_dir, small_train_file, tmp_path / "r", "--max-steps", 4, "--resume", ckpt_dir), env=env)
    out = resume()  # first wall: the file no longer matches the checksum meta.json recorded
    assert out.returncode != 0 and f"{ckpt_dir / 'optimizer.pt'}: damaged" in out.stderr
    meta = json.loads((ckpt_dir / "meta.json").read_text())  # an attacker who rewrites the sums too
    meta["files"]["optimizer.pt"] = ckpt.file_sums(str(ckpt_dir))["optimizer.pt"]
    (ckpt_dir / "meta.json").write_text(json.dumps(meta))
    out = resume()  # second wall: weights_only unpickling
    assert out.returncode != 0
    assert f"{ckpt_dir / 'optimizer.pt'}: refusing to load" in out.stderr
    assert not marker.exists()


def test_non_finite_steps_are_skipped_and_never_saved(tiny_model_dir, small_train_file, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = python_run([os.path.join(ROOT, "train_biencoder.py")] + bi_args(
        tiny_model_dir, small_train_file, tmp_path, "--max-steps", 20, "--lr", 1e10, "--ckpt-every", 1,
        "--keep-last", 0, "--max-bad-steps", 3), env=env)
    assert out.returncode != 0 and "3 steps in a row with a non-finite loss" in out.stderr
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "train"]
    assert rows[-1]["skipped_steps"] == 2 and rows[-1]["loss"] is None  # NaN logged (as null: valid JSON), skipped
    saved = sorted(d for d in os.listdir(tmp_path) if d.startswith("step_"))
    assert saved
    for d in saved:
        assert all(torch.isfinite(t).all() for t in load_file(str(tmp_path / d / "model.safetensors")).values())

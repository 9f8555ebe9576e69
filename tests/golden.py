"""Golden runs: both training scripts on a tiny random BERT, fixed seed, under every mode that
changes how a step is computed. Each run's per-step train scalars, validation metrics and a hash of
the exported weights are kept in tests/data/golden.json; tests/test_golden.py reruns them and
compares bitwise, so a refactor of the step cannot change a number without a test saying so.

    python -m tests.golden --record            # rewrite tests/data/golden.json (say why in the commit)
    python -m tests.golden --check             # rerun and compare, without pytest
    python -m tests.golden --check --extra --num-workers 2

Bitwise equality holds for the same torch build on the same CPU kernels (torch's CPU capability,
e.g. AVX512); on another one the floats may differ in their last bits, so the comparison there
falls back to a tolerance and says so.
"""

import argparse
import hashlib
import json
import os
import signal
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN_FILE = os.path.join(ROOT, "tests", "data", "golden.json")
TRAIN_KEYS = ("loss", "grad_norm", "acc", "lr", "loss_avg_window", "skipped_steps")
VAL_KEYS = ("loss", "acc@1", "mrr")

COMMON = ["--val-file", os.path.join(ROOT, "data", "val.jsonl"), "--val-max-groups", 8, "--val-every", 2,
          "--batch-size", 4, "--max-steps", 4, "--warmup-steps", 1, "--ckpt-every", 2, "--chunk-tokens", 96,
          "--seed", 7]
SCRIPT_ARGS = {
    "biencoder": ("train_biencoder.py", ["--n-passages", 2, "--passage-max-length", 48, "--lr", 1e-3]),
    "reranker": ("train_reranker.py", ["--n-passages", 2, "--rerank-max-length", 64, "--lr", 1e-3]),
}
MODES = {  # name -> (processes, extra flags); "sigkill_resume" is killed after its first checkpoint
    "plain": (1, []),
    "grad_cache": (1, ["--grad-cache"]),
    "accum2": (1, ["--grad-accum-steps", 2]),
    "ddp2": (2, []),  # the bi-encoder gathers negatives across ranks by default when world > 1
    # FSDP2 unchunked: with length chunks the ranks can run different numbers of forwards, and the
    # reranker run then dies in a mismatched all-gather (found while recording these runs)
    "fsdp2": (2, ["--parallel", "fsdp2", "--chunk-tokens", 0]),
    "sigkill_resume": (1, ["--lr-schedule", "constant"]),
    # added after the fix that gives every rank as many chunks (recorded then, not before the refactor)
    "fsdp2_chunked": (2, ["--parallel", "fsdp2"]),
}
CONFIGS = [f"{kind}/{mode}" for kind in SCRIPT_ARGS for mode in MODES]


def fingerprint():
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def weights_hash(path):
    from safetensors.torch import load_file

    tensors = load_file(path)
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].contiguous()
        h.update(f"{k}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def summarize(run_dir):
    """The numbers a golden run keeps: for each step the last logged row (a resumed run logs the steps
    after its checkpoint again), and the exported weights' hash."""
    from tests.conftest import read_jsonl

    train, val = {}, {}
    for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")):
        if r["split"] == "train":
            train[str(r["step"])] = {k: r[k] for k in TRAIN_KEYS}
        elif r["split"] == "val":
            val[str(r["step"])] = {k: r[k] for k in VAL_KEYS}
    return {"train": train, "val": val, "weights": weights_hash(os.path.join(run_dir, "final", "model.safetensors"))}


def run_config(name, model_dir, train_file, out_dir, extra=()):
    """Run one golden config into out_dir (fresh) and return its summary."""
    from tests.conftest import run_script
    from tests.test_ckpt import kill_after_checkpoint, launch

    kind, mode = name.split("/")
    script, kind_args = SCRIPT_ARGS[kind]
    nproc, mode_args = MODES[mode]
    args = ["--model", model_dir, "--train-file", train_file, "--output-dir", out_dir, *COMMON, *kind_args,
            *mode_args, *extra]
    if mode == "sigkill_resume":
        proc = launch(script, args + ["--max-steps", 100000], nproc)  # constant LR: the same path as --max-steps 4
        rc, _, _ = kill_after_checkpoint(proc, os.path.join(out_dir, "step_000002"), signal.SIGKILL)
        assert rc == -signal.SIGKILL, rc
        args += ["--resume", "auto"]
    run_script(script, args, nproc)
    return summarize(out_dir)


def compare(want, got, bitwise=True):
    """Problems between a recorded and a fresh summary ([] when they match)."""
    problems = []
    for split in ("train", "val"):
        if want[split].keys() != got[split].keys():
            problems.append(f"{split}: steps {sorted(want[split])} recorded, {sorted(got[split])} now")
            continue
        for step, row in want[split].items():
            for k, v in row.items():
                g = got[split][step][k]
                same = v == g if bitwise else abs(v - g) <= 1e-4 * max(1.0, abs(v))
                if not same:
                    problems.append(f"{split} step {step} {k}: recorded {v!r}, now {g!r}")
    if bitwise and want["weights"] != got["weights"]:
        problems.append(f"final weights hash: recorded {want['weights'][:16]}, now {got['weights'][:16]}")
    return problems


def make_inputs(tmp):
    """The tiny model and training file the golden runs use (as tests/conftest.py builds them)."""
    from transformers import AutoTokenizer, BertModel

    from tests.conftest import minilm_dir, tiny_bert_config

    tok = AutoTokenizer.from_pretrained(minilm_dir())
    model_dir = os.path.join(tmp, "tiny_bert")
    torch.manual_seed(0)
    BertModel(tiny_bert_config(len(tok))).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    train_file = os.path.join(tmp, "train64.jsonl")
    with open(os.path.join(ROOT, "data", "train.jsonl")) as f, open(train_file, "w") as out:
        out.writelines(next(f) for _ in range(64))
    return model_dir, train_file


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true", help=f"rewrite {os.path.relpath(GOLDEN_FILE, ROOT)}")
    ap.add_argument("--check", action="store_true", help="rerun every config and compare")
    ap.add_argument("--configs", nargs="*", default=CONFIGS)
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="flags added to every run (with --check)")
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, train_file = make_inputs(tmp)
        got = {name: run_config(name, model_dir, train_file, os.path.join(tmp, name.replace("/", "_")), a.extra)
               for name in a.configs}
    if a.record:
        os.makedirs(os.path.dirname(GOLDEN_FILE), exist_ok=True)
        with open(GOLDEN_FILE, "w") as f:
            json.dump({"fingerprint": fingerprint(), "runs": got}, f, indent=1)
        print(f"wrote {GOLDEN_FILE}: {len(got)} runs")
    if a.check:
        with open(GOLDEN_FILE) as f:
            want = json.load(f)
        bitwise = want["fingerprint"] == fingerprint()
        bad = {n: compare(want["runs"][n], got[n], bitwise) for n in got}
        for n, p in bad.items():
            print(f"{n}: {'ok' if not p else 'DIFFERS'}" + "".join(f"\n  {x}" for x in p[:10]))
        sys.exit(1 if any(bad.values()) else 0)


if __name__ == "__main__":
    main()

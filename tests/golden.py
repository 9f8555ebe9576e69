"""Golden runs: both training scripts on a tiny random BERT, fixed seed, under every mode that
changes how a step is computed. Each run's per-step train scalars, validation metrics and a hash of
the exported weights are kept in tests/data/golden.json; tests/test_golden.py reruns them and
compares bitwise, so a refactor of the step cannot change a number without a test saying so.

    python -m tests.golden --record            # rewrite tests/data/golden.json (say why in the commit)
    python -m tests.golden --check             # rerun and compare, without pytest
    python -m tests.golden --check --extra --num-workers 2

Bitwise equality holds only where the whole numeric fingerprint matches: the torch build and its
MKL / oneDNN versions, torch's CPU capability (ATEN_CPU_CAPABILITY changes it), the CPU model and
its instruction-set flags (two CPUs that both report AVX512 pick different MKL and oneDNN kernels
when one has AMX), and the thread count of the runs. golden.json holds one recording per
fingerprint it was recorded on; a machine that matches none is compared within TOLERANCE against
every recording, and the test says which comparison it made. `--record` adds (or replaces) this
machine's recording and keeps the others.
"""

import argparse
import hashlib
import json
import os
import re
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
          "--seed", 7, "--compute-dtype", "none"]  # fp32 on every CPU (auto is bf16 on one with AVX512-BF16 or AMX)
SCRIPT_ARGS = {
    "biencoder": ("train_biencoder.py", ["--n-passages", 2, "--passage-max-length", 48, "--lr", 1e-3]),
    "reranker": ("train_reranker.py", ["--n-passages", 2, "--rerank-max-length", 64, "--lr", 1e-3]),
    # the three newer kinds (recorded at 3df666c, before their code moved into retrieval_kit/heads/)
    "multi_vector": ("train_biencoder.py", ["--n-passages", 2, "--passage-max-length", 48, "--lr", 1e-3, "--head",
                                            "multi-vector", "--multi-vector-dim", 16, "--query-expansion", "on",
                                            "--skiplist", "punctuation"]),
    "sparse": ("train_biencoder.py", ["--n-passages", 2, "--passage-max-length", 48, "--lr", 1e-3, "--head", "sparse",
                                      "--flops-warmup-steps", 2]),
    "lm_reranker": ("train_reranker.py", ["--n-passages", 2, "--rerank-max-length", 64, "--lr", 1e-3, "--head", "lm",
                                          "--lm-tokens", "data,tool"]),
}
DECODER_KINDS = ("lm_reranker",)  # run on the tiny Llama (tests/conftest.build_tiny_decoder), the others on the tiny BERT
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
KIND_MODES = {"multi_vector": ("plain", "grad_cache", "ddp2"), "sparse": ("plain", "grad_cache", "ddp2"),
              "lm_reranker": ("plain", "ddp2")}  # the newer kinds: the modes that take their own paths
CONFIGS = [f"{kind}/{mode}" for kind in SCRIPT_ARGS for mode in KIND_MODES.get(kind, MODES)]


TOLERANCE = 1e-3  # relative (absolute below 1): what two kernel sets' rounding moves 4 steps of a tiny model.
# Measured between the Xeon (AMX) and AMD EPYC (AVX512) recordings: 8.4e-7 for the one-vector and classifier
# runs, 1.2e-4 for multi-vector on 2 ranks, 2.5e-4 for sparse (a random vocabulary head at lr 1e-3: loss ~11,
# grad norms ~850); 4x the worst.
RUN_THREADS = "1"  # OMP_NUM_THREADS of every golden run (tests/conftest.run_script)


def _cpu():
    """The CPU model and a digest of its instruction-set flags (Linux /proc/cpuinfo; else platform)."""
    import platform

    model, cpu_flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name":
                    model = value
                elif key == "flags" and not cpu_flags:
                    cpu_flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return model, hashlib.sha256(cpu_flags.encode()).hexdigest()[:16]


def _libraries():
    """MKL and oneDNN versions of this torch build (from torch.__config__.show())."""
    shown = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([^\n]+)", shown)
    dnn = re.search(r"MKL-DNN (v[\d.]+)", shown)
    return (mkl.group(1).strip() if mkl else "none"), (dnn.group(1) if dnn else "none")


def fingerprint(env=None):
    """Whatever decides which CPU kernels (and so which float rounding) a golden run gets. `env`:
    the environment the runs get (ATEN_CPU_CAPABILITY in it changes the kernels)."""
    env = os.environ if env is None else env
    capability = env.get("ATEN_CPU_CAPABILITY") or torch.backends.cpu.get_cpu_capability()
    model, cpu_flags = _cpu()
    mkl, onednn = _libraries()
    return {"torch": torch.__version__, "cpu_capability": capability.upper(), "cpu": model, "cpu_flags": cpu_flags,
            "mkl": mkl, "onednn": onednn, "threads": RUN_THREADS}


def load_recordings(path=None):
    """[{"fingerprint", "runs"}] from golden.json."""
    with open(path or GOLDEN_FILE) as f:
        data = json.load(f)
    return data["recordings"]


def comparison(recordings, fp):
    """(recordings to compare against, bitwise?): the one recorded on this fingerprint, bitwise; else
    every recording, within TOLERANCE."""
    same = [r for r in recordings if r["fingerprint"] == fp]
    return (same[:1], True) if same else (recordings, False)


def describe(recordings, fp):
    """One line: which comparison the golden runs make here, and why."""
    _, bitwise = comparison(recordings, fp)
    if bitwise:
        return f"golden runs compared bitwise: recorded on this fingerprint ({fp['cpu']}, {fp['cpu_capability']})"
    return (f"golden runs compared within {TOLERANCE:g} (relative), weights hash not compared: this fingerprint "
            f"({fp['cpu']}, {fp['cpu_capability']}, MKL {fp['mkl']}, oneDNN {fp['onednn']}) matches none of the "
            f"{len(recordings)} recording(s)")


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


def check(recordings, fp, got, name):
    """Problems of one fresh run against the recordings this fingerprint compares with."""
    against, bitwise = comparison(recordings, fp)
    against = [r for r in against if name in r["runs"]]  # (a config added later: the recordings made since)
    if not against:
        return [f"{name}: no recording holds it (record it: python -m tests.golden --record --configs {name})"]
    problems = []
    for r in against:
        problems += [(f"[recorded on {r['fingerprint']['cpu']}] " if not bitwise else "") + p
                     for p in compare(r["runs"][name], got, bitwise)]
    return problems


def run_config(name, model_dir, train_file, out_dir, extra=(), env=None, decoder_dir=None):
    """Run one golden config into out_dir (fresh) and return its summary; `env`: extra environment
    variables for the run (e.g. ATEN_CPU_CAPABILITY); `decoder_dir`: the tiny Llama of DECODER_KINDS."""
    from tests.conftest import run_script
    from tests.test_ckpt import kill_after_checkpoint, launch

    kind, mode = name.split("/")
    script, kind_args = SCRIPT_ARGS[kind]
    model_dir = decoder_dir if kind in DECODER_KINDS else model_dir
    nproc, mode_args = MODES[mode]
    args = ["--model", model_dir, "--train-file", train_file, "--output-dir", out_dir, *COMMON, *kind_args,
            *mode_args, *extra]
    if mode == "sigkill_resume":
        proc = launch(script, args + ["--max-steps", 100000], nproc, env)  # constant LR: the same path as --max-steps 4
        rc, _, _ = kill_after_checkpoint(proc, os.path.join(out_dir, "step_000002"), signal.SIGKILL)
        assert rc == -signal.SIGKILL, rc
        args += ["--resume", "auto"]
    run_script(script, args, nproc, env=env)
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
                same = v == g if bitwise else abs(v - g) <= TOLERANCE * max(1.0, abs(v))
                if not same:
                    problems.append(f"{split} step {step} {k}: recorded {v!r}, now {g!r}")
    if bitwise and want["weights"] != got["weights"]:
        problems.append(f"final weights hash: recorded {want['weights'][:16]}, now {got['weights'][:16]}")
    return problems


def make_inputs(tmp):
    """The tiny models and training file the golden runs use (as tests/conftest.py builds them)."""
    from transformers import AutoTokenizer, BertModel

    from tests.conftest import build_tiny_decoder, minilm_dir, tiny_bert_config

    tok = AutoTokenizer.from_pretrained(minilm_dir())
    model_dir = os.path.join(tmp, "tiny_bert")
    torch.manual_seed(0)
    BertModel(tiny_bert_config(len(tok))).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    train_file = os.path.join(tmp, "train64.jsonl")
    with open(os.path.join(ROOT, "data", "train.jsonl")) as f, open(train_file, "w") as out:
        out.writelines(next(f) for _ in range(64))
    return model_dir, train_file, build_tiny_decoder(os.path.join(tmp, "tiny_llama"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true", help=f"rewrite {os.path.relpath(GOLDEN_FILE, ROOT)}")
    ap.add_argument("--check", action="store_true", help="rerun every config and compare")
    ap.add_argument("--configs", nargs="*", default=CONFIGS)
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="flags added to every run (with --check)")
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, train_file, decoder_dir = make_inputs(tmp)
        got = {name: run_config(name, model_dir, train_file, os.path.join(tmp, name.replace("/", "_")), a.extra,
                                decoder_dir=decoder_dir) for name in a.configs}
    fp = fingerprint()
    if a.record:
        old = load_recordings() if os.path.exists(GOLDEN_FILE) else []
        mine = next((r for r in old if r["fingerprint"] == fp), None)
        runs = {**(mine["runs"] if mine else {}), **got}
        if set(runs) != set(CONFIGS):
            sys.exit(f"--record: a new fingerprint needs every config; missing {sorted(set(CONFIGS) - set(runs))}")
        recordings = [r for r in old if r is not mine] + [{"fingerprint": fp, "runs": runs}]
        with open(GOLDEN_FILE, "w") as f:
            json.dump({"recordings": recordings}, f, indent=1)
        print(f"wrote {GOLDEN_FILE}: {len(got)} runs recorded on {fp}; {len(recordings)} recording(s)")
    if a.check:
        recordings = load_recordings()
        print(describe(recordings, fp))
        bad = {n: check(recordings, fp, got[n], n) for n in got}
        for n, p in bad.items():
            print(f"{n}: {'ok' if not p else 'DIFFERS'}" + "".join(f"\n  {x}" for x in p[:10]))
        sys.exit(1 if any(bad.values()) else 0)


if __name__ == "__main__":
    main()

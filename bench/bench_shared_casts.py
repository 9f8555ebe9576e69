"""Shared weight casts against a cast per use: one chunked bf16 forward/backward of a decoder.

    python bench/bench_shared_casts.py                        # a Qwen3-shaped model, 8 layers x 1024, 8 chunks
    python bench/bench_shared_casts.py --layers 2 --hidden 64 --chunks 3 --reps 1   # a quick look

A decoder built from a config (random weights, fp32 params, dropout as configured: none) runs the
plain step's shape: --chunks forwards of --rows x --tokens token ids under bf16 autocast, one loss
over all of them, one backward. Two sides, each in a fresh process, alternating over --reps rounds:
  shared:  precision.autocast (the kit's: precision.SharedCasts casts each linear weight once per
           context and gives each use its own autograd node);
  per-use: torch.autocast(cache_enabled=False) (the kit before shared casts: every chunk casts every
           linear weight again and keeps its copy for the backward).
Reported per side: the tensors kept for the backward (distinct storages, counted with
saved_tensors_hooks), the peak RSS over the process's size before the step, the step's time (medians
over the rounds), and whether the two sides' gradients are bitwise equal.
"""

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.bench_train_step import peak_rss_mb, reset_peak_rss  # noqa: E402
from retrieval_kit import precision  # noqa: E402


def one_side(args):
    """Build the model, run one step as --only says, return its measures as a dict."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=max(1, args.hidden // 128),
                         head_dim=64 if args.hidden >= 64 else args.hidden, vocab_size=args.vocab,
                         max_position_embeddings=max(512, args.tokens))
    model = Qwen3Model(config).train()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    ids = [torch.randint(0, args.vocab, (args.rows, args.tokens)) for _ in range(args.chunks)]
    saved = {}

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    cast = (lambda: precision.autocast("cpu", torch.bfloat16)) if args.only == "shared" else \
        (lambda: torch.autocast("cpu", torch.bfloat16, cache_enabled=False))
    reset_peak_rss()
    base = peak_rss_mb()
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), cast():
        outs = [model(input_ids=x).last_hidden_state for x in ids]
    sum(o.float().pow(2).mean() for o in outs).backward()
    seconds = time.perf_counter() - t0
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.grad.numpy().tobytes())
    return {"linear_params": linear, "saved_mb": sum(saved.values()) / 2 ** 20, "step_mb": peak_rss_mb() - base,
            "seconds": seconds, "grads": digest.hexdigest()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024; the MLP is 3x)")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--chunks", type=int, default=8, help="forwards before the one backward (default 8)")
    ap.add_argument("--rows", type=int, default=2, help="sequences per chunk (default 2)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per sequence (default 64)")
    ap.add_argument("--reps", type=int, default=2, help="rounds, each side once per round in a fresh process")
    ap.add_argument("--only", choices=("shared", "per-use"), help="(internal) run one side, print it as JSON")
    args = ap.parse_args()
    if args.only:
        print(json.dumps(one_side(args)))
        return
    runs = {"shared": [], "per-use": []}
    for _ in range(args.reps):
        for side in runs:
            out = subprocess.run([sys.executable, sys.argv[0], "--only", side] + sys.argv[1:], capture_output=True,
                                 text=True, check=True)
            runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
    first = runs["shared"][0]
    print(f"Qwen3-shaped decoder, {args.layers} layers x {args.hidden}, {first['linear_params'] / 1e6:.0f}M "
          f"params in linears; {args.chunks} chunks of {args.rows} x {args.tokens} tokens, bf16 autocast over fp32 "
          f"params, one backward; {args.reps} rounds, threads {torch.get_num_threads()}")
    print(f"{'':10} {'saved for backward MB':>22} {'step peak RSS MB':>17} {'step s':>8}")
    for side, rs in runs.items():
        print(f"{side:10} {statistics.median(r['saved_mb'] for r in rs):22.0f} "
              f"{statistics.median(r['step_mb'] for r in rs):17.0f} {statistics.median(r['seconds'] for r in rs):8.2f}")
    same = len({r["grads"] for rs in runs.values() for r in rs}) == 1
    print(f"gradients bitwise equal across sides and rounds: {same}")


if __name__ == "__main__":
    main()

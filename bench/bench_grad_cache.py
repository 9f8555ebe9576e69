"""GradCache memory: peak RSS of one bi-encoder training step at a small and a large batch.

    python bench/bench_grad_cache.py                       # batch 32 and 512, 1 positive + 1 negative, 256 tokens
    python bench/bench_grad_cache.py --batches 16 128
    python bench/bench_grad_cache.py --reranker --max-length 288 --batches 16 256   # cross-encoder pairs

Each measurement runs in a fresh process: load MiniLM in train mode (dropout on), wrap in DDP (a
world of 1), reset the RSS high-water mark, then one full step (collate, GradCache forward/backward
with --chunk-tokens chunks, fused AdamW). The passages are bench/data/train.jsonl: uncut Debian
descriptions, median ~70 tokens, some over 256. With GradCache only one chunk's activations are alive at a time, so the
peak should barely grow with the batch; the plain step at the small batch is shown for scale.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.bench_train_step import peak_rss_mb, reset_peak_rss  # noqa: E402
from retrieval_kit import data, dist, loop, optim  # noqa: E402
from retrieval_kit.records import read_records  # noqa: E402
from retrieval_kit.chunking import chunk_batch  # noqa: E402
from retrieval_kit.collate import collate_biencoder, collate_rerank  # noqa: E402
from retrieval_kit.pairs import DEFAULT_TEMPLATE  # noqa: E402
from retrieval_kit.losses import contrastive_loss, listwise_loss  # noqa: E402
from retrieval_kit.heads.classifier import Classifier, load as load_reranker  # noqa: E402
from retrieval_kit.heads.single_vector import BiEncoder  # noqa: E402
from retrieval_kit.models import default_model_dir, load_encoder  # noqa: E402


def one_step(batch_size, grad_cache, chunk_tokens, max_length, train_file, reranker):
    ctx = dist.init()
    model_dir = default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    net = (load_reranker if reranker else load_encoder)(model_dir).train()
    wrapped = Classifier(net, "avg") if reranker else BiEncoder(net, "avg", True)
    model = dist.wrap_ddp(wrapped, ctx)
    opt = optim.build_optimizer(optim.param_groups(net, 0.01), 1e-5)
    records, _ = read_records(train_file, 2)
    if len(records) < batch_size:
        raise SystemExit(f"{train_file} has {len(records)} groups, fewer than batch {batch_size}")
    recs = records[:batch_size]
    queries, groups = [r.query for r in recs], [data.fixed_group(r, 2) for r in recs]
    if reranker:
        inputs = {"pairs": chunk_batch(collate_rerank(tok, queries, groups, DEFAULT_TEMPLATE, max_length), chunk_tokens)}

        def loss_fn(out):
            return listwise_loss(out["pairs"], 2), None
    else:
        q, p = collate_biencoder(tok, queries, groups, 32, max_length)
        inputs = {"q": chunk_batch(q, chunk_tokens), "p": chunk_batch(p, chunk_tokens)}

        def loss_fn(out):
            return contrastive_loss(out["q"], out["p"], 2), None
    reset_peak_rss()
    t0 = time.perf_counter()
    (loop.grad_cache_step if grad_cache else loop.plain_step)(model, inputs, loss_fn, 1, True)
    opt.step()
    return {"peak_rss_mb": peak_rss_mb(), "step_s": time.perf_counter() - t0}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 512], help="queries per step to measure")
    ap.add_argument("--chunk-tokens", type=int, default=1024)
    ap.add_argument("--max-length", type=int, default=256, help="passage max length (--reranker: pair max length)")
    ap.add_argument("--reranker", action="store_true",
                    help="a cross-encoder step instead (1 positive + 1 negative pair per query, listwise loss)")
    ap.add_argument("--train-file", default=os.path.join(ROOT, "bench", "data", "train.jsonl"))
    ap.add_argument("--one", nargs=2, type=int, help="(internal) batch size and grad-cache flag of one run")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_step(args.one[0], bool(args.one[1]), args.chunk_tokens, args.max_length, args.train_file,
                                    args.reranker)))
        return
    rows = []
    for bs, gc in [(args.batches[0], 0)] + [(b, 1) for b in args.batches]:
        out = subprocess.run([sys.executable, __file__, "--one", str(bs), str(gc), "--chunk-tokens",
                              str(args.chunk_tokens), "--max-length", str(args.max_length),
                              "--train-file", args.train_file] + (["--reranker"] if args.reranker else []),
                             capture_output=True, text=True, check=True)
        rows.append((bs, gc, json.loads(out.stdout.strip().splitlines()[-1])))
    print(f"MiniLM {'cross-encoder' if args.reranker else 'bi-encoder'}, 1 positive + 1 negative per query, "
          f"{'pairs' if args.reranker else 'passages'} up to {args.max_length} tokens, "
          f"--chunk-tokens {args.chunk_tokens}; peak RSS of one step after loading")
    for bs, gc, r in rows:
        print(f"  batch {bs:4}  {'grad-cache' if gc else 'plain     '}  peak {r['peak_rss_mb']:8.0f} MB  step {r['step_s']:7.1f} s")
    gc_rows = [r for _, gc, r in rows if gc]
    print(f"  grad-cache peak, batch {args.batches[-1]} / batch {args.batches[0]}: "
          f"{gc_rows[-1]['peak_rss_mb'] / gc_rows[0]['peak_rss_mb']:.2f}x")


if __name__ == "__main__":
    main()

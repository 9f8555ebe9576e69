"""Mining at scale: `python -m retrieval_kit.mine` over a 1M-passage corpus on 1 and on 2 ranks, with
a tiny random BERT (the encoder's cost is not what is measured; the corpus's size is), texts cut to
32 tokens, the false-negative filter off (a random model scores everything alike).

    python bench/bench_mine.py                       # 1M passages, 100k queries
    python bench/bench_mine.py --passages 20000 --queries 2000

The data is bench_data.py's (written under --dir if missing): its corpus.jsonl, and the first
--queries records of its train.jsonl as --input (docs by id into --corpus). Each world runs in a
fresh process under torchrun, the files parsed once beforehand into a data cache under --dir;
reported: wall time, the peak RSS of the largest rank (getrusage of the waited children), and the
embeddings rank 0 holds - its blocks of the passages and of the queries (8192 texts each, block b
on rank b % world) and one round of gathered queries - against what gathering the whole corpus and
all queries onto every rank holds. The two mined files are compared line by line: with batches of
several texts, a text's embedding depends on the batch it was padded in (float rounding), so lines
whose near-tied candidates swap are counted; tests/test_mine.py shows the files equal bitwise with
batches of one text.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_data import write_data  # noqa: E402

HIDDEN = 64


def tiny_model(out):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from retrieval_kit.models import default_model_dir

    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tok), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=4 * HIDDEN, max_position_embeddings=128)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def one_run(args, world):
    """In this (fresh) process: mine under torchrun with `world` ranks; print one JSON line."""
    out = os.path.join(args.dir, f"mined_{world}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", "-m",
           "retrieval_kit.mine", "--input", os.path.join(args.dir, f"input_{args.queries}.jsonl"), "--corpus",
           os.path.join(args.dir, "corpus.jsonl"), "--model", os.path.join(args.dir, "tiny_model"), "--out", out,
           "--overwrite", "--k", 7, "--depth", 50, "--max-score-ratio", 0, "--batch-size", args.batch_size, "--query-block",
           args.query_block, "--passage-max-length", 32, "--query-max-length", 32, "--data-cache",
           os.path.join(args.dir, "cache")]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // world))}
    t0 = time.perf_counter()
    proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"mining on {world} rank(s) failed:\n{proc.stderr[-3000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "peak_rss_mb": peak, "out": out, "stdout": proc.stdout[-2000:]}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passages", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=100_000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--query-block", type=int, default=4096)
    ap.add_argument("--dir", default="/tmp/retrieval_kit_bench_data")
    ap.add_argument("--one-run", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_run:
        return one_run(args, args.one_run)
    meta_path = os.path.join(args.dir, "meta.json")
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
    if meta.get("passages") != args.passages or meta.get("queries", 0) < args.queries:
        os.makedirs(args.dir, exist_ok=True)
        print(f"writing {args.queries:,} queries over {args.passages:,} passages to {args.dir} ...", flush=True)
        write_data(args.dir, args.queries, 8, args.passages)
    src = os.path.join(args.dir, f"input_{args.queries}.jsonl")
    with open(os.path.join(args.dir, "train.jsonl")) as f, open(src, "w") as out:
        for _, line in zip(range(args.queries), f):
            out.write(line)
    tiny_model(os.path.join(args.dir, "tiny_model"))
    from retrieval_kit import formats
    from retrieval_kit.records import read_records

    cache = os.path.join(args.dir, "cache")  # built here, so both worlds map the parsed files alike
    read_records(src, corpus=formats.read_corpus(os.path.join(args.dir, "corpus.jsonl"), cache), cache=cache)
    runs = {}
    for world in (1, 2):
        proc = subprocess.run([sys.executable, __file__, "--one-run", str(world), "--dir", args.dir, "--queries",
                               str(args.queries), "--batch-size", str(args.batch_size), "--query-block",
                               str(args.query_block)], capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        runs[world] = json.loads(proc.stdout.strip().splitlines()[-1])
    mb = 4 * HIDDEN / 2**20
    n_p, n_q = args.passages, args.queries
    gathered = (n_p + n_q) * mb
    print(f"mining {n_q:,} queries over {n_p:,} passages (docs by id), tiny BERT ({HIDDEN} dims, 2 layers), "
          f"batch {args.batch_size}, 32 tokens, depth 50, k 7, the false-negative filter off (a random model's "
          f"scores are all alike), {args.query_block} queries per rank a round")
    for world, r in runs.items():
        # its blocks of passages and queries, and in a round (2 ranks): its queries padded, every rank's gathered,
        # and their concatenation
        own = sum(min(8192, n - b * 8192) for n in (n_p, n_q) for b in range(0, -(-n // 8192)) if b % world == 0)
        held = (own + (0 if world == 1 else (1 + 2 * world) * args.query_block)) * mb
        print(f"  {world} rank{'s' if world > 1 else ''}: {r['seconds']:.0f} s, peak RSS of the largest rank "
              f"{r['peak_rss_mb']:,.0f} MB; embeddings held per rank {held:,.0f} MB = {held / gathered:.2f}x of "
              f"gathering the corpus and the queries ({gathered:,.0f} MB)")
    a, b = (open(runs[w]["out"]).read().splitlines() for w in (1, 2))
    same = sum(x == y for x, y in zip(a, b))
    negs = [(json.loads(x)["neg_doc"], json.loads(y)["neg_doc"]) for x, y in zip(a, b) if x != y]
    same_set = sum(sorted(x) == sorted(y) for x, y in negs)
    print(f"  2 ranks vs 1: {len(b):,} vs {len(a):,} records; {same:,} lines identical ({same / max(1, len(a)):.2%}); "
          f"of the rest {same_set} hold the same negatives in another order")


if __name__ == "__main__":
    main()

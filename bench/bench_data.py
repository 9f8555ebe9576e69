"""Scale of the training-data side: load time and memory for Q queries x N negatives over a corpus
of P passages referenced by id (the issue's case: 1M x 8 over 1M).

    python bench/bench_data.py                      # 1M queries, 8 negatives, 1M passages
    python bench/bench_data.py --queries 100000 --passages 100000 --runs 3

Synthetic text: passages of ~60 words (MS MARCO's passages average ~56), queries of ~6 words, drawn
from a fixed vocabulary with a seeded RNG. Writes corpus.jsonl and train.jsonl (NeMo format, docs as
ids) once under --dir, then in a fresh process per run: imports (the baseline RSS), reads the corpus
and the training file as train_*.py does (formats.read_corpus, records.read_records with n_passages
9, then the corpus's id index dropped, keeping its texts), and reports seconds and RSS: the growth
over the baseline is the data side, compared with the corpus text's size; the peak (VmHWM) is the
high-water mark during the load. Median of --runs. The baseline, measured the same way: a dict of texts by id and records as Python
lists of those strings (what the kit's reader held before, less the per-record copies of inline text).
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_data(out_dir, n_queries, n_negatives, n_passages, seed=0):
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    corpus, train = os.path.join(out_dir, "corpus.jsonl"), os.path.join(out_dir, "train.jsonl")
    text_bytes = 0
    with open(corpus, "w") as f:
        for i in range(n_passages):
            text = " ".join(rng.choices(words, k=rng.randint(40, 80)))
            text_bytes += len(text.encode())
            f.write(json.dumps({"_id": f"d{i}", "title": "", "text": text}) + "\n")
    with open(train, "w") as f:
        for i in range(n_queries):
            docs = rng.sample(range(n_passages), n_negatives + 1)
            f.write(json.dumps({"query": " ".join(rng.choices(words, k=rng.randint(3, 9))), "pos_doc": [f"d{docs[0]}"],
                                "neg_doc": [f"d{j}" for j in docs[1:]]}) + "\n")
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump({"queries": n_queries, "negatives": n_negatives, "passages": n_passages, "text_bytes": text_bytes}, f)


def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def peak_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def one_run(out_dir, n_passages):
    """In this (fresh) process: load as the scripts do; print one JSON line."""
    import time

    sys.path.insert(0, ROOT)
    from retrieval_kit import formats  # imports torch and numpy: the baseline RSS
    from retrieval_kit.records import read_records

    base = rss_mb()
    t0 = time.perf_counter()
    corpus = formats.read_corpus(os.path.join(out_dir, "corpus.jsonl"))
    t_corpus = time.perf_counter() - t0
    records, _ = read_records(os.path.join(out_dir, "train.jsonl"), n_passages, corpus)
    seconds = time.perf_counter() - t0
    import gc

    del corpus  # as in records.read_train_val: the records keep the corpus's texts, not its id index
    gc.collect()
    print(json.dumps({"seconds": seconds, "corpus_seconds": t_corpus, "base_mb": base, "rss_mb": rss_mb(),
                      "peak_mb": peak_mb(), "held_mb": records.nbytes() / 2**20, "records": len(records)}))


def one_run_naive(out_dir):
    """The baseline, in a fresh process: what a plain loader holds - a dict of the corpus's texts by
    id and each record as Python lists of those (shared) strings, as the kit's reader did before
    textstore.py (json.loads, no validation)."""
    import time

    __import__("torch")  # the same baseline imports

    base = rss_mb()
    t0 = time.perf_counter()
    with open(os.path.join(out_dir, "corpus.jsonl")) as f:
        texts = {d["_id"]: d["text"] for d in map(json.loads, f)}
    with open(os.path.join(out_dir, "train.jsonl")) as f:
        records = [(r["query"], [texts[i] for i in r["pos_doc"]], [texts[i] for i in r["neg_doc"]])
                   for r in map(json.loads, f)]
    seconds = time.perf_counter() - t0
    del texts
    print(json.dumps({"seconds": seconds, "corpus_seconds": float("nan"), "base_mb": base, "rss_mb": rss_mb(),
                      "peak_mb": peak_mb(), "held_mb": float("nan"), "records": len(records)}))


def measure(args, mode):
    runs = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, __file__, "--one-run", mode, "--dir", args.dir, "--negatives",
                              str(args.negatives)], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, default=1_000_000)
    ap.add_argument("--negatives", type=int, default=8)
    ap.add_argument("--passages", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/retrieval_kit_bench_data")
    ap.add_argument("--one-run", choices=["kit", "naive"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_run:
        return one_run(args.dir, args.negatives + 1) if args.one_run == "kit" else one_run_naive(args.dir)
    meta_path, want = os.path.join(args.dir, "meta.json"), {"queries": args.queries, "negatives": args.negatives,
                                                             "passages": args.passages}
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
    if {k: meta.get(k) for k in want} != want:
        os.makedirs(args.dir, exist_ok=True)
        print(f"writing {args.queries:,} queries x {args.negatives} negatives over {args.passages:,} passages "
              f"to {args.dir} ...", flush=True)
        write_data(args.dir, args.queries, args.negatives, args.passages)
        meta = json.load(open(meta_path))
    text_mb = meta["text_bytes"] / 2**20
    med, naive = measure(args, "kit"), measure(args, "naive")
    files_mb = sum(os.path.getsize(os.path.join(args.dir, f)) for f in ("corpus.jsonl", "train.jsonl")) / 2**20
    print(f"{args.queries:,} queries x ({args.negatives} negatives + 1 positive) over {args.passages:,} passages "
          f"by id; files {files_mb:,.0f} MB, corpus text {text_mb:,.0f} MB; median of {args.runs} runs")
    print(f"  load (corpus + training file, validated): {med['seconds']:.1f} s (corpus {med['corpus_seconds']:.1f} s)")
    grown, peak = med["rss_mb"] - med["base_mb"], med["peak_mb"] - med["base_mb"]
    print(f"  RSS: {med['base_mb']:,.0f} MB after imports -> {med['rss_mb']:,.0f} MB loaded (peak {med['peak_mb']:,.0f})")
    print(f"  data side: {grown:,.0f} MB = {grown / text_mb:.2f}x the corpus text (peak {peak / text_mb:.2f}x); "
          f"arrays and texts held: {med['held_mb']:,.0f} MB")
    n_grown, n_peak = naive["rss_mb"] - naive["base_mb"], naive["peak_mb"] - naive["base_mb"]
    print(f"  baseline (a dict of texts by id, records as lists of those strings; no validation): "
          f"{naive['seconds']:.1f} s, data side {n_grown:,.0f} MB = {n_grown / text_mb:.2f}x (peak "
          f"{n_peak / text_mb:.2f}x); the kit holds {grown / n_grown:.2f}x of it")


if __name__ == "__main__":
    main()

"""Scale of the training-data side: load time and memory for Q queries x N negatives over a corpus
of P passages referenced by id (the issue's case: 1M x 8 over 1M).

    python bench/bench_data.py                      # 1M queries, 8 negatives, 1M passages
    python bench/bench_data.py --queries 100000 --passages 100000 --runs 3

Synthetic text: passages of ~60 words (MS MARCO's passages average ~56), queries of ~6 words, drawn
from a fixed vocabulary with a seeded RNG. Writes corpus.jsonl and train.jsonl (NeMo format, docs as
ids) once under --dir, then in a fresh process per run reads them as train_*.py does
(records.read_train_val: every line validated, the files' digests taken, the corpus's id index
dropped) in three ways: the data cache off; cold (the cache under --dir/cache removed first, so the
run parses and writes it); warm (the cache mapped). Reports seconds and RSS: the growth over the
process after its imports is the data side, compared with the corpus text's size; the peak (VmHWM)
is the high-water mark during the load. Median of --runs.

Then the sharing: 2 "ranks" (processes that each load the data) fork 2 workers each, as DataLoader
workers are forked on Linux; all 6 read every page of the data and report their proportional set
size (PSS: a page shared by k processes counts 1/k in each) while all are alive. The sum, less the
same tree's without data, is the data's footprint on the node. The baseline: a dict of texts by id
and records as Python lists of those strings (what the kit's reader held before textstore.py).
"""

import argparse
import contextlib
import gc
import io
import json
import os
import random
import shutil
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


def load(out_dir, n_passages, cache):
    """The corpus and the training file read as train_*.py reads them (records.read_train_val: every
    line validated, the files' digests for the resume check); the corpus's id index is dropped."""
    from retrieval_kit.records import DataSpec, read_train_val

    spec = DataSpec(train_files=[os.path.join(out_dir, "train.jsonl")], corpus=os.path.join(out_dir, "corpus.jsonl"),
                    n_passages=n_passages, data_cache=cache)
    with contextlib.redirect_stdout(io.StringIO()):
        files, _, _, _ = read_train_val(spec, world_size=1)
    return files[0].records


CACHES = {"nocache": "off", "cold": "cache", "warm": "cache"}


def one_run(out_dir, n_passages, mode):
    """In this (fresh) process: load as the scripts do, with the data cache off, built anew (cold) or
    present (warm); print one JSON line."""
    import time

    sys.path.insert(0, ROOT)
    __import__("retrieval_kit.records")  # imports torch and numpy: the baseline RSS

    cache = os.path.join(out_dir, "cache")
    if mode == "cold":
        shutil.rmtree(cache, ignore_errors=True)
    base = rss_mb()
    t0 = time.perf_counter()
    records = load(out_dir, n_passages, None if mode == "nocache" else cache)
    seconds = time.perf_counter() - t0
    gc.collect()
    print(json.dumps({"seconds": seconds, "base_mb": base, "rss_mb": rss_mb(), "peak_mb": peak_mb(),
                      "held_mb": records.nbytes() / 2**20, "records": len(records)}))


def buffers(records):
    """Every array and text buffer the records hold (in memory or mapped)."""
    out = [getattr(records, n) for n in records.ARRAYS]
    for store in (records.queries, records.passages):
        out += [store._base, store._base_ends, store._buf, store._ends]
    return [b for b in out if b is not None and len(b)]


def touch(bufs):
    """Read one byte of every page, as an epoch over all the records would."""
    import numpy as np

    return sum(int(np.frombuffer(b, dtype=np.uint8)[::4096].sum()) for b in bufs)


def pss_mb():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) / 1024


def one_tree(out_dir, n_passages, mode, ranks=2, workers=2):
    """In this (fresh) process: `ranks` processes each load the data (mode "nocache": parsed in each;
    "cache": mapped from the cache; "empty": nothing) and fork `workers` DataLoader-like workers; all
    of them read every page of the data, then each reports its proportional set size while all are
    alive. Prints one JSON line: the PSS summed over ranks and workers."""
    import multiprocessing as mp

    sys.path.insert(0, ROOT)
    __import__("retrieval_kit.records")

    ctx = mp.get_context("fork")  # as the DataLoader's workers on Linux
    n = ranks * (1 + workers)
    barrier, pss = ctx.Barrier(n + 1), ctx.Queue()

    def report(bufs):
        touch(bufs)
        barrier.wait()
        pss.put(pss_mb())
        barrier.wait()

    def rank():
        bufs = [] if mode == "empty" else buffers(load(out_dir, n_passages, "off" if mode == "nocache" else
                                                       os.path.join(out_dir, "cache")))
        kids = [ctx.Process(target=report, args=(bufs,)) for _ in range(workers)]
        for k in kids:
            k.start()
        report(bufs)
        for k in kids:
            k.join()

    procs = [ctx.Process(target=rank) for _ in range(ranks)]
    for p in procs:
        p.start()
    barrier.wait()
    barrier.wait()
    got = [pss.get() for _ in range(n)]
    for p in procs:
        p.join()
    print(json.dumps({"pss_mb": sum(got), "processes": n}))


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


def measure(args, mode, runs=None):
    got = []
    for _ in range(runs or args.runs):
        out = subprocess.run([sys.executable, __file__, "--one-run", mode, "--dir", args.dir, "--negatives",
                              str(args.negatives)], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"{mode} run failed:\n{out.stderr[-3000:]}")
        got.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in got) for k in got[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, default=1_000_000)
    ap.add_argument("--negatives", type=int, default=8)
    ap.add_argument("--passages", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/retrieval_kit_bench_data")
    ap.add_argument("--skip-baseline", action="store_true", help="leave out the plain-Python baseline")
    ap.add_argument("--modes", default="nocache,cold,warm", help="the loads to time, of nocache, cold, warm "
                    "(default all three)")
    ap.add_argument("--skip-sharing", action="store_true", help="leave out the 2 ranks x 2 workers PSS measure")
    ap.add_argument("--one-run", choices=["nocache", "cold", "warm", "naive", "tree-empty", "tree-nocache",
                                          "tree-cache"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_run:
        if args.one_run == "naive":
            return one_run_naive(args.dir)
        if args.one_run.startswith("tree-"):
            return one_tree(args.dir, args.negatives + 1, args.one_run[5:])
        return one_run(args.dir, args.negatives + 1, args.one_run)
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
    files_mb = sum(os.path.getsize(os.path.join(args.dir, f)) for f in ("corpus.jsonl", "train.jsonl")) / 2**20
    print(f"{args.queries:,} queries x ({args.negatives} negatives + 1 positive) over {args.passages:,} passages "
          f"by id; files {files_mb:,.0f} MB, corpus text {text_mb:,.0f} MB; median of {args.runs} runs", flush=True)
    for mode, what in (("nocache", "no cache (--data-cache off)"), ("cold", "cold: parsed, cache written"),
                       ("warm", "warm: cache mapped")):
        if mode not in args.modes.split(","):
            continue
        med = measure(args, mode)
        grown, peak = med["rss_mb"] - med["base_mb"], med["peak_mb"] - med["base_mb"]
        print(f"  load, {what}: {med['seconds']:.2f} s; data side (RSS over {med['base_mb']:,.0f} MB after imports) "
              f"{grown:,.0f} MB = {grown / text_mb:.2f}x the corpus text (peak {peak / text_mb:.2f}x); "
              f"arrays and texts held {med['held_mb']:,.0f} MB", flush=True)
    cache_mb = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(args.dir, "cache"))
                   for f in fs) / 2**20
    print(f"  cache on disk: {cache_mb:,.0f} MB", flush=True)
    if args.skip_sharing:
        return
    empty = measure(args, "tree-empty", 1)["pss_mb"]
    for mode, what in (("tree-nocache", "no cache"), ("tree-cache", "cache mapped")):
        got = measure(args, mode, 1)["pss_mb"] - empty
        print(f"  PSS of the data summed over 2 ranks x 2 workers each, every page read, {what}: {got:,.0f} MB = "
              f"{got / text_mb:.2f}x the corpus text", flush=True)
    if not args.skip_baseline:
        naive = measure(args, "naive")
        n_grown, n_peak = naive["rss_mb"] - naive["base_mb"], naive["peak_mb"] - naive["base_mb"]
        print(f"  baseline (a dict of texts by id, records as lists of those strings; no validation): "
              f"{naive['seconds']:.1f} s, data side {n_grown:,.0f} MB = {n_grown / text_mb:.2f}x (peak "
              f"{n_peak / text_mb:.2f}x)")


if __name__ == "__main__":
    main()

"""Encoding and pair-scoring throughput: the kit against a plain loop and against sentence-transformers.

    python bench/bench_encode.py                 # 500 docs of data/eval, MiniLM, batch 64, max length 128
    python bench/bench_encode.py --docs 2000 --reps 3 --pairs 1000

Texts (evaluation, mining): the same texts, model, batch size, max length and mean pooling, normalized.
  plain: model(**batch) over the corpus in file order (every batch pads to its longest text);
  kit: encode.encode_texts (length-sorted batches);
  sentence-transformers: SentenceTransformer(model).encode (its own length sort), max_seq_length set.
Pairs (evaluate --reranker, retrieval_kit.score): each of data/eval's queries with corpus docs, scored by
a one-logit cross-encoder from the same model (a fresh head, exported once by the kit so both sides load
the same weights), the same pairs per forward and max length.
  kit: encode.score_pairs (length-sorted forwards);
  sentence-transformers: CrossEncoder(export).predict (its own length sort).
Sides alternate within each of --reps rounds; medians are reported, with the largest difference between
the sides' outputs, and useful FLOP/s (forward FLOPs on the real tokens, bench_peer.useful_flops / 3)
against this CPU's fp32 matmul peak at the model's shapes.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.bench_peer import matmul_peak, useful_flops  # noqa: E402
from retrieval_kit import precision  # noqa: E402
from retrieval_kit.collate import collate_rerank  # noqa: E402
from retrieval_kit.pairs import PAIR, pair_layout  # noqa: E402
from retrieval_kit.encode import encode_texts, score_pairs  # noqa: E402
from retrieval_kit.export import export_reranker, load_exported_reranker  # noqa: E402
from retrieval_kit.heads.classifier import load as load_reranker  # noqa: E402
from retrieval_kit.heads.single_vector import BiEncoder  # noqa: E402
from retrieval_kit.models import default_model_dir, load_encoder  # noqa: E402


@torch.no_grad()
def plain(model, tok, texts, max_length, batch_size):
    out = []
    for s in range(0, len(texts), batch_size):
        b = tok(texts[s:s + batch_size], max_length=max_length, truncation=True, padding=True, return_tensors="pt")
        h = model(**b).last_hidden_state
        m = b["attention_mask"].unsqueeze(-1).float()
        out.append(F.normalize((h * m).sum(1) / m.sum(1), dim=-1))
    return torch.cat(out)


def timed(sides, reps):
    """{side: (median seconds, output of the last run)}, the sides alternating their order each round."""
    times, outs = {k: [] for k in sides}, {}
    for i in range(reps):
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            t0 = time.perf_counter()
            outs[name] = sides[name]()
            times[name].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), outs[k]) for k, v in times.items()}


def bf16_side(name, args, model, fn):
    """{name + " bf16": fn(a copy of `model` whose forwards run under bf16 autocast, as the tools'
    --compute-dtype bf16 runs them)} when --compute-dtype bf16, else {}."""
    if args.compute_dtype != "bf16":
        return {}
    bf16 = precision.autocast_forward(copy.deepcopy(model), "cpu", torch.bfloat16)
    return {f"{name} bf16": lambda: fn(bf16)}


def report(title, n, unit, results, baseline, flops, peak):
    print(title)
    for name, (sec, _) in results.items():
        ratio = results[baseline][0] / sec
        print(f"  {name:22} {sec:8.2f} s  {n / sec:8.1f} {unit}/s  {ratio:5.2f}x {baseline}'s  "
              f"useful {flops / sec / 1e9:6.1f} GFLOP/s ({100 * flops / sec / 1e9 / peak:.0f}% of peak)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model dir (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--docs", type=int, default=500)
    ap.add_argument("--pairs", type=int, default=500, help="(query, doc) pairs scored (0: skip the pair side)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64, help="texts per forward")
    ap.add_argument("--pair-batch-size", type=int, default=32, help="pairs per forward")
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--pair-max-length", type=int, default=256)
    ap.add_argument("--compute-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: a kit side under bf16 autocast is timed as well (the matmul peak shown for both)")
    args = ap.parse_args()
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.cross_encoder import CrossEncoder as STCrossEncoder

    model_dir = args.model or default_model_dir()
    config = AutoConfig.from_pretrained(model_dir)
    tok, model = AutoTokenizer.from_pretrained(model_dir), load_encoder(model_dir).eval()
    with open(os.path.join(ROOT, "data", "eval", "corpus.jsonl")) as f:
        corpus = [json.loads(line)["text"] for line in f]
    with open(os.path.join(ROOT, "data", "eval", "queries.jsonl")) as f:
        queries = [json.loads(line)["text"] for line in f]
    texts = corpus[:args.docs]
    st = SentenceTransformer(model_dir, device="cpu")
    st.max_seq_length = args.max_length
    res = timed({"plain loop (file order)": lambda: plain(model, tok, texts, args.max_length, args.batch_size),
                 "sentence-transformers": lambda: torch.from_numpy(st.encode(
                     texts, batch_size=args.batch_size, normalize_embeddings=True)),
                 "kit encode_texts": lambda: encode_texts(BiEncoder(model), tok, texts, args.max_length,
                                                          batch_size=args.batch_size),
                 **bf16_side("kit encode_texts", args, model, lambda m: encode_texts(BiEncoder(m), tok, texts,
                                                                                     args.max_length,
                                                                                     batch_size=args.batch_size))},
                args.reps)
    lengths = [len(x) for x in tok(texts, max_length=args.max_length, truncation=True)["input_ids"]]
    peak = matmul_peak(config)
    kit = res["kit encode_texts"][1]
    print(f"model {model_dir}; {torch.get_num_threads()} threads; fp32 matmul peak at its shapes {peak:.1f} GFLOP/s"
          + (f", bf16 {matmul_peak(config, dtype=torch.bfloat16):.1f} GFLOP/s (shares below: of fp32's)"
             if args.compute_dtype == "bf16" else ""))
    if args.compute_dtype == "bf16":
        print(f"  bf16 vs fp32 kit embeddings: max difference {(res['kit encode_texts bf16'][1] - kit).abs().max():.1e}, "
              f"cosine min {F.cosine_similarity(res['kit encode_texts bf16'][1], kit).min():.5f}")
    report(f"{len(texts)} docs of data/eval (tokens: median {statistics.median(lengths)}, max {max(lengths)}), batch "
           f"{args.batch_size}, max length {args.max_length}, {args.reps} reps; max embedding difference kit vs "
           f"sentence-transformers {(kit - res['sentence-transformers'][1]).abs().max().item():.1e}, vs plain "
           f"{(kit - res['plain loop (file order)'][1]).abs().max().item():.1e}",
           len(texts), "docs", res, "sentence-transformers", useful_flops(config, lengths) / 3, peak)
    if not args.pairs:
        return
    qs = [queries[i % len(queries)] for i in range(args.pairs)]
    ps = [corpus[(7 * i) % len(corpus)] for i in range(args.pairs)]
    settings = {"kind": "reranker", "pooling": "native", "bidirectional": False, "prompt_template": PAIR,
                "rerank_max_length": args.pair_max_length, "append_eos": False, "padding_side": tok.padding_side,
                "pad_to_multiple_of": 8}
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        export_reranker(tmp, load_reranker(model_dir), tok, settings)
        rr, rr_tok, saved = load_exported_reranker(tmp)
        ce = STCrossEncoder(tmp, device="cpu", max_length=args.pair_max_length)
    pairs = list(zip(qs, ps))
    res = timed({"sentence-transformers": lambda: torch.from_numpy(ce.predict(
                     pairs, batch_size=args.pair_batch_size)).float().flatten(),
                 "kit score_pairs": lambda: score_pairs(rr, rr_tok, qs, ps, saved, args.pair_batch_size),
                 **bf16_side("kit score_pairs", args, rr, lambda m: score_pairs(m, rr_tok, qs, ps, saved,
                                                                                args.pair_batch_size))}, args.reps)
    layout = pair_layout(rr_tok)
    lengths = [int(collate_rerank(rr_tok, [q], [[p]], max_length=args.pair_max_length, layout=layout)
                   ["attention_mask"].sum()) for q, p in pairs]
    report(f"{len(pairs)} (query, doc) pairs of data/eval (tokens: median {statistics.median(lengths)}, max "
           f"{max(lengths)}), {args.pair_batch_size} per forward, max length {args.pair_max_length}; max score "
           f"difference {(res['kit score_pairs'][1] - res['sentence-transformers'][1]).abs().max().item():.1e}",
           len(pairs), "pairs", res, "sentence-transformers", useful_flops(config, lengths) / 3, peak)
    if args.compute_dtype == "bf16":
        print(f"  bf16 vs fp32 kit scores: max difference "
              f"{(res['kit score_pairs bf16'][1] - res['kit score_pairs'][1]).abs().max():.1e}")


if __name__ == "__main__":
    main()

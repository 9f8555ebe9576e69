"""Retrieve-then-rerank quality along a reranker run: nDCG@10 etc. at each checkpoint and top-k.

    python bench/rerank_curve.py --biencoder runs/biencoder/final --run runs/reranker \\
        --beir data/eval data/ood --top-k 5 10 20
    python bench/rerank_curve.py --biencoder runs/biencoder/final --run runs/smol_reranker --final \\
        --zero-shot SMOLLM2_DIR --weights 1 0.5 --compute-dtype bf16     # docs/decoders.md

The bi-encoder retrieves once per BEIR set; each checkpoint's weights (`step_*/model.safetensors`)
are loaded into the run's exported reranker (`final/`, which brings the tokenization), the top
max(--top-k) of every query are scored once, and each top-k is reranked from those scores.
--final scores final/ itself (a LoRA run's checkpoints hold adapters only); --zero-shot BASE scores
the base model's own weights through final/'s tokenization and head (an LM reranker's template and
yes / no tokens): the untrained floor. Pairs are scored --batch-size at a time, sorted by length.
"""

import argparse
import glob
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from retrieval_kit import ckpt  # noqa: E402
from retrieval_kit import precision  # noqa: E402
from retrieval_kit.encode import score_pairs  # noqa: E402
from retrieval_kit.pairs import rerank_layout  # noqa: E402
from retrieval_kit.evaluate import fuse_scores, load_beir, load_biencoder, reorder, retrieve  # noqa: E402
from retrieval_kit.export import load_exported_reranker  # noqa: E402
from retrieval_kit.metrics import rank_docs, retrieval_metrics  # noqa: E402


def load_weights(model_dir):
    """A model dir's weights as one state dict (its safetensors files, sharded or not)."""
    from safetensors.torch import load_file

    state = {}
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        state.update(load_file(f))
    return state


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--biencoder", required=True)
    ap.add_argument("--run", required=True, help="reranker run folder (step_* checkpoints and final/)")
    ap.add_argument("--beir", nargs="+", default=["data/eval", "data/ood"])
    ap.add_argument("--top-k", type=int, nargs="+", default=[5, 10, 20])
    ap.add_argument("--weights", type=float, nargs="+", default=[1.0],
                    help="reranker weights for evaluate.fuse_scores (1 = reranker alone)")
    ap.add_argument("--steps", type=int, nargs="*", default=None, help="only these checkpoint steps")
    ap.add_argument("--final", action="store_true", help="also score the run's final/ export as it is")
    ap.add_argument("--zero-shot", metavar="BASE", default=None,
                    help="also score the base model dir BASE (its weights) with final/'s tokenization and head")
    ap.add_argument("--batch-size", type=int, default=32, help="pairs per forward (default 32)")
    ap.add_argument("--compute-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="the reranker's forwards under bf16 autocast (the bi-encoder stays fp32)")
    ap.add_argument("--output", default=None, help="write the table as JSON here")
    args = ap.parse_args()

    defaults = {"pooling": "avg", "normalize": True, "query_prefix": "", "passage_prefix": "",
                "query_max_length": 32, "passage_max_length": 128}
    enc, tok, s, _ = load_biencoder(args.biencoder, defaults)  # (the defaults as flags: what this curve measured)
    sets = {}
    for b in args.beir:
        beir = load_beir(b)
        run = retrieve(enc, tok, s, beir, k=100)
        sets[b] = (beir, run, retrieval_metrics(run, beir[3]))
        print(f"{b}: bi-encoder nDCG@10 {sets[b][2]['ndcg@10']:.4f}", flush=True)
    del enc

    final = os.path.join(args.run, "final")
    model, rtok, settings = load_exported_reranker(final)
    if args.compute_dtype == "bf16":
        precision.autocast_forward(model, "cpu", torch.bfloat16)
    layout = rerank_layout(rtok, settings)
    steps = sorted(glob.glob(os.path.join(args.run, "step_*")))
    if args.steps is not None:
        steps = [d for d in steps if int(d.rsplit("_", 1)[1]) in args.steps]
    steps = ([args.zero_shot] if args.zero_shot else []) + steps + ([final] if args.final else [])
    name = {args.zero_shot: "zero-shot", final: "final"}
    col = lambda b, k, w: f"{os.path.basename(b)}@{k}" + (f",w={w:g}" if w < 1 else "")  # noqa: E731
    rows = [{"step": "bi-encoder", **{col(b, k, w): m["ndcg@10"] for b, (_, _, m) in sets.items()
                                      for k in args.top_k for w in args.weights}}]
    kmax = max(args.top_k)
    for d in steps:
        if d == args.zero_shot or d == final:
            missing, unexpected = model.model.load_state_dict(load_weights(d), strict=False)
            tied = {"lm_head.weight"} if model.model.config.tie_word_embeddings else set()
            if unexpected or set(missing) - tied:
                raise SystemExit(f"{d}: weights do not fit final/'s model (missing {missing}, unexpected {unexpected})")
        else:
            ckpt.load_model_weights(model.model, d)
        row, t0 = {"step": name.get(d) or int(d.rsplit("_", 1)[1])}, time.perf_counter()
        for b, (beir, run, _) in sets.items():
            ids, texts, queries, qrels = beir
            text_of = dict(zip(ids, texts))
            heads = {qid: rank_docs(run[qid])[:kmax] for qid in sorted(run)}
            flat = score_pairs(model, rtok, [queries[q] for q, h in heads.items() for _ in h],
                               [text_of[x] for h in heads.values() for x in h], settings, args.batch_size,
                               layout=layout).split([len(h) for h in heads.values()])
            scored = {qid: (head, sc) for (qid, head), sc in zip(heads.items(), flat)}
            for k in args.top_k:
                for w in args.weights:
                    run2 = {}
                    for qid, (head, sc) in scored.items():
                        bi = torch.tensor([run[qid][x] for x in head[:k]])
                        run2[qid] = reorder(rank_docs(run[qid]), fuse_scores(sc[:k], bi, w))
                    row[col(b, k, w)] = retrieval_metrics(run2, qrels)["ndcg@10"]
        row["score_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    keys = [k for k in rows[0] if k != "step"]
    print("\nnDCG@10 (set@top-k reranked)")
    print(f"{'step':>12}" + "".join(f"{k:>14}" for k in keys))
    for r in rows:
        print(f"{str(r['step']):>12}" + "".join(f"{r[k]:14.4f}" for k in keys))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()

"""Hard-negative mining from embeddings, with a false-negative filter.

For each query, candidates are ranked by score; the query's positives are removed, then
  - the first `skip_top` remaining candidates are skipped (they are often unlabelled positives),
  - candidates scoring above `max_score_ratio` x the best positive's score are dropped
    (likely false negatives; None turns this off), and so are exact text duplicates of a positive,
and up to `k` of the rest are kept, best first.
"""


import torch

from .search import sharded_topk


def by_score_then_id(scores, idx):
    """Each row's candidates best first, equal scores by ascending passage index: the same order
    however the candidates were found (one search, or shards merged)."""
    order = idx.argsort(dim=1)
    scores, idx = scores.gather(1, order), idx.gather(1, order)
    order = scores.argsort(dim=1, descending=True, stable=True)
    return scores.gather(1, order), idx.gather(1, order)


def filter_candidates(top_scores, top_idx, positives, best_positive, k, skip_top=0, max_score_ratio=0.95,
                      p_texts=None):
    """The window and the false-negative filter (module docstring) over each query's ranked candidates
    (top_scores / top_idx: (Q, depth), best first); best_positive[i]: the best score of query i's
    positives. Returns a list (one per query) of up to k passage indices."""
    out = []
    for row, (row_scores, row_idx) in enumerate(zip(top_scores.tolist(), top_idx.tolist())):
        pos = set(positives[row])
        pos_texts = {p_texts[j] for j in pos} if p_texts is not None else set()
        limit = float("inf") if max_score_ratio is None else max_score_ratio * float(best_positive[row])
        negs, seen = [], 0
        for score, j in zip(row_scores, row_idx):
            if j in pos or (p_texts is not None and p_texts[j] in pos_texts):
                continue  # a positive, or its exact duplicate: not a candidate at all
            seen += 1
            if seen <= skip_top or score > limit:
                continue
            negs.append(j)
            if len(negs) == k:
                break
        out.append(negs)
    return out


def mine_hard_negatives(q_emb, p_emb, positives, k, skip_top=0, max_score_ratio=0.95,
                        p_texts=None, depth=None, chunk_size=1024):
    """Return a list (one per query) of up to k passage indices into p_emb, in one process.

    q_emb (Q, H), p_emb (P, H); positives[i] is a collection of passage indices for query i.
    Scores are computed in query chunks so the full (Q, P) matrix is never built.
    """
    depth = min(p_emb.shape[0], depth or (k + skip_top + 50))
    out = []
    for s in range(0, q_emb.shape[0], chunk_size):
        scores = q_emb[s:s + chunk_size] @ p_emb.T  # (C, P)
        top = by_score_then_id(*scores.topk(depth, dim=1))
        best = [max(scores[row, j].item() for j in positives[s + row]) for row in range(scores.shape[0])]
        out += filter_candidates(*top, positives[s:s + chunk_size], best, k, skip_top, max_score_ratio, p_texts)
    return out


def mine_sharded(q_own, q_offset, p_shard, offset, n_total, positives, k, skip_top=0, max_score_ratio=0.95,
                 p_texts=None, depth=None, block=4096, device="cpu"):
    """mine_hard_negatives with queries and corpus both split over the ranks, as evaluation searches:
    each rank holds only its shard of the query embeddings (`q_own`, rows q_offset.. of all queries)
    and of the passage embeddings (`p_shard`, rows offset.. of the n_total passages; both from
    encode.encode_shard). In rounds, every rank's next `block` queries are all-gathered, each rank
    searches its passage shard for all of them, and only each shard's top `depth` are gathered and
    merged (search.sharded_topk); a query's best positive score is the maximum over the shards that
    hold its positives. `positives`: every query's passage indices. Returns the negatives of this
    rank's queries (a list each): the same as one process with everything, in the same order (ties
    by passage index). Embeddings held per rank: its two shards and one round's queries."""
    import torch.distributed as tdist

    from .dist import rank as get_rank, world_size

    world, me = world_size(), get_rank()
    depth = min(n_total, depth or (k + skip_top + 50))
    shape = torch.tensor([q_own.shape[0], q_own.shape[1] if q_own.numel() else 0], device=device)
    if world > 1:
        tdist.all_reduce(shape, op=tdist.ReduceOp.MAX)
    most, dim = (int(x) for x in shape)
    out = []
    for start in range(0, most, block):
        q = q_own[start:start + block]
        sizes, firsts = [q.shape[0]], [q_offset + start]
        if world > 1:
            meta = [torch.empty(2, dtype=torch.long, device=device) for _ in range(world)]
            tdist.all_gather(meta, torch.tensor([q.shape[0], q_offset + start], device=device))
            sizes, firsts = [int(m[0]) for m in meta], [int(m[1]) for m in meta]
            padded = torch.zeros(block, dim, device=device)
            padded[:q.shape[0]] = q.to(device)
            parts = [torch.empty_like(padded) for _ in range(world)]
            tdist.all_gather(parts, padded)
            q = torch.cat([part[:n] for part, n in zip(parts, sizes)]).cpu()
        ids = [i for first, n in zip(firsts, sizes) for i in range(first, first + n)]
        held = [(row, j - offset) for row, i in enumerate(ids) for j in positives[i]
                if offset <= j < offset + p_shard.shape[0]]  # positives in this rank's shard
        rows = torch.tensor([r for r, _ in held], dtype=torch.long)
        cols = torch.tensor([c for _, c in held], dtype=torch.long)
        best = torch.full((len(ids),), float("-inf"))
        best.scatter_reduce_(0, rows, (q[rows] * p_shard[cols]).sum(-1), reduce="amax")
        if world > 1:
            best = best.to(device)
            tdist.all_reduce(best, op=tdist.ReduceOp.MAX)
            best = best.cpu()
        top = by_score_then_id(*sharded_topk(q, p_shard, offset, depth, n_total, device))
        a = sum(sizes[:me])
        b = a + sizes[me]
        out += filter_candidates(top[0][a:b], top[1][a:b], [positives[i] for i in ids[a:b]], best[a:b], k, skip_top,
                                 max_score_ratio, p_texts)
    return out


def main(argv=None):
    """Mine hard negatives for training JSONL (query + positives) from a corpus; write training JSONL.

        python -m retrieval_kit.mine --input queries.jsonl --corpus corpus.jsonl --out train.jsonl \\
            --model runs/biencoder/final --k 7 --skip-top 0 --max-score-ratio 0.95

    --input: JSONL with `query` and `pos_doc` (the training format; existing `neg_doc` is replaced).
    --corpus: BEIR corpus.jsonl of candidates (default: the positives of --input themselves).
    """
    import argparse
    import json
    import os

    from . import dist, flags
    from .records import read_records
    from .encode import encode_shard
    from . import cli
    from .evaluate import biencoder_settings
    from .formats import read_corpus
    from .models import default_model_dir, load_encoder, load_tokenizer, prepare_embedder

    ap = cli.KitParser(description=main.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="training JSONL (any format the scripts read) whose queries and "
                    "positives are mined for; docs may be ids into --corpus")
    ap.add_argument("--corpus", default=None, help="BEIR corpus.jsonl where doc ids in --input resolve, as in "
                    "training (a NeMo string doc is then an id); its passages are candidates")
    ap.add_argument("--candidates", default=None, help="BEIR corpus.jsonl of candidate passages besides --corpus "
                    "(ids in --input do not resolve here)")
    ap.add_argument("--out", required=True, help="training JSONL to write")
    ap.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    ap.add_argument("--model", type=flags.model_path, default=None, help="bi-encoder dir (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--k", type=flags.positive_int, default=7, help="hard negatives per query (default 7)")
    ap.add_argument("--skip-top", type=flags.nonneg_int, default=0, help="skip this many top-ranked non-positives (default 0)")
    ap.add_argument("--max-score-ratio", type=flags.fraction, default=0.95,
                    help="drop candidates scoring above this fraction of the positive's score, between 0 and 1 "
                         "(default 0.95; 0 turns the filter off)")
    ap.add_argument("--depth", type=flags.positive_int, default=200, help="candidates considered per query (default 200)")
    ap.add_argument("--batch-size", type=flags.positive_int, default=64, help="texts per encoding batch")
    ap.add_argument("--query-block", type=flags.positive_int, default=4096,
                    help="queries each rank sends to the search per round (default 4096): the embeddings a rank "
                         "holds are its shard of the queries and passages plus ranks x this many queries")
    ap.add_argument("--data-cache", default="auto", metavar="auto|off|DIR",
                    help="where the parsed --input, --corpus and --candidates are kept and mapped, as in training "
                         "(default auto: beside each file of 16 MiB and more)")
    cli.add_biencoder_setting_args(ap)
    args = ap.parse_args(argv)
    same = [f for f, p in (("--input", args.input), ("--corpus", args.corpus), ("--candidates", args.candidates))
            if p and os.path.exists(p)
            and os.path.exists(args.out) and os.path.samefile(p, args.out)]
    if same:
        ap.error(f"--out {args.out} is the {same[0]} file: write the mined records to another file")
    if os.path.exists(args.out) and not args.overwrite:
        ap.error(f"--out {args.out} exists: pass --overwrite to replace it")
    flags.check_writable_file("--out", args.out)  # before any encoding

    ctx = dist.init()
    corpus = read_corpus(args.corpus, args.data_cache) if args.corpus else None  # docs by id in --input resolve here
    records, _ = read_records(args.input, corpus=corpus, cache=args.data_cache)
    dist.print0(records.summary)
    pool = [c for c in (corpus, read_corpus(args.candidates, args.data_cache) if args.candidates else None)
            if c is not None]
    texts = [c.texts[i] for c in pool for i in range(len(c))]
    index = {t: i for i, t in enumerate(texts)}
    for r in records:  # positives join the candidate pool, so they can be recognised and skipped
        for p in r.pos:
            if p not in index:
                index[p] = len(texts)
                texts.append(p)
    model_dir = args.model or default_model_dir()
    s = biencoder_settings(model_dir, vars(args))
    tok = load_tokenizer(model_dir)
    enc = load_encoder(model_dir).to(ctx.device)
    prepare_embedder(tok, enc, s)  # a decoder: pad token, left padding, EOS for last pooling
    p_shard, offset = encode_shard(enc, tok, texts, s["passage_max_length"], s["passage_prefix"], args.batch_size,
                                   s["pooling"], s["normalize"], ctx.device, ctx.is_main, "corpus")  # its shard only
    q_own, q_offset = encode_shard(enc, tok, [r.query for r in records], s["query_max_length"], s["query_prefix"],
                                   args.batch_size, s["pooling"], s["normalize"], ctx.device, ctx.is_main, "queries")
    dist.print0(f"candidates: {len(texts):,} passages, each rank encoding and searching its shard of at most "
                f"{-(-len(texts) // ctx.world_size):,} for its shard of the {len(records):,} queries "
                f"({ctx.world_size} rank{'s' if ctx.world_size > 1 else ''})")
    negs = mine_sharded(q_own, q_offset, p_shard, offset, len(texts), [[index[p] for p in r.pos] for r in records],
                        args.k, args.skip_top, args.max_score_ratio if args.max_score_ratio > 0 else None, texts,
                        args.depth, args.query_block, ctx.device)
    if ctx.world_size > 1:  # rank 0 writes every rank's queries' negatives, in query order
        parts = [None] * ctx.world_size
        torch.distributed.all_gather_object(parts, negs)
        negs = [n for part in parts for n in part]
    if ctx.is_main:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        kept = [(r, n) for r, n in zip(records, negs) if n]  # a query with no negative left teaches nothing
        with flags.writing(args.out, then="nothing was written there (the mining must run again)"), \
                open(args.out + ".tmp", "w", encoding="utf-8") as f:  # complete, or not there
            for r, n in kept:
                f.write(json.dumps({"query": r.query, "pos_doc": list(r.pos), "neg_doc": [texts[j] for j in n]},
                                   ensure_ascii=False) + "\n")
        os.replace(args.out + ".tmp", args.out)
        short = sum(len(n) < args.k for _, n in kept)
        print(f"wrote {len(kept)} records to {args.out} ({short} with fewer than {args.k} negatives; "
              f"{len(records) - len(kept)} left out: no candidate passed the filters)")
    dist.cleanup()


if __name__ == "__main__":
    from retrieval_kit.formats import exit_on_data_error

    exit_on_data_error(main)

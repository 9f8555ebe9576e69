"""Hard-negative mining from embeddings, with a false-negative filter.

For each query, candidates are ranked by score; the query's positives are removed, then
  - the first `skip_top` remaining candidates are skipped (they are often unlabelled positives),
  - candidates scoring above `max_score_ratio` x the best positive's score are dropped
    (likely false negatives; None turns this off), and so are exact text duplicates of a positive,
and up to `k` of the rest are kept, best first.
"""


import numpy as np
import torch

from . import heads
from .search import sharded_topk
from .textstore import DigestIndex, digest


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


def mine_sharded(q_own, q_ids, p_shard, p_ids, n_total, positives, k, skip_top=0, max_score_ratio=0.95,
                 p_texts=None, depth=None, block=4096, device="cpu", on_round=None, head=heads.default()):
    """mine_hard_negatives with queries and corpus both split over the ranks, as evaluation searches:
    each rank holds only its share of the query embeddings (`q_own`, the queries numbered `q_ids`)
    and of the passage embeddings (`p_shard`, the passages numbered `p_ids` of the n_total; both
    from encode.encode_blocks or encode_shard). In rounds, every rank's next `block` queries are
    all-gathered, each rank searches its passages for all of them, and only each rank's top `depth`
    are gathered and merged (search.sharded_topk); a query's best positive score is the maximum over
    the ranks that hold its positives. `positives`: every query's passage indices. Returns the
    negatives of this rank's queries (a list each, in q_ids order): the same as one process with
    everything, in the same order (ties by passage index). Embeddings held per rank: its two shares
    and one round's queries. `on_round(query numbers, their negatives)`, when given, is called on every
    rank after each round with that round's results for this rank's queries (main() saves them, so a
    killed run searches only what is left). `head`: the model's (heads/): how its stored rows are
    scored (pair_scores) and searched (search)."""
    import torch.distributed as tdist

    from .dist import rank as get_rank, world_size

    world, me = world_size(), get_rank()
    depth = min(n_total, depth or (k + skip_top + 50))
    local = torch.full((n_total,), -1, dtype=torch.long)  # passage index -> its row here (-1: another rank's)
    local[p_ids] = torch.arange(len(p_ids))
    shape = torch.zeros(4, dtype=torch.long, device=device)  # queries here, then a row's shape
    if q_own.numel():
        shape[:q_own.dim()] = torch.tensor(q_own.shape)
    if world > 1:
        tdist.all_reduce(shape, op=tdist.ReduceOp.MAX)
    most, row_shape = int(shape[0]), [int(x) for x in shape[1:] if x]
    out = []
    for start in range(0, most, block):  # (this rank's rows of the round; a rank may have fewer queries than `start`)
        q = head.as_dense(head.select(q_own, torch.arange(start, max(start, min(start + block, q_own.shape[0])))))
        ids = q_ids[start:start + block]
        sizes = [q.shape[0]]
        if world > 1:
            padded = torch.zeros(block, *row_shape, device=device)
            if q.shape[0]:  # (a rank without queries holds a (0, 0) tensor)
                padded[:q.shape[0]] = q.to(device)
            numbers = torch.full((block,), -1, dtype=torch.long, device=device)  # -1: no query in that row
            numbers[:q.shape[0]] = ids.to(device)
            parts = [torch.empty_like(padded) for _ in range(world)]
            tdist.all_gather(parts, padded)
            all_ids = [torch.empty_like(numbers) for _ in range(world)]
            tdist.all_gather(all_ids, numbers)
            sizes = [int((n >= 0).sum()) for n in all_ids]
            q = torch.cat([part[:n] for part, n in zip(parts, sizes)]).cpu()
            ids = torch.cat([n[:size] for n, size in zip(all_ids, sizes)]).cpu()
        flat = [(row, j) for row, i in enumerate(ids.tolist()) for j in positives[i]]
        rows = torch.tensor([r for r, _ in flat], dtype=torch.long)
        cols = local[torch.tensor([j for _, j in flat], dtype=torch.long)]
        here = cols >= 0  # positives held by this rank
        best = torch.full((len(ids),), float("-inf"))
        if here.any():
            pair = head.pair_scores(q[rows[here]], head.as_dense(head.select(p_shard, cols[here])))
            best.scatter_reduce_(0, rows[here], pair, reduce="amax")
        if world > 1:
            best = best.to(device)
            tdist.all_reduce(best, op=tdist.ReduceOp.MAX)
            best = best.cpu()
        top = by_score_then_id(*sharded_topk(q, p_shard, p_ids, depth, n_total, device, search=head.search))
        a = sum(sizes[:me])
        b = a + sizes[me]
        negs = filter_candidates(top[0][a:b], top[1][a:b], [positives[i] for i in ids[a:b].tolist()], best[a:b], k,
                                 skip_top, max_score_ratio, p_texts)
        if on_round is not None and negs:
            on_round(ids[a:b].tolist(), negs)
        out += negs
    return out


class CandidatePool:
    """The candidate passages of `mine`: the documents of the corpora (textstore stores: mapped from
    a data cache, the pages shared by the ranks), read only when asked, then the texts `positions`
    added (positives no corpus holds). No Python string per passage: `pool[j]` reads text j. `keys`:
    a 16-byte digest per text (equal texts, equal keys: the duplicate filter compares these)."""

    def __init__(self, corpora):
        self._stores = [(c.texts, len(c)) for c in corpora]
        self._n = sum(n for _, n in self._stores)
        self._extra, self._extra_at, self._extra_keys = [], {}, bytearray()
        keys = b"".join(digest(store[i]) for store, n in self._stores for i in range(n))
        self._index, self.keys = DigestIndex(keys), np.frombuffer(keys, dtype="S16")

    def __len__(self):
        return self._n + len(self._extra)

    def __getitem__(self, j):
        for store, n in self._stores:
            if j < n:
                return store[j]
            j -= n
        return self._extra[j]

    def positions(self, texts):
        """Each text's position: its last among the corpora's documents, else where it was added
        (a text found nowhere is added at the end, once)."""
        found = self._index.find(b"".join(digest(t) for t in texts), last=True).tolist()
        for i, (t, j) in enumerate(zip(texts, found)):
            if j < 0:
                if t not in self._extra_at:
                    self._extra_at[t] = len(self)
                    self._extra.append(t)
                    self._extra_keys += digest(t)
                found[i] = self._extra_at[t]
        if self._extra_keys:
            self.keys = np.concatenate([self.keys[:self._n], np.frombuffer(bytes(self._extra_keys), dtype="S16")])
        return found


def saved_negatives(parts):
    """{query number: negatives} of the search rounds an earlier run of the same command saved in
    OUT.parts (a file whose checksum does not match is ignored: its queries are searched again)."""
    import json
    import os

    from .encode import block_done

    done = {}
    for name in sorted(os.listdir(parts)) if os.path.isdir(parts) else []:
        path = os.path.join(parts, name)
        if name.startswith("negatives_") and name.endswith(".json") and block_done(path):
            with open(path, encoding="utf-8") as f:
                got = json.load(f)
            done.update(zip(got["queries"], got["negatives"]))
    return done


def save_negatives(parts, query_numbers, negatives):
    """One search round's results for one rank's queries, written whole into OUT.parts (encode.save_block)."""
    import json
    import os

    from .encode import save_block, write_text

    save_block(os.path.join(parts, f"negatives_{query_numbers[0]:09d}.json"),
               lambda tmp: write_text(tmp, json.dumps({"queries": query_numbers, "negatives": negatives})))


def main(argv=None):
    """Mine hard negatives for training JSONL (query + positives) from a corpus; write training JSONL.

        python -m retrieval_kit.mine --input queries.jsonl --corpus corpus.jsonl --out train.jsonl \\
            --model runs/biencoder/final --k 7 --skip-top 0 --max-score-ratio 0.95

    --input: JSONL with `query` and `pos_doc` (the training format; existing `neg_doc` is replaced).
    --corpus: BEIR corpus.jsonl of candidates (default: the positives of --input themselves).

    Under torchrun each rank encodes its blocks of the passages and of the queries (--block-size
    texts; block b on rank b % world) and searches its passages for every rank's queries. Each block's
    embeddings, and each search round's negatives, are saved in OUT.parts when done: a run killed and
    started again with the same command, on any number of ranks, encodes only the blocks not yet saved
    and searches only for the queries not yet mined (another input, model or settings is refused,
    naming what differs). OUT.parts is removed once OUT is written. The candidate texts are read from
    the corpora's stores (mapped from the data cache, shared by the ranks), not held as strings.
    """
    import argparse
    import functools
    import json
    import os
    import shutil

    from . import dist, flags, outputs, precision
    from .records import read_records
    from .encode import encode_blocks, warn_empty
    from .score import MANIFEST, check_parts, model_digest
    from . import cli
    from .evaluate import load_biencoder
    from .formats import file_digest, read_corpus
    from .models import default_model_dir

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
    ap.add_argument("--block-size", type=flags.positive_int, default=8192,
                    help="texts per encoding block: the unit of sharding over ranks and of resuming; each block's "
                         "embeddings are saved in OUT.parts as soon as they are done, and a run killed and started "
                         "again with the same command (on any number of ranks) skips them (default 8192)")
    ap.add_argument("--query-block", type=flags.positive_int, default=4096,
                    help="queries each rank sends to the search per round (default 4096): the embeddings a rank "
                         "holds are its shard of the queries and passages plus ranks x this many queries")
    precision.add_inference_dtype(ap)
    ap.add_argument("--data-cache", default="auto", metavar="auto|off|DIR",
                    help="where the parsed --input, --corpus and --candidates are kept and mapped, as in training "
                         "(default auto: beside each file of 16 MiB and more)")
    cli.add_biencoder_setting_args(ap)
    args = ap.parse_args(argv)
    outputs.check_file("--out", args.out, [("--input", args.input), ("--corpus", args.corpus),  # before any encoding
                                           ("--candidates", args.candidates), ("--model", args.model)], args.overwrite)
    outputs.check_parts("--out", args.out + ".parts", MANIFEST)

    ctx = dist.init()
    corpus = read_corpus(args.corpus, args.data_cache) if args.corpus else None  # docs by id in --input resolve here
    records, _ = read_records(args.input, corpus=corpus, cache=args.data_cache)
    dist.print0(records.summary)
    cand = read_corpus(args.candidates, args.data_cache) if args.candidates else None
    texts = CandidatePool([c for c in (corpus, cand) if c is not None])
    n_pos = [len(r.pos) for r in records]  # positives join the candidate pool, so they can be recognised and skipped
    flat = iter(texts.positions([p for r in records for p in r.pos]))
    positives = [[next(flat) for _ in range(n)] for n in n_pos]
    model_dir = args.model or default_model_dir()
    enc, tok, s, head = load_biencoder(model_dir, vars(args), device=ctx.device,
                                       compute_dtype=precision.parse_dtype(args.compute_dtype))
    cli.head_flags(args, head.NAME, f"{model_dir} (the model's)")
    parts = args.out + ".parts"
    manifest = {"input": os.path.abspath(args.input), "input_digest": records.digest or file_digest(args.input),
                **{f"{k}_digest": c.digest or file_digest(c.path) for k, c in (("corpus", corpus), ("candidates", cand))
                   if c is not None}, "model": os.path.abspath(model_dir), "model_digest": model_digest(model_dir),
                "settings": {k: s[k] for k in sorted(s)}, "passages": len(texts), "queries": len(records),
                "block_size": args.block_size, "batch_size": args.batch_size,  # the batch changes the padding
                **({"compute_dtype": args.compute_dtype} if args.compute_dtype != "none" else {}),
                "search": {"k": args.k, "skip_top": args.skip_top, "max_score_ratio": args.max_score_ratio,
                           "depth": args.depth}}  # the saved rounds' negatives depend on these
    manifest = json.loads(json.dumps(manifest))  # as it reads back
    if ctx.is_main:
        check_parts(parts, manifest)
    dist.barrier()
    with flags.writing(args.out, then=f"the blocks encoded so far are kept in {parts}: free space, then run the "
                                      "same command again"):
        sides = head.sides(tok, s)  # multi-vector: query expansion, the passages' skiplist
        p_shard, p_ids = encode_blocks(enc, tok, texts, s["passage_max_length"], s["passage_prefix"], args.batch_size,
                                       ctx.device, parts, "passages", args.block_size, ctx.is_main, sides["p"], head, "p")
        q_own, q_ids = encode_blocks(enc, tok, [r.query for r in records], s["query_max_length"], s["query_prefix"],
                                     args.batch_size, ctx.device, parts, "queries", args.block_size, ctx.is_main,
                                     sides["q"], head, "q")
    warn_empty(head, p_shard, "passages")  # (this rank's blocks; a sparse model's empty vectors)
    warn_empty(head, q_own, "queries")
    dist.print0(f"candidates: {len(texts):,} passages, each rank encoding and searching its blocks of them for "
                f"its blocks of the {len(records):,} queries ({ctx.world_size} rank{'s' if ctx.world_size > 1 else ''}"
                f"; blocks of {args.block_size:,} in {parts}, kept until the file is written)")
    done = saved_negatives(parts)  # every rank, before any rank saves a round
    dist.barrier()
    if done:
        dist.print0(f"the negatives of {len(done):,} of the {len(records):,} queries were saved in {parts} by an "
                    "earlier run: searching for the rest")
        left = torch.tensor([i not in done for i in q_ids.tolist()], dtype=torch.bool)
        q_own, q_ids = head.select(q_own, left.nonzero().view(-1)), q_ids[left]
    with flags.writing(args.out, then=f"the blocks encoded and the rounds searched so far are kept in {parts}: free "
                                      "space, then run the same command again"):
        negs = mine_sharded(q_own, q_ids, p_shard, p_ids, len(texts), positives, args.k, args.skip_top,
                            args.max_score_ratio if args.max_score_ratio > 0 else None, texts.keys, args.depth,
                            args.query_block, ctx.device, functools.partial(save_negatives, parts), head)
    negs = list(zip(q_ids.tolist(), negs)) + (list(done.items()) if ctx.is_main else [])
    if ctx.world_size > 1:  # rank 0 writes every rank's queries' negatives, in query order
        got = [None] * ctx.world_size
        torch.distributed.all_gather_object(got, negs)
        negs = [pair for part in got for pair in part]
    negs = [n for _, n in sorted(negs)]
    if ctx.is_main:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        kept = [(r, n) for r, n in zip(records, negs) if n]  # a query with no negative left teaches nothing
        with flags.writing(args.out, then="nothing was written there (the mining must run again)"), \
                open(args.out + ".tmp", "w", encoding="utf-8") as f:  # complete, or not there
            for r, n in kept:
                f.write(json.dumps({"query": r.query, "pos_doc": list(r.pos), "neg_doc": [texts[j] for j in n]},
                                   ensure_ascii=False) + "\n")
        os.replace(args.out + ".tmp", args.out)
        shutil.rmtree(parts)
        short = sum(len(n) < args.k for _, n in kept)
        print(f"wrote {len(kept)} records to {args.out} ({short} with fewer than {args.k} negatives; "
              f"{len(records) - len(kept)} left out: no candidate passed the filters)")
    dist.cleanup()


if __name__ == "__main__":
    from retrieval_kit.rundir import exit_on_data_error

    exit_on_data_error(main)

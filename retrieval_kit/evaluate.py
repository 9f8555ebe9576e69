"""Full-corpus retrieval evaluation on a BEIR-layout set, optionally with a reranking stage.

    python -m retrieval_kit.evaluate --model runs/biencoder/final --beir data/eval
    python -m retrieval_kit.evaluate --model runs/biencoder/final --beir data/eval \\
        --reranker runs/reranker/final --rerank-top-k 10
    torchrun --nproc_per_node=2 -m retrieval_kit.evaluate --model ... --beir ...   # corpus split over ranks

The corpus is encoded sorted by length in batches; under torchrun each rank encodes and searches
its own shard on its device and the per-shard top k are merged. Search is exact (inner product)
in chunks, so the full query x corpus score matrix is never built. Metrics
follow trec_eval: nDCG@10, MRR@10, Recall@10, Recall@100, MAP@100, graded qrels honoured.
Model dirs exported by the scripts bring their pooling, normalization, prefixes, max lengths and
reranker tokenization (retrieval_kit.json); a plain HF dir gets the flags' values.
"""

import argparse
import json
import os

import torch

from . import choice, cli, dist, flags, heads, outputs, precision
from .data import shard
from .formats import read_corpus, read_qrels, read_queries
from .encode import encode_shard, encode_sharded, score_pairs
from .export import load_exported_reranker
from .metrics import rank_docs, retrieval_metrics
from .models import default_model_dir, load_tokenizer, prepare_embedder
from .search import sharded_topk


def _beir_file(path):
    """path, or path.gz when only the compressed file is there."""
    return path + ".gz" if not os.path.exists(path) and os.path.exists(path + ".gz") else path


def load_beir(beir_dir, split="test"):
    """(corpus_ids, corpus_texts, queries {qid: text}, qrels {qid: {doc id: rel}}) of a BEIR folder
    (each file plain or .gz), validated (formats.read_corpus / read_queries / read_qrels). A doc's
    text is its title and text joined by a space, as BEIR's dense baselines do."""
    corpus = read_corpus(_beir_file(os.path.join(beir_dir, "corpus.jsonl")))
    ids, texts = [corpus.ids[i] for i in range(len(corpus))], [corpus.texts[i] for i in range(len(corpus))]
    queries = read_queries(_beir_file(os.path.join(beir_dir, "queries.jsonl")))
    qrels_path = _beir_file(os.path.join(beir_dir, "qrels", f"{split}.tsv"))
    qrels = read_qrels(qrels_path, queries)
    known = set(ids)
    judged = [d for docs in qrels.values() for d in docs]
    unknown = sum(d not in known for d in judged)
    if unknown == len(judged):  # every metric would be 0, and no search could change it
        raise SystemExit(f"{qrels_path}: none of its {len(judged)} judged documents is in {beir_dir}'s corpus.jsonl "
                         "(the qrels of another corpus?)")
    if unknown:  # (as BEIR's own evaluation, they stay relevant documents no search can find)
        dist.print0(f"warning: {qrels_path}: {unknown} of its {len(judged)} judgments name documents that are not in "
                    "the corpus: they count as relevant documents no search can find (recall and nDCG stay below 1)")
    return ids, texts, queries, qrels


def load_biencoder(model_dir, flags=None, dtype=torch.float32, trust_remote_code=False, device="cpu",
                   compute_dtype=None):
    """(model, tokenizer, settings, head) of a bi-encoder dir (an export, a sentence-transformers dir of
    any kind the kit reads, a plain model) ready for inference on `device`: its head's module
    (head.embedder: `model(q=batch)` / `model(p=batch)`), in eval mode, the forward under autocast to
    `compute_dtype` (None: none); its settings as heads.biencoder_settings resolves them from `flags`."""
    spec = heads.read_spec(model_dir)
    head, settings = heads.choose(spec, flags or {})
    tokenizer = load_tokenizer(spec.model_path, trust_remote_code, spec.prepare_tokenizer)
    model = head.load(model_dir, dtype, spec=spec, trust_remote_code=trust_remote_code).to(device)
    precision.autocast_forward(model, torch.device(device).type, compute_dtype)
    prepare(tokenizer, model, dict(settings), head)  # a decoder: pad token, left padding, EOS for last pooling
    return head.embedder(model, settings).eval(), tokenizer, settings, head


def load_guide(model_dir, tokenizer, dtype=torch.float32, trust_remote_code=False, device="cpu", compute_dtype=None,
               flag="--guide-model", like=None):
    """--guide-model, --teacher-model: (the frozen model's embedder, its head) of a bi-encoder dir
    (load_biencoder), which reads the trained model's token ids: one of another vocabulary than
    `tokenizer`, or (`like`: the trained model's (head, embedding size)) of another kind or size, is one
    sentence naming `flag`. None for no dir."""
    if model_dir is None:
        return None
    model, guide_tokenizer, _, head = load_biencoder(model_dir, None, dtype, trust_remote_code, device, compute_dtype)
    if guide_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise SystemExit(f"{flag} {model_dir}: its tokenizer's vocabulary ({len(guide_tokenizer)} entries) is "
                         f"not the trained model's ({len(tokenizer)}), and it reads the batch's token ids: give "
                         "a model of the same tokenizer (e.g. the base model)")
    size = head.embedding_size(model.encoder)
    if like is not None and (head is not like[0] or size != like[1]):
        project = head is like[0] and "dense_dim" in head.FLAGS  # (a Dense to its size can be trained)
        raise SystemExit(f"{flag} {model_dir}: a {head.NAME} model of {size} dimensions, the trained one a "
                         f"{like[0].NAME} of {like[1]}: its embeddings are not the model's to regress; " +
                         (f"pass --dense-dim {size} (a Dense projection to its size, trained with the model and "
                          "exported), or give a teacher of the same size" if project else
                          "give a teacher of the same kind and size"))
    for p in model.parameters():
        p.requires_grad_(False)
    return model, head


def prepare(tokenizer, model, settings, head, append_eos=None, bidirectional=False, multiple=None):
    """A bi-encoder's tokenizer and model made ready for their architecture (models.prepare_embedder: a
    decoder pads left, appends EOS; the lengths checked) and for the head (head.prepare: multi-vector's
    whole-token markers); what was done goes into `settings`, which is returned."""
    settings.update(prepare_embedder(tokenizer, model, settings, append_eos, bidirectional, multiple))
    settings.update(head.prepare(tokenizer, model, settings))
    return settings


def retrieve(model, tokenizer, settings, beir, k=100, batch_size=64, device="cpu", progress=False):
    """Bi-encoder stage: {qid: {doc id: score}} with each judged query's top k docs. Under torchrun
    each rank encodes and searches its own shard of the corpus on its device and the per-shard
    top k are merged (search.sharded_topk): no rank gathers the whole corpus's embeddings."""
    return retrieve_dims(model, tokenizer, settings, beir, [None], k, batch_size, device, progress)[None]


def retrieve_dims(model, tokenizer, settings, beir, dims, k=100, batch_size=64, device="cpu", progress=False,
                  stats=None):
    """retrieve for each embedding size in `dims` (None = the whole embedding; d = its first d
    dimensions, re-normalized when the model normalizes: Matryoshka, one-vector heads), the texts
    embedded once: {d: run}. `model`: the head's module (head.embedder); the corpus is kept as the head
    stores it and searched by its search (inner product, MaxSim, an inverted index). What the head
    reports of the corpus (sparse: active dimensions, index size) goes into `stats` (a dict) when given."""
    import torch.nn.functional as F

    ids, texts, queries, qrels = beir
    qids = [q for q in queries if q in qrels]
    head = heads.get(settings.get("head", heads.EMBEDDING[0]))
    sides = head.sides(tokenizer, settings)  # multi-vector: query expansion, the passages' skiplist
    p_own, offset = encode_shard(model, tokenizer, texts, settings["passage_max_length"], settings["passage_prefix"],
                                 batch_size, device, progress, "corpus", sides["p"], head, "p")
    q_emb = encode_sharded(model, tokenizer, [queries[q] for q in qids], settings["query_max_length"],
                           settings["query_prefix"], batch_size, device, progress, "queries", sides["q"], head, "q")
    if stats is not None:
        stats.update(head.corpus_stats(q_emb, p_own))
    runs = {}
    for d in dims:
        q, p = (q_emb, p_own) if d is None else (q_emb[:, :d], p_own[:, :d])
        if d is not None and settings["normalize"]:
            q, p = F.normalize(q, dim=-1), F.normalize(p, dim=-1)
        scores, idx = sharded_topk(q, p, offset, k, len(texts), device, search=head.search)
        runs[d] = {q: {ids[j]: s for s, j in zip(scores[i].tolist(), idx[i].tolist())} for i, q in enumerate(qids)}
    return runs


def retrieval_sets(eval_beir, dev, guards):
    """{log prefix: BEIR set} a bi-encoder run validates on: beir (--eval-beir), dev (--dev-queries) and
    guard_<name> (--guard-beir: {prefix: folder})."""
    sets = {k: v for k, v in (("beir", eval_beir and load_beir(eval_beir)), ("dev", dev)) if v}
    return {**sets, **{name: load_beir(d) for name, d in guards.items()}}


EACH = "_each"  # a metric's per-query values ride in a validation's metrics as "<metric>_each" (a list)


def with_se(run, qrels, per_query=None, metric="ndcg@10"):
    """retrieval_metrics of `run`, with the bootstrap standard error of `metric` over the queries
    (`metric`_se: how far apart two models must be before this set can tell them apart); `per_query` (a
    dict) filled with each query's metrics."""
    from .metrics import bootstrap_se

    each = {} if per_query is None else per_query
    out = retrieval_metrics(run, qrels, per_query=each)
    values = [each[q][metric] for q in sorted(each)]
    out[f"{metric}_se"] = bootstrap_se(values)
    out[f"{metric}{EACH}"] = values  # (query-id order: what --select-best's paired test reads; never logged)
    return out


DEV_NEIGHBOURS = "dev_neighbours.json"  # in the run folder: the passages mined into the dev corpus at its start


def add_neighbours(dev, pool, k, mine, run_dir, fresh, by="the model at the run's start"):
    """--dev-neighbours K (issue 62): the dev corpus made harder by each held-out query's K nearest passages
    of the training pool as `mine((ids, texts, queries, qrels), k) -> run` ranks them - the passages a model
    confuses with the answer, which a random sample of a large pool rarely holds. A training run mines with
    the model at its start (the base), on a fresh start (`fresh`), and rank 0 keeps what was added in
    `run_dir`/dev_neighbours.json; a resume reads it back, so every validation of a run scores one dev set.
    Says how many were added (`by`: the model that mined them). Returns the dev set (the passages added after
    the others)."""
    import hashlib

    from .dist import broadcast_object, print0, rank

    ids, texts, queries, qrels = dev
    digest = hashlib.sha256(json.dumps(sorted(queries.items())).encode()).hexdigest()
    cache = os.path.join(run_dir or ".", DEV_NEIGHBOURS)
    if fresh:
        run = mine(([f"p{i}" for i in range(len(pool))], pool, queries, qrels), k)
        known, added = set(texts), []
        for q in sorted(run):
            for d in rank_docs(run[q])[:k]:
                if pool[int(d[1:])] not in known:
                    known.add(pool[int(d[1:])])
                    added.append(pool[int(d[1:])])
        if rank() == 0 and run_dir is not None:  # (None: a fixed model mines, the same on every start)
            from .flags import writing

            with writing(f"the dev set's mined passages to {cache}", then="free space and start the run again"):
                with open(cache + ".tmp", "w", encoding="utf-8") as f:
                    json.dump({"queries": digest, "k": k, "passages": added}, f)
                os.replace(cache + ".tmp", cache)
    else:
        added = None
        if rank() == 0:
            try:
                with open(cache, encoding="utf-8") as f:
                    saved = json.load(f)
                added = saved["passages"] if saved.get("queries") == digest and saved.get("k") == k else "other"
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                added = "missing"
        added = broadcast_object(added)
        if isinstance(added, str):
            what = "missing or unreadable" if added == "missing" else "of other dev queries or another --dev-neighbours"
            raise SystemExit(f"--dev-neighbours: {cache} is {what}: a resume scores the dev set its run started with, "
                             "mined then; start a new run (another --output-dir) for a new one" if rank() == 0 else 1)
    print0(f"dev: {len(added):,} passages added to the {len(texts):,} of its corpus: each query's {k} nearest of the "
           f"training pool by {by} (--dev-neighbours; {'mined now' if fresh else 'as mined at the run start'})")
    new = [f"d{len(texts) + i}" for i in range(len(added))]  # (hold_out_dev's ids go on)
    return ids + new, texts + added, queries, qrels


def beir_metrics(model, tokenizer, settings, beir, k=100, batch_size=64, device="cpu", dims=(), progress=False,
                 name="beir", per_query=None):
    """{log prefix: retrieval metrics}: `name` ("beir"; "dev" for --dev-queries) for the whole
    embedding, with nDCG@10's standard error (with_se), "{name}_dim{d}" for each Matryoshka size in `dims`
    below it; `progress`: encoding progress bars (rank 0); `per_query` (a dict): its `name` entry filled
    with the whole embedding's per-query metrics."""
    sizes = [None] + [d for d in dims if d is not None]
    settings = {**settings, **heads.get(settings["head"]).serving(settings)}  # queries read as the export will
    stats = {}
    runs = retrieve_dims(model, tokenizer, settings, beir, sizes, k, batch_size, device, progress, stats)
    out = {name: with_se(runs.pop(None), beir[3], None if per_query is None else per_query.setdefault(name, {}))}
    out.update({f"{name}_dim{d}": retrieval_metrics(run, beir[3]) for d, run in runs.items()})
    out[name].update(stats)  # --head sparse: active dimensions, index size
    return out


def fuse_scores(rr, bi, weight):
    """weight * z(rr) + (1 - weight) * z(bi): each stage's scores standardised over the query's
    reranked candidates, so a logit scale and a cosine scale can be mixed (weight 1 = reranker only)."""
    if weight >= 1.0:
        return rr
    z = lambda t: (t - t.mean()) / t.std().clamp_min(1e-6) if t.numel() > 1 else torch.zeros_like(t)  # noqa: E731
    return weight * z(rr.double()) + (1.0 - weight) * z(bi.double())


def reorder(ranked, head_scores):
    """{doc id: run score} with the first len(head_scores) docs of `ranked` ordered by those scores and
    the rest below them in their order (scores distinct and decreasing)."""
    k = len(head_scores)
    order = [ranked[i] for i in head_scores.argsort(descending=True).tolist()] + ranked[k:]
    return {d: float(len(order) - i) for i, d in enumerate(order)}


def score_heads(model, tokenizer, settings, heads, queries, text_of, batch_size=32, device="cpu", progress=False):
    """Cross-encoder scores of each of this rank's queries against its own head of doc ids: {qid: (k,)
    scores}, all pairs scored together (encode.score_pairs: length-sorted forwards of `batch_size`
    pairs). Every rank runs the same number of forwards, as FSDP2's collective ones need: a short
    list repeats its last pair, dropped after."""
    from .dist import world_size

    qs = [queries[q] for q, head in heads.items() for _ in head]
    ps = [text_of[d] for head in heads.values() for d in head]
    n = len(qs)
    if world_size() > 1:
        import torch.distributed as tdist

        most = torch.tensor([n], device=device)
        tdist.all_reduce(most, op=tdist.ReduceOp.MAX)
        extra = int(most) - n
        qs, ps = qs + [qs[-1] if n else ""] * extra, ps + [ps[-1] if n else ""] * extra
    scores = score_pairs(model, tokenizer, qs, ps, settings, batch_size, device, progress=progress,
                         desc="rerank")[:n].split([len(h) for h in heads.values()])
    return dict(zip(heads, scores))


def gather_runs(mine):
    """{qid: ...} of this rank's queries -> every rank's, on every rank."""
    from .dist import world_size

    if world_size() == 1:
        return mine
    import torch.distributed as tdist

    parts = [None] * world_size()
    tdist.all_gather_object(parts, mine)
    return {q: r for part in parts for q, r in part.items()}


def rerank(run, model, tokenizer, settings, beir, top_k=10, batch_size=32, device="cpu", progress=False, weight=0.5):
    """Second stage: rescore each query's top_k with a cross-encoder (fused with the bi-encoder's
    scores when weight < 1, fuse_scores); the rest keep their order below. Queries are split over
    ranks (`batch_size` pairs per forward) and the runs gathered."""
    from .dist import rank as get_rank, world_size

    ids, texts, queries, _ = beir
    ranked = {qid: rank_docs(run[qid]) for qid in shard(sorted(run), get_rank(), world_size())}
    scores = score_heads(model, tokenizer, settings, {q: r[:top_k] for q, r in ranked.items()}, queries,
                         dict(zip(ids, texts)), batch_size, device, progress)
    return gather_runs({q: reorder(r, fuse_scores(scores[q], torch.tensor([run[q][d] for d in r[:top_k]]), weight))
                        for q, r in ranked.items()})


FUSION_WEIGHTS, FUSION_TOP_K = (0.0, 0.25, 0.5, 0.75, 1.0), (5, 10, 20)


class RerankDev:
    """The reranker's dev metric is the pipeline's (--dev-queries with --dev-biencoder): the bi-encoder
    export retrieves each dev query's top max(FUSION_TOP_K) once; at each validation the reranker
    scores them, and every (fusion weight, top k) of the grid is scored from those scores. Logged:
    dev/* (the reranker alone on the top 10), dev_fused/* (weight 0.5, top 10, the evaluate defaults)
    and dev_best/* (the grid's best on ndcg@10, with its weight and top_k), each with nDCG@10's standard
    error. A weight of 0 is a legitimate best: the reranker does not pay on this data. `guards` ({log
    prefix: BEIR folder}, --guard-beir): read here, scored alike under their own prefixes; `dev` may be None
    (guards alone). `neighbours` ((the training files, K), --dev-neighbours): the dev corpus made harder by
    each query's K nearest passages of the training pool as the bi-encoder ranks them (add_neighbours; a
    fixed model: the same on every start)."""

    def __init__(self, dev, biencoder_dir, batch_size, device, guards=None, neighbours=((), 0)):
        from .dist import is_main

        guards = {k: load_beir(d) for k, d in (guards or {}).items()}  # (read and checked before any model loads)
        enc, tok, settings, _ = load_biencoder(biencoder_dir, device=device)  # (a reranker export: one sentence)
        if dev is not None and neighbours[1]:
            from .records import passage_pool

            dev = add_neighbours(dev, passage_pool(neighbours[0]), neighbours[1], lambda b, k: retrieve(
                enc, tok, settings, b, k, batch_size, device), None, True, biencoder_dir)
        progress = is_main()
        self.sets = {k: v for k, v in {"dev": dev, **guards}.items() if v is not None}
        self.k = max(FUSION_TOP_K)
        self.runs = {k: retrieve(enc, tok, settings, b, self.k, batch_size, device, progress) for k, b in self.sets.items()}
        self.best, self.batch_size = None, 32  # pairs per forward: the last metrics call's

    @torch.no_grad()
    def metrics(self, model, tokenizer, settings, batch_size=32, device="cpu", per_query=None):
        """{log prefix: metrics} of the current reranker on every set (`batch_size` pairs per forward); keeps
        the dev grid's best as `best`; `per_query` (a dict): each set's entry filled with the per-query metrics
        of the reranker alone (dev/*, guard_*/*)."""
        self.batch_size = batch_size
        out = {}
        for name in self.sets:
            grid = self._grid(name, model, tokenizer, settings, batch_size, device, per_query)
            best = self._best(grid, name == "dev")
            bare = lambda m: {k: v for k, v in m.items() if not k.endswith(EACH)}  # noqa: E731 (per-query: dev/* only)
            out.update({name: grid[1.0, 10], f"{name}_fused": bare(grid[0.5, 10]),
                        f"{name}_best": {**bare(grid[best["weight"], best["top_k"]]), **best}})
        return out

    def _best(self, grid, keep):
        (w, k), best = max(grid.items(), key=lambda kv: (kv[1]["ndcg@10"], -kv[0][0]))  # ties: the lighter weight
        if keep:
            self.best = {"weight": w, "top_k": k, "ndcg@10": best["ndcg@10"]}
        return {"weight": w, "top_k": k}

    def _grid(self, name, model, tokenizer, settings, batch_size, device, per_query, cells=None):
        """{(weight, top_k): metrics} of set `name`; `per_query`: its entry filled for the reranker alone (1.0,
        10); `cells` (a dict): filled with every cell's per-query nDCG@10, in query-id order (choose)."""
        from .dist import rank as get_rank, world_size

        (ids, texts, queries, qrels), run = self.sets[name], self.runs[name]
        heads = {q: rank_docs(run[q])[:self.k] for q in shard(sorted(run), get_rank(), world_size())}
        scores = score_heads(model, tokenizer, settings, heads, queries, dict(zip(ids, texts)), batch_size, device)
        mine = gather_runs({q: (head, scores[q]) for q, head in heads.items()})
        bi = {q: torch.tensor([run[q][d] for d in ranked]) for q, (ranked, _) in mine.items()}
        grid = {}
        for w in FUSION_WEIGHTS:
            for k in FUSION_TOP_K:
                fused = {q: reorder(ranked, fuse_scores(s[:k], bi[q][:k], w)) for q, (ranked, s) in mine.items()}
                each = per_query.setdefault(name, {}) if per_query is not None and (w, k) == (1.0, 10) else {}
                grid[w, k] = with_se(fused, qrels, each)
                if cells is not None:
                    cells[w, k] = [each[q]["ndcg@10"] for q in sorted(each)]
        return grid

    def choose(self, model, tokenizer, settings, device="cpu", guard_margin=None):
        """The fusion (weight, top_k) written into the export for the weights about to be exported, by the rule
        of choice.py over the dev grid's cells, ordered from the bi-encoder alone (weight 0) up, then by top k:
        the lightest cell that the dev queries show within choice.MARGIN of the best, else the best; with guard
        sets (--guard-beir), none whose guard nDCG@10 falls more than `guard_margin` below the bi-encoder's alone
        while another holds it. Said in one line; every cell's
        numbers recorded. None without a dev set (guards alone)."""
        from .dist import print0

        if "dev" not in self.sets:
            return None
        per = {}
        for name in self.sets:
            per[name] = {}
            grid = self._grid(name, model, tokenizer, settings, self.batch_size, device, None, per[name])
            if name == "dev":
                self._best(grid, True)
                dev_grid = grid
        order = sorted(dev_grid)  # (weight, top_k): the bi-encoder alone first
        guard = lambda cell: [v for n in sorted(per) if n != "dev" for v in per[n][cell]] or None  # noqa: E731
        chosen, rows = choice.choose([{"name": f"weight {w:g}, top {k}", "dev": per["dev"][w, k], "guard": guard((w, k))}
                               for w, k in order], guard_base=guard((0.0, order[0][1])), guard_margin=guard_margin)
        w, k = order[chosen]
        said = rows[chosen]["chosen"]
        print0(f"dev: fusion weight {w:g}, top {k} (ndcg@10 {dev_grid[w, k]['ndcg@10']:.4f} +- "
               f"{dev_grid[w, k]['ndcg@10_se']:.4f}; {said}) written into the export" +
               ("; weight 0: the reranker does not pay on this dev set" if w == 0 else ""))
        return {"weight": w, "top_k": k, "ndcg@10": dev_grid[w, k]["ndcg@10"], "ndcg@10_se": dev_grid[w, k]["ndcg@10_se"],
                "rule": choice.RULE, "why": said, "grid_best": self.best,
                "candidates": rows}


METRICS_KEYS = ("model", "reranker", "biencoder")  # what every --output file of this tool holds


def is_metrics_file(path):
    """Is `path` a metrics file evaluate wrote (its --output: JSON holding METRICS_KEYS)?"""
    return outputs.json_holds(path, METRICS_KEYS)


def main(argv=None):
    ap = cli.KitParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="bi-encoder dir (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--beir", default="data/eval", help="BEIR folder: corpus.jsonl, queries.jsonl, qrels/")
    ap.add_argument("--split", default="test", help="qrels file name under qrels/ (default test)")
    ap.add_argument("--k", type=flags.positive_int, default=100, help="docs retrieved per query (default 100)")
    ap.add_argument("--batch-size", type=flags.positive_int, default=64, help="texts per encoding batch")
    cli.add_biencoder_setting_args(ap)
    ap.add_argument("--truncate-dims", type=flags.listed(flags.positive_int), default=None,
                    help="also retrieve with the first d dimensions of the embeddings, for each d listed, e.g. "
                         "256,128,64 (re-normalized when the model normalizes; default: the dims an export trained "
                         "with --matryoshka-dims lists, else none)")
    ap.add_argument("--reranker", default=None, help="exported reranker dir for a second stage (optional)")
    ap.add_argument("--rerank-top-k", type=flags.positive_int, default=None,
                    help="docs per query the reranker rescores (default: the export's dev-chosen top k, else 10)")
    ap.add_argument("--rerank-weight", type=flags.fraction, default=None,
                    help="order the top k by w * z(reranker) + (1 - w) * z(bi-encoder), each standardised over the "
                         "query's top k; 1 = the reranker alone, 0 = the bi-encoder's order (default: the export's "
                         "dev-chosen weight, train_reranker.py --dev-biencoder, else 0.5: docs/pipeline.md)")
    ap.add_argument("--trust-remote-code", action="store_true", help="allow model code shipped in the model dirs")
    ap.add_argument("--output", default=None, help="write the metrics as JSON here")
    precision.add_inference_dtype(ap)
    args = ap.parse_args(argv)
    for flag, path in (("--beir", args.beir), ("--model", args.model), ("--reranker", args.reranker)):
        if path is not None and not os.path.isdir(path):  # before any corpus is encoded
            ap.error(f"{flag} {path}: no such folder")
    if args.output:  # never over an input, nor any file but a metrics file this tool wrote
        outputs.check_file("--output", args.output, [("--beir", args.beir), ("--model", args.model),
                                                     ("--reranker", args.reranker)], own=is_metrics_file)

    ctx = dist.init()
    beir = load_beir(args.beir, args.split)
    model_dir = args.model or default_model_dir()
    model, tok, settings, head = load_biencoder(model_dir, vars(args), torch.float32, args.trust_remote_code,
                                                ctx.device, precision.parse_dtype(args.compute_dtype))
    cli.head_flags(args, head.NAME, f"{model_dir} (the model's)")  # e.g. --pooling on a multi-vector export
    dims = args.truncate_dims if args.truncate_dims is not None else settings.get("matryoshka_dims") or []
    size = head.embedding_size(model.encoder)
    if any(d > size for d in dims):
        ap.error(f"--truncate-dims {','.join(map(str, dims))}: {model_dir} embeds in {size} dimensions; give sizes up "
                 f"to {size}")
    stats = {}
    runs = retrieve_dims(model, tok, settings, beir, [None, *dims], args.k, args.batch_size, ctx.device, ctx.is_main,
                         stats)
    run = runs.pop(None)
    results = {"biencoder": retrieval_metrics(run, beir[3])}
    if stats and ctx.is_main:  # what the head says of the corpus (sparse: active dimensions, inverted index MB)
        print(f"{head.NAME}: " + ", ".join(f"{k} {v:.1f}" for k, v in stats.items()))
        results[head.NAME] = stats
    results.update({f"biencoder@dim{d}": retrieval_metrics(r, beir[3]) for d, r in runs.items()})
    if args.reranker:
        rr, rr_tok, rr_settings = load_exported_reranker(args.reranker, torch.float32, args.trust_remote_code)
        precision.autocast_forward(rr, ctx.device.type, precision.parse_dtype(args.compute_dtype))
        fusion = rr_settings.get("fusion") or {}  # chosen on the training run's dev set (--dev-biencoder)
        if args.rerank_weight is None and args.rerank_top_k is None and fusion and ctx.is_main:
            print(f"{args.reranker}: fusion weight {fusion['weight']:g}, top {fusion['top_k']}, as chosen on its dev set "
                  f"(ndcg@10 {fusion['ndcg@10']:.4f})" + ("; weight 0: the reranker did not pay there"
                                                          if fusion["weight"] == 0 else ""))
        args.rerank_weight = fusion.get("weight", 0.5) if args.rerank_weight is None else args.rerank_weight
        args.rerank_top_k = fusion.get("top_k", 10) if args.rerank_top_k is None else args.rerank_top_k
        run2 = rerank(run, rr.to(ctx.device), rr_tok, rr_settings, beir, args.rerank_top_k, device=ctx.device,
                      progress=ctx.is_main, weight=args.rerank_weight)
        results[f"biencoder+reranker@{args.rerank_top_k}"] = retrieval_metrics(run2, beir[3])
    if ctx.is_main:
        n_q, n_d = len(beir[3]), len(beir[0])
        print(f"{args.beir}: {n_q} judged queries, {n_d} docs; model {model_dir}" +
              (f"; reranker {args.reranker} (weight {args.rerank_weight:g})" if args.reranker else ""))
        keys = list(results["biencoder"])
        print(f"{'stage':28}" + "".join(f"{k:>11}" for k in keys))
        for stage, m in results.items():
            if stage != head.NAME:
                print(f"{stage:28}" + "".join(f"{m[k]:11.4f}" for k in keys))
        if args.output:
            with open(args.output, "w") as f:
                json.dump({"model": model_dir, "reranker": args.reranker, "rerank_weight": args.rerank_weight,
                           **results}, f, indent=2)
    dist.cleanup()
    return results


if __name__ == "__main__":
    from retrieval_kit.rundir import exit_on_data_error

    exit_on_data_error(main)

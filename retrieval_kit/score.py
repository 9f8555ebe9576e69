"""Teacher scores: an exported model's score for every passage of every training record, written as
training JSONL under FlagEmbedding's field names, ready for `--distill-weight`.

    python -m retrieval_kit.score --model runs/reranker/final --input data/mined.jsonl --out data/scored.jsonl
    torchrun --nproc_per_node=2 -m retrieval_kit.score --model ... --input ... --out ...   # blocks split over ranks

Each output line is {"query", "pos", "neg", "pos_scores", "neg_scores"} (plus "prompt" when the
record has one), the passages as text, in the record's order. An export of train_reranker.py
scores a pair with its logit (tokenized as it was trained); an export of train_biencoder.py with
the inner product of its embeddings (the cosine when normalized; use a teacher temperature near
its training temperature). Any input format the scripts read works (--corpus for docs by id).

Records are scored in blocks of --block-size. Block b is scored by rank b % world and written to
OUT.parts/block_{b}.jsonl at once (a temporary file renamed), so a run that is killed and started
again with the same command skips the blocks already written, on any number of ranks, and ends
with the same file as a run in one go. Rank 0 then joins the blocks in order into OUT (written as
OUT.partial, renamed when complete) and removes OUT.parts.
"""

import argparse
import json
import os
import shutil

import torch
from tqdm import tqdm

from . import cli, dist, flags, outputs, precision
from .export import load_exported_reranker

MANIFEST = "manifest.json"


def record_line(record, pos_scores, neg_scores):
    """One output record: FlagEmbedding's fields, passages as text, scores as floats."""
    out = {"query": record.bare_query, "pos": list(record.pos), "neg": list(record.neg),
           "pos_scores": pos_scores, "neg_scores": neg_scores}
    if record.prompt:
        out["prompt"] = record.prompt
    return json.dumps(out, ensure_ascii=False) + "\n"


class Scorer:
    """score(queries, passages) -> a float per (query, passage) pair, for either kind of export. A
    bi-encoder's vectors are kept in `storage` (the run's compute dtype: fp32 unless --compute-dtype bf16),
    never rounded below it."""

    def __init__(self, model_dir, device, batch_size, trust_remote_code=False, compute_dtype=None):
        from .st_format import load_settings

        self.kind = load_settings(model_dir).get("kind")
        self.device, self.batch_size = device, batch_size
        self.storage = compute_dtype or torch.float32
        if self.kind == "reranker":
            model, self.tokenizer, self.settings = load_exported_reranker(model_dir, torch.float32, trust_remote_code)
            self.model = model.to(device).eval()
            precision.autocast_forward(self.model, device.type, compute_dtype)
        elif self.kind == "biencoder":
            from .evaluate import load_biencoder

            self.model, self.tokenizer, self.settings, self.head = load_biencoder(
                model_dir, {}, torch.float32, trust_remote_code, device, compute_dtype)
        else:
            raise SystemExit(f"--model {model_dir}: not an export of train_reranker.py or train_biencoder.py (its "
                             "retrieval_kit.json, which says how to score, is missing or names no kind)")

    @torch.no_grad()
    def score(self, queries, passages):
        if self.kind == "reranker":
            from .encode import rerank_groups

            return rerank_groups(self.model, self.tokenizer, queries, [[p] for p in passages], self.settings,
                                 self.batch_size, self.device)[:, 0].tolist()
        from .encode import encode_texts, warn_empty

        s, head = self.settings, self.head
        sides = head.sides(self.tokenizer, s)  # multi-vector: query expansion, the passages' skiplist
        unique = list(dict.fromkeys(queries))  # each query embedded once, not once per passage
        row = {text: i for i, text in enumerate(unique)}
        q = encode_texts(self.model, self.tokenizer, unique, s["query_max_length"], s["query_prefix"], self.batch_size,
                         self.device, side=sides["q"], head=head, name="q", dtype=self.storage)
        p = encode_texts(self.model, self.tokenizer, passages, s["passage_max_length"], s["passage_prefix"],
                         self.batch_size, self.device, side=sides["p"], head=head, name="p", dtype=self.storage)
        warn_empty(head, q, "queries")
        warn_empty(head, p, "passages")
        q, p = head.as_dense(q), head.as_dense(p)  # (a block of records' passages)
        return head.pair_scores(q[[row[text] for text in queries]], p).tolist()


def score_block(scorer, records):
    """The output lines of one block of records (every passage of each scored against its query)."""
    queries, passages = [], []
    for r in records:
        for p in list(r.pos) + list(r.neg):
            queries.append(r.query)
            passages.append(p)
    scores = iter(scorer.score(queries, passages)) if passages else iter(())
    lines = []
    for r in records:
        pos = [next(scores) for _ in range(len(r.pos))]
        lines.append(record_line(r, pos, [next(scores) for _ in range(len(r.neg))]))
    return "".join(lines)


def model_digest(model_dir):
    """A fingerprint of an export: its small files by content, its weight files by size and mtime (a
    re-export in place changes it; hashing gigabytes of weights at every start would not pay)."""
    import hashlib

    from .formats import file_digest

    h = hashlib.blake2b(digest_size=16)
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        st = os.stat(path)
        big = name.endswith((".safetensors", ".bin", ".pt", ".pth"))
        h.update(f"{name}:{st.st_size}:{st.st_mtime_ns if big else file_digest(path)}\n".encode())
    return h.hexdigest()


def check_parts(parts, manifest):
    """Start or continue OUT.parts: a manifest from another run (other input or its content, model or
    its files, corpus, batch or block size) is refused, naming what differs."""
    path = os.path.join(parts, MANIFEST)
    if os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
        if saved != manifest:
            diffs = ", ".join(f"{k}: {saved.get(k)!r} then, {v!r} now" for k, v in manifest.items() if saved.get(k) != v)
            raise SystemExit(f"{parts} holds the blocks of another run ({diffs}): run that command again to "
                             "finish it, or delete the folder")
        return
    os.makedirs(parts, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(path + ".tmp", path)


def block_path(parts, b):
    return os.path.join(parts, f"block_{b:06d}.jsonl")


def main(argv=None):
    from .encode import block_done, save_block, write_text
    from .records import read_records
    from .formats import read_corpus

    ap = cli.KitParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=flags.model_path, required=True,
                    help="an exported model dir (final/ of train_reranker.py or train_biencoder.py)")
    ap.add_argument("--input", required=True, help="training records, any format the scripts read")
    ap.add_argument("--corpus", default=None, help="BEIR corpus.jsonl for records that name docs by id")
    ap.add_argument("--out", required=True, help="the training JSONL to write, with pos_scores / neg_scores")
    ap.add_argument("--batch-size", type=flags.positive_int, default=32, help="pairs (or texts) per forward (default 32)")
    ap.add_argument("--block-size", type=flags.positive_int, default=64,
                    help="records per block: the unit of sharding over ranks and of resuming (default 64)")
    ap.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    ap.add_argument("--trust-remote-code", action="store_true", help="allow model code shipped in the model dir")
    precision.add_inference_dtype(ap)
    args = ap.parse_args(argv)
    outputs.check_file("--out", args.out, [("--input", args.input), ("--corpus", args.corpus), ("--model", args.model)],
                       args.overwrite)  # never over an input, nor inside the model dir
    outputs.check_parts("--out", args.out + ".parts", MANIFEST)

    ctx = dist.init()
    corpus = read_corpus(args.corpus) if args.corpus else None
    records, _ = read_records(args.input, corpus=corpus)
    dist.print0(records.summary)  # names the file
    scorer = Scorer(args.model, ctx.device, args.batch_size, args.trust_remote_code,
                    precision.parse_dtype(args.compute_dtype))
    parts = args.out + ".parts"
    from .formats import file_digest

    manifest = {"input": os.path.abspath(args.input), "input_digest": file_digest(args.input),
                "model": os.path.abspath(args.model), "model_digest": model_digest(args.model),
                "corpus": args.corpus and os.path.abspath(args.corpus),
                "corpus_digest": args.corpus and file_digest(args.corpus), "records": len(records),
                "block_size": args.block_size, "batch_size": args.batch_size,  # the batch changes the padding
                **({"compute_dtype": args.compute_dtype} if args.compute_dtype != "none" else {})}
    if ctx.is_main:
        check_parts(parts, manifest)
    dist.barrier()
    n_blocks = -(-len(records) // args.block_size)
    mine = [b for b in range(ctx.rank, n_blocks, ctx.world_size) if not block_done(block_path(parts, b))]
    redone = [b for b in mine if os.path.exists(block_path(parts, b))]
    if redone:
        print(f"warning: {parts}: block(s) {redone} do not match their checksums: scoring them again", flush=True)
    with flags.writing(args.out, then=f"the blocks scored so far are kept in {parts}: free space, then run the same "
                                      "command again"):  # a full disk, a file-size limit, a read-only folder
        for b in tqdm(mine, desc=f"score ({scorer.kind})", unit="block", disable=not ctx.is_main):
            text = score_block(scorer, [records[i] for i in range(b * args.block_size,
                                                                    min(len(records), (b + 1) * args.block_size))])
            save_block(block_path(parts, b), lambda tmp: write_text(tmp, text))
        dist.barrier()
        if ctx.is_main:
            with open(args.out + ".partial", "w", encoding="utf-8") as out:
                for b in range(n_blocks):
                    with open(block_path(parts, b), encoding="utf-8") as f:
                        shutil.copyfileobj(f, out)
            os.replace(args.out + ".partial", args.out)
            shutil.rmtree(parts)
            print(f"wrote {len(records)} records with {scorer.kind} scores to {args.out}")
    dist.cleanup()


if __name__ == "__main__":
    from .rundir import exit_on_data_error

    exit_on_data_error(main)

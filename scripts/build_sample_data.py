"""Build the bundled sample data from Debian's English package descriptions.

Query = a package's synopsis (one line); passage = its long description. Hard negatives are
mined with the base encoder (all-MiniLM-L6-v2), skipping candidates that score within
`--max-score-ratio` of the positive (likely false negatives: near-identical descriptions of
sibling packages).

    apt-get update -o Acquire::Languages=en
    python scripts/build_sample_data.py            # writes data/

Outputs:
    data/train.jsonl        training groups {"query", "pos_doc", "neg_doc"}
    data/val.jsonl          held-out groups, same format
    data/eval/              BEIR layout: corpus.jsonl, queries.jsonl, qrels/test.tsv

The benchmark's file of uncut descriptions (median 70 tokens, 3.9% at 256 or more):

    python scripts/build_sample_data.py --max-chars 0 --max-length 256 --n-train 512 --n-val 0 \
        --n-eval-corpus 0 --n-negatives 1 --out bench/data
"""

import argparse
import glob
import json
import os
import random
import re
import subprocess
import sys

import torch
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from retrieval_kit.encode import encode_texts  # noqa: E402
from retrieval_kit.mine import mine_hard_negatives  # noqa: E402
from retrieval_kit.heads.single_vector import BiEncoder  # noqa: E402
from retrieval_kit.models import default_model_dir, load_encoder  # noqa: E402


def read_translation(paths):
    """Yield (package, synopsis, long description) from Debian Translation-en files."""
    for path in paths:
        if path.endswith(".lz4"):
            text = subprocess.run(["/usr/lib/apt/apt-helper", "cat-file", path], check=True,
                                  capture_output=True).stdout.decode("utf-8", "replace")
        else:
            text = open(path, encoding="utf-8", errors="replace").read()
        for block in text.split("\n\n"):
            pkg, syn, body, in_desc = None, None, [], False
            for line in block.split("\n"):
                if line.startswith("Package: "):
                    pkg = line[9:].strip()
                elif line.startswith("Description-en: "):
                    syn, in_desc = line[16:].strip(), True
                elif in_desc and line.startswith(" "):
                    body.append("" if line.strip() == "." else line.strip())
                else:
                    in_desc = False
            if pkg and syn and body:
                yield pkg, syn, " ".join(x for x in body if x)


def clean(text, max_chars):
    text = re.sub(r"\s+", " ", text).strip()
    if max_chars and len(text) > max_chars:
        text = text[:max_chars].rsplit(" ", 1)[0]
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--translation", nargs="*", default=None,
                    help="Translation-en files (default: /var/lib/apt/lists/*_main_i18n_Translation-en.lz4)")
    ap.add_argument("--out", default="data", help="output folder")
    ap.add_argument("--model", default=None, help="encoder used to mine negatives (default: bundled MiniLM)")
    ap.add_argument("--n-train", type=int, default=3000)
    ap.add_argument("--n-val", type=int, default=300, help="validation groups (0 = none)")
    ap.add_argument("--n-eval-queries", type=int, default=200)
    ap.add_argument("--n-eval-corpus", type=int, default=2000, help="eval corpus size (positives + distractors; 0 = no eval set)")
    ap.add_argument("--n-negatives", type=int, default=3, help="hard negatives kept per group")
    ap.add_argument("--skip-top", type=int, default=0, help="skip this many top-ranked non-positives")
    ap.add_argument("--max-score-ratio", type=float, default=0.95,
                    help="drop candidates scoring above this fraction of the positive's score")
    ap.add_argument("--val-max-score-ratio", type=float, default=None,
                    help="the same filter for the val split (default off: a filter relative to the base "
                         "model's own scores would hand the base model a perfect validation score)")
    ap.add_argument("--depth", type=int, default=300, help="candidates considered per query")
    ap.add_argument("--max-chars", type=int, default=500, help="cut passages at this many characters (0 = uncut)")
    ap.add_argument("--max-length", type=int, default=128, help="tokens per passage when mining")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    paths = args.translation or sorted(glob.glob("/var/lib/apt/lists/*_main_i18n_Translation-en.lz4"))
    if not paths:
        sys.exit("no Translation-en files: run `apt-get update -o Acquire::Languages=en` first")

    # ----- read, clean, de-duplicate ---------------------------------------------------------
    seen_syn, seen_body, items = set(), set(), []
    for pkg, syn, body in read_translation(paths):
        body = clean(body, args.max_chars)
        n_words = len(syn.split())
        if not (3 <= n_words <= 16) or len(body) < 120:
            continue
        key_syn, key_body = syn.lower(), body[:120].lower()  # siblings share a description's opening
        if key_syn in seen_syn or key_body in seen_body:
            continue
        seen_syn.add(key_syn)
        seen_body.add(key_body)
        items.append({"pkg": pkg, "query": syn, "text": body})
    print(f"{len(items)} unique (synopsis, description) pairs from {len(paths)} file(s)")
    random.Random(args.seed).shuffle(items)
    n_tv = args.n_train + args.n_val
    need = n_tv + args.n_eval_corpus
    if len(items) < need:
        sys.exit(f"only {len(items)} usable pairs, need {need}")
    train_val, eval_pool = items[:n_tv], items[n_tv:need]

    # ----- mine hard negatives: train from train passages only (val passages stay unseen),
    # val from all of them -----------------------------
    model_dir = args.model or default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = load_encoder(model_dir, torch.float32)
    texts = [it["text"] for it in train_val]
    p_emb = encode_texts(BiEncoder(model), tok, texts, args.max_length, progress=True, desc="passages")
    q_emb = encode_texts(BiEncoder(model), tok, [it["query"] for it in train_val], 32, progress=True, desc="queries")
    positives = [[i] for i in range(len(texts))]
    negs = mine_hard_negatives(q_emb[:args.n_train], p_emb[:args.n_train], positives[:args.n_train], k=args.n_negatives,
                               skip_top=args.skip_top, max_score_ratio=args.max_score_ratio, p_texts=texts[:args.n_train],
                               depth=args.depth)
    if args.n_val:
        negs += mine_hard_negatives(q_emb[args.n_train:], p_emb, positives[args.n_train:], k=args.n_negatives,
                                    skip_top=args.skip_top, max_score_ratio=args.val_max_score_ratio,
                                    p_texts=texts, depth=args.depth)
    os.makedirs(args.out, exist_ok=True)
    short, dropped, written = 0, 0, {}
    for name, lo, hi in (("train", 0, args.n_train), ("val", args.n_train, n_tv)):
        written[name] = 0
        if lo == hi:
            continue
        with open(os.path.join(args.out, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            for i in range(lo, hi):
                if not negs[i]:  # every candidate scored too close to (or above) the positive
                    dropped += 1
                    continue
                short += len(negs[i]) < args.n_negatives
                written[name] += 1
                rec = {"query": train_val[i]["query"],
                       "pos_doc": [{"id": train_val[i]["pkg"], "text": texts[i]}],
                       "neg_doc": [{"id": train_val[j]["pkg"],
                                    "text": texts[j]} for j in negs[i]]}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"wrote {written['train']} train and {written['val']} val groups; dropped {dropped} whose "
          f"candidates all failed the false-negative filter; {short} kept with fewer than {args.n_negatives}")

    # ----- BEIR-layout evaluation set: disjoint from train/val --------------------------------
    if not args.n_eval_corpus:
        return
    ev = os.path.join(args.out, "eval")
    os.makedirs(os.path.join(ev, "qrels"), exist_ok=True)
    with open(os.path.join(ev, "corpus.jsonl"), "w", encoding="utf-8") as f:
        for it in eval_pool:
            f.write(json.dumps({"_id": it["pkg"], "title": "", "text": it["text"]}, ensure_ascii=False) + "\n")
    with open(os.path.join(ev, "queries.jsonl"), "w", encoding="utf-8") as f, \
            open(os.path.join(ev, "qrels", "test.tsv"), "w", encoding="utf-8") as fq:
        fq.write("query-id\tcorpus-id\tscore\n")
        for n, it in enumerate(eval_pool[:args.n_eval_queries]):
            f.write(json.dumps({"_id": f"q{n}", "text": it["query"]}, ensure_ascii=False) + "\n")
            fq.write(f"q{n}\t{it['pkg']}\t1\n")
    print(f"wrote eval set: {args.n_eval_queries} queries over {len(eval_pool)} passages")


if __name__ == "__main__":
    main()

"""Build data/ood/: an out-of-domain BEIR set from the Python standard library's docstrings.

    python scripts/build_ood_data.py                 # writes data/ood/ (about 5 s)

The training data is Debian package descriptions; this set is API documentation. Each query is
the one-line summary of a documented function, method or class of the standard library of the
running Python (parsed with `ast`, nothing imported); its one relevant passage is the rest of that
docstring (whitespace collapsed, cut at --max-chars). Other docstrings fill the corpus as
distractors. Docstrings whose body repeats the summary, whose summary is under 4 or over 24
words, or whose body is under 150 characters are skipped, and so are duplicates of an earlier
summary or body. The text is the Python Software Foundation's, under the PSF License.
"""

import argparse
import ast
import json
import os
import random
import re
import sysconfig

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__", "turtledemo"}


def docstrings(root):
    """(summary, body) of every function / class docstring under `root`, in file order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    doc = ast.get_docstring(node)
                    if doc and "\n\n" in doc:
                        head, body = doc.split("\n\n", 1)
                        yield " ".join(head.split()), " ".join(body.split())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "ood"))
    ap.add_argument("--n-queries", type=int, default=200)
    ap.add_argument("--n-corpus", type=int, default=1300)
    ap.add_argument("--max-chars", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    seen_q, seen_d, pairs = set(), set(), []
    for summary, body in docstrings(sysconfig.get_paths()["stdlib"]):
        words = summary.split()
        key_q, key_d = summary.lower(), body[:200].lower()
        if not 4 <= len(words) <= 24 or len(body) < 150 or key_q in body.lower() or not re.search("[a-z]", summary):
            continue
        if key_q in seen_q or key_d in seen_d:
            continue
        seen_q.add(key_q)
        seen_d.add(key_d)
        pairs.append((summary, body[:args.max_chars].rsplit(" ", 1)[0] if len(body) > args.max_chars else body))
    random.Random(args.seed).shuffle(pairs)
    if len(pairs) < args.n_corpus:
        raise SystemExit(f"only {len(pairs)} usable docstrings, fewer than --n-corpus {args.n_corpus}")
    pairs = pairs[:args.n_corpus]
    os.makedirs(os.path.join(args.out, "qrels"), exist_ok=True)
    with open(os.path.join(args.out, "corpus.jsonl"), "w", encoding="utf-8") as f:
        for i, (_, body) in enumerate(pairs):
            f.write(json.dumps({"_id": f"d{i}", "title": "", "text": body}, ensure_ascii=False) + "\n")
    with open(os.path.join(args.out, "queries.jsonl"), "w", encoding="utf-8") as f, \
            open(os.path.join(args.out, "qrels", "test.tsv"), "w", encoding="utf-8") as g:
        g.write("query-id\tcorpus-id\tscore\n")
        for i, (summary, _) in enumerate(pairs[:args.n_queries]):
            f.write(json.dumps({"_id": f"q{i}", "text": summary}, ensure_ascii=False) + "\n")
            g.write(f"q{i}\td{i}\t1\n")
    print(f"wrote {args.out}: {args.n_queries} queries, {len(pairs)} passages (from {len(seen_q)} usable docstrings)")


if __name__ == "__main__":
    main()

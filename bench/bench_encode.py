"""Corpus encoding throughput: the kit's length-sorted batches against a plain model(**batch) loop.

    python bench/bench_encode.py                 # 500 docs of data/eval, MiniLM, batch 64, max length 128
    python bench/bench_encode.py --docs 2000 --reps 3

Both sides embed the same texts with the same model, batch size, max length and mean pooling,
under torch.no_grad; the plain loop takes the corpus in file order, so every batch pads to its
longest text. Sides alternate; the median over --reps runs is reported, with an embedding check.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from retrieval_kit.encode import encode_texts  # noqa: E402
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=500)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=128)
    args = ap.parse_args()
    model_dir = default_model_dir()
    tok, model = AutoTokenizer.from_pretrained(model_dir), load_encoder(model_dir).eval()
    with open(os.path.join(ROOT, "data", "eval", "corpus.jsonl")) as f:
        texts = [json.loads(line)["text"] for line in f][:args.docs]
    times = {"plain": [], "kit": []}
    for i in range(args.reps):
        for side in (("kit", "plain") if i % 2 == 0 else ("plain", "kit")):
            t0 = time.perf_counter()
            emb = (encode_texts(model, tok, texts, args.max_length, batch_size=args.batch_size) if side == "kit"
                   else plain(model, tok, texts, args.max_length, args.batch_size))
            times[side].append(time.perf_counter() - t0)
            if side == "kit":
                kit_emb = emb
            else:
                plain_emb = emb
    diff = (kit_emb - plain_emb).abs().max().item()
    n_tok = [len(x) for x in tok(texts, max_length=args.max_length, truncation=True)["input_ids"]]
    print(f"{len(texts)} docs of data/eval (tokens: median {statistics.median(n_tok)}, max {max(n_tok)}), "
          f"batch {args.batch_size}, max length {args.max_length}, {args.reps} reps, {torch.get_num_threads()} threads")
    for side in ("plain", "kit"):
        med = statistics.median(times[side])
        print(f"  {side:6} {med:8.2f} s  {len(texts) / med:8.1f} docs/s")
    print(f"  speed-up kit/plain: {statistics.median(times['plain']) / statistics.median(times['kit']):.2f}x; "
          f"max embedding difference {diff:.1e}")


if __name__ == "__main__":
    main()

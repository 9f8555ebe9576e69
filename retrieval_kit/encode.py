"""Inference-time encoding of many texts: sorted by length, batched, original order restored.

Sorting by length means each batch pads only to its own longest text, so little work goes to
padding; the embedding of a text depends only on its own tokens, so the result is the same.
"""

import torch
from tqdm import tqdm

from .collate import tokenize
from .models import encode


@torch.no_grad()
def encode_texts(model, tokenizer, texts, max_length, prefix="", batch_size=64, pooling="avg",
                 normalize=True, device="cpu", progress=False, desc="encode"):
    """Embed `texts` -> (N, H) float32 tensor on CPU, rows in the order of `texts`."""
    was_training = model.training
    model.eval()
    lengths = [len(t) for t in texts]  # characters are a cheap, good proxy for tokens
    order = sorted(range(len(texts)), key=lambda i: -lengths[i])
    out = [None] * len(texts)
    starts = range(0, len(texts), batch_size)
    for s in tqdm(starts, desc=desc, disable=not progress):
        idx = order[s:s + batch_size]
        batch = tokenize(tokenizer, [texts[i] for i in idx], max_length, prefix).to(device)
        reps = encode(model, batch, pooling, normalize).float().cpu()
        for row, i in enumerate(idx):
            out[i] = reps[row]
    model.train(was_training)
    if not texts:
        return torch.empty(0, 0)
    return torch.stack(out)


@torch.no_grad()
def score_groups(model, tokenizer, queries, groups, settings, batch_size=16, device="cpu"):
    """Cross-encoder scores (Q, n) for each query against its own group of n passages.

    `model` is a CrossEncoder; `settings` holds the tokenization saved with the export
    (prompt_template, rerank_max_length, append_eos), so scoring tokenizes as training did.
    """
    from .collate import collate_rerank

    was_training = model.training
    model.eval()
    n = len(groups[0])
    out = []
    for s in range(0, len(queries), batch_size):
        batch = collate_rerank(tokenizer, queries[s:s + batch_size], groups[s:s + batch_size],
                               settings["prompt_template"], settings["rerank_max_length"],
                               settings.get("append_eos", False), settings.get("pad_to_multiple_of"))
        out.append(model(batch.to(device)).float().view(-1, n).cpu())
    model.train(was_training)
    return torch.cat(out)

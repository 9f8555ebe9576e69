"""Inference: embed many texts (sorted by length, batched, original order restored; split over
ranks under torchrun; kept as the model's head stores a corpus) and score (query, passage) groups with
a cross-encoder.

Sorting by length means each batch pads only to its own longest text, so little work goes to
padding; the embedding of a text depends only on its own tokens, so the result is the same.
"""

import os

import torch
from tqdm import tqdm

from .collate import tokenize
from .dist import stop_point
from . import heads


@torch.no_grad()
def encode_texts(model, tokenizer, texts, max_length, prefix="", batch_size=64, device="cpu", progress=False,
                 desc="encode", side=None, head=heads.default(), name="p", dtype=None):
    """Embed `texts` -> their representations as `head` stores a corpus (head.store / head.stack: (N, H)
    fp32 for one vector, (N, max_length, dim + 1) bf16 token vectors, (N, V) sparse COO), on the CPU,
    rows in the order of `texts`.

    `model` is the head's embedder module (head.embedder: BiEncoder, LateInteraction, Splade; possibly
    FSDP2-sharded), run as `model(**{name: batch})[name]` ("q": queries, "p": passages). `side`: the
    texts' side (head.sides), or None. `dtype`: the stored dtype where the head keeps one
    (multi-vector: bf16 by default).
    """
    was_training = model.training
    model.eval()
    lengths = [len(t) for t in texts]  # characters are a cheap, good proxy for tokens
    order = sorted(range(len(texts)), key=lambda i: -lengths[i])
    out = [None] * len(texts)
    starts = range(0, len(texts), batch_size)
    for s in tqdm(starts, desc=desc, disable=not progress):
        stop_point()  # a SIGTERM in a training run's evaluation: every rank stops here (dist.Interrupted)
        idx = order[s:s + batch_size]
        batch = tokenize(tokenizer, [texts[i] for i in idx], max_length, prefix, side=side).to(device)
        rows = head.store(model(**{name: batch})[name], max_length, dtype)
        for row, i in enumerate(idx):
            out[i] = rows[row]
    model.train(was_training)
    if not texts:
        return torch.empty(0, 0)
    return head.stack(out)


@torch.no_grad()
def score_pairs(model, tokenizer, queries, passages, settings, batch_size=32, device="cpu", layout=None,
                progress=False, desc="score"):
    """Cross-encoder scores of the pairs (queries[i], passages[i]): (N,) float32 on CPU, in input order.

    `model` is a reranker head's scorer; `settings` holds the tokenization saved with the export or
    checkpoint (pairs.rerank_layout reads it), so scoring tokenizes as training did. The pairs go through in
    forwards of `batch_size` pairs sorted by length (characters), each padded only to its own longest,
    as encode_texts does with texts.
    """
    from .collate import collate_rerank
    from .pairs import rerank_layout

    layout = layout or rerank_layout(tokenizer, settings)
    was_training = model.training
    model.eval()
    order = sorted(range(len(queries)), key=lambda i: -(len(queries[i]) + len(passages[i])))
    out = torch.empty(len(queries))
    for s in tqdm(range(0, len(order), batch_size), desc=desc, disable=not progress):
        stop_point()
        idx = order[s:s + batch_size]
        batch = collate_rerank(tokenizer, [queries[i] for i in idx], [[passages[i]] for i in idx],
                               max_length=settings["rerank_max_length"],
                               pad_to_multiple_of=settings.get("pad_to_multiple_of"), layout=layout)
        out[idx] = model(pairs=batch.to(device))["pairs"].float().cpu()
    model.train(was_training)
    return out


def rerank_groups(model, tokenizer, queries, groups, settings, batch_size=16, device="cpu", layout=None):
    """Cross-encoder scores (Q, n) for each query against its own group of n passages (score_pairs,
    `batch_size` queries' pairs per forward)."""
    n = len(groups[0])
    flat_queries = [q for q, g in zip(queries, groups) for _ in g]
    scores = score_pairs(model, tokenizer, flat_queries, [p for g in groups for p in g], settings, batch_size * n,
                         device, layout)
    return scores.view(-1, n)


def encode_shard(model, tokenizer, texts, max_length, prefix="", batch_size=64, device="cpu", progress=False,
                 desc="encode", side=None, head=heads.default(), name="p"):
    """This rank's contiguous shard of `texts` (data.shard) embedded: (its rows as `head` stores them,
    index of its first text in `texts`). Every rank runs the same number of batches (a short shard
    repeats a text, dropped after), as FSDP2's collective forwards need."""
    from .data import shard
    from .dist import rank as get_rank, world_size

    world, rank = world_size(), get_rank()
    per = -(-len(texts) // world)
    own = shard(texts, rank, world)
    padded = own + [texts[-1]] * (per - len(own)) if texts else []
    mine = encode_texts(model, tokenizer, padded, max_length, prefix, batch_size, device, progress and rank == 0, desc,
                        side, head, name)
    return head.select(mine, torch.arange(len(own))), min(rank * per, len(texts))


def warn_empty(head, stored, what):
    """A warning (once per process and `what`) when `head` stored all-zero vectors for some texts: they
    score 0 against everything (a sparse model that activates no dimension for them)."""
    from .pairs import warn_once

    n = head.empty_rows(stored)
    if n:
        warn_once(f"empty {what}", f"{n} of {stored.shape[0]} {what} have an all-zero vector: they score 0 against "
                                   "everything (a sparse model that activates nothing for them)")
    return n


def block_sum(path):
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write_text(path, text):
    with open(path, "w", encoding="utf-8") as f:  # closed here: a full disk raises here, not in a finalizer
        f.write(text)


def save_block(path, write):
    """Write a block whole: `write(tmp_path)`, renamed to `path`, then its checksum beside it (block_done)."""
    write(path + ".tmp")
    os.replace(path + ".tmp", path)
    with open(path + ".sha256.tmp", "w") as f:
        f.write(block_sum(path))
    os.replace(path + ".sha256.tmp", path + ".sha256")


def block_done(path):
    """Is the block at `path` written whole? It must match the checksum written beside it (else it is redone)."""
    try:
        with open(path + ".sha256") as f:
            return f.read().strip() == block_sum(path)
    except OSError:
        return False


def encode_blocks(model, tokenizer, texts, max_length, prefix, batch_size, device, parts, name, block_size,
                  progress=False, side=None, head=heads.default(), side_name="p"):
    """Embed `texts` in blocks of `block_size`, block b on rank b % world, each saved to
    `parts`/NAME_b.pt as soon as it is done (a temporary file renamed, its checksum written beside
    it), so a run killed and started again skips the blocks already written, on any number of ranks.
    Returns this rank's blocks (b % world == rank, encoded now or read back) as (their rows as `head`
    stores them, their indices into `texts`). The model must not be sharded (each rank runs its own
    forwards)."""
    from .dist import rank as get_rank, world_size

    world, me = world_size(), get_rank()
    blocks = range(me, -(-len(texts) // block_size), world)
    embs, ids = [], []
    for b in tqdm(blocks, desc=f"{name} blocks", unit="block", disable=not progress):
        path = os.path.join(parts, f"{name}_{b:06d}.pt")
        rows = range(b * block_size, min(len(texts), (b + 1) * block_size))
        if block_done(path):
            emb = torch.load(path, weights_only=True)
        else:
            emb = encode_texts(model, tokenizer, [texts[i] for i in rows], max_length, prefix, batch_size, device,
                               side=side, head=head, name=side_name)
            save_block(path, lambda tmp: torch.save(emb, tmp))
        embs.append(emb)
        ids.append(torch.arange(rows.start, rows.stop))
    if not embs:
        return torch.empty(0, 0), torch.empty(0, dtype=torch.long)
    return torch.cat(embs), torch.cat(ids)


def encode_sharded(model, tokenizer, texts, max_length, prefix="", batch_size=64, device="cpu", progress=False,
                   desc="encode", side=None, head=heads.default(), name="q"):
    """encode_texts split over the ranks of the process group, gathered back in order on every rank
    (dense: head.as_dense; a few texts at a time, queries)."""
    import torch.distributed as tdist

    from .data import shard
    from .dist import world_size

    world = world_size()
    if world == 1:
        return head.as_dense(encode_texts(model, tokenizer, texts, max_length, prefix, batch_size, device, progress,
                                          desc, side, head, name))
    mine, _ = encode_shard(model, tokenizer, texts, max_length, prefix, batch_size, device, progress, desc, side, head,
                           name)
    mine = head.as_dense(mine)
    per = -(-len(texts) // world)
    dims = torch.zeros(2, dtype=torch.long, device=device)  # a row's shape: (H,) or, token vectors, (W, d + 1)
    if mine.numel():
        dims[:mine.dim() - 1] = torch.tensor(mine.shape[1:])
    tdist.all_reduce(dims, op=tdist.ReduceOp.MAX)
    padded = torch.zeros(per, *[int(d) for d in dims if d], device=device)  # (gathered in fp32)
    padded[:mine.shape[0]] = mine.to(device, torch.float32)
    parts = [torch.empty_like(padded) for _ in range(world)]
    tdist.all_gather(parts, padded)
    sizes = [len(shard(texts, r, world)) for r in range(world)]
    return torch.cat([p[:n] for p, n in zip(parts, sizes)]).to(mine.dtype if mine.numel() else torch.float32).cpu()

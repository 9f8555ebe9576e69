"""Inference: embed many texts (sorted by length, batched, original order restored; split over
ranks under torchrun) and score (query, passage) groups with a cross-encoder.

Sorting by length means each batch pads only to its own longest text, so little work goes to
padding; the embedding of a text depends only on its own tokens, so the result is the same.
"""

import os

import torch
from tqdm import tqdm

from .collate import tokenize
from .models import BiEncoder, LateInteraction, Splade, encode, sparse_vectors, token_vectors


TOKEN_STORAGE = torch.bfloat16  # a multi-vector corpus's token vectors (scored in fp32, losses.maxsim)


@torch.no_grad()
def encode_texts(model, tokenizer, texts, max_length, prefix="", batch_size=64, pooling="avg",
                 normalize=True, device="cpu", progress=False, desc="encode", side=None):
    """Embed `texts` -> (N, H) float32 tensor on CPU, rows in the order of `texts`.

    `model` is an HF encoder (pooled with `pooling` / `normalize`) or a BiEncoder (its own settings).
    pooling "tokens" (--head multi-vector): (N, max_length, dim + 1) token vectors with their mask
    channel (models.token_vectors), stored in TOKEN_STORAGE (bf16: 2 bytes a number); pooling "sparse"
    (--head sparse): (N, V) sparse COO, the vectors' non-zeros only (models.sparse_vectors). `side`: the
    texts' collate.MaxSimSide (--head multi-vector's query expansion or skiplist), or None.
    """
    was_training = model.training
    model.eval()
    lengths = [len(t) for t in texts]  # characters are a cheap, good proxy for tokens
    order = sorted(range(len(texts)), key=lambda i: -lengths[i])
    out = [None] * len(texts)
    starts = range(0, len(texts), batch_size)
    for s in tqdm(starts, desc=desc, disable=not progress):
        idx = order[s:s + batch_size]
        batch = tokenize(tokenizer, [texts[i] for i in idx], max_length, prefix, side=side).to(device)
        if pooling == "tokens":  # --head multi-vector: (rows, max_length, dim + 1) token vectors, stored small
            reps = model(p=batch)["p"] if isinstance(model, LateInteraction) else token_vectors(model, batch)
            # (columns past max_length, which a configured width may add, are padding: cut)
            reps = torch.nn.functional.pad(reps, (0, 0, 0, max_length - reps.shape[1])).to(TOKEN_STORAGE).cpu()
        elif pooling == "sparse":  # --head sparse: vocabulary-sized vectors, kept as their non-zeros
            reps = (model(p=batch)["p"] if isinstance(model, Splade) else sparse_vectors(model, batch)).float().cpu()
            reps = [r.to_sparse() for r in reps]
        elif isinstance(model, BiEncoder):  # a (possibly FSDP2-sharded) BiEncoder: go through its forward
            reps = model(p=batch)["p"].float().cpu()
        else:
            reps = encode(model, batch, pooling, normalize).float().cpu()
        for row, i in enumerate(idx):
            out[i] = reps[row]
    model.train(was_training)
    if not texts:
        return torch.empty(0, 0)
    if pooling == "sparse":
        return stack_sparse(out)
    return torch.stack(out)


def stack_sparse(rows):
    """(N, V) sparse COO tensor of N sparse (V,) vectors, in order: never a dense N x V matrix."""
    idx = [r.coalesce().indices()[0] for r in rows]
    vals = [r.coalesce().values() for r in rows]
    row_of = torch.cat([torch.full((len(i),), n, dtype=torch.long) for n, i in enumerate(idx)])
    return torch.sparse_coo_tensor(torch.stack([row_of, torch.cat(idx)]), torch.cat(vals),
                                   (len(rows), rows[0].shape[0]), check_invariants=False).coalesce()


@torch.no_grad()
def score_pairs(model, tokenizer, queries, passages, settings, batch_size=32, device="cpu", layout=None,
                progress=False, desc="score"):
    """Cross-encoder scores of the pairs (queries[i], passages[i]): (N,) float32 on CPU, in input order.

    `model` is a CrossEncoder; `settings` holds the tokenization saved with the export or checkpoint
    (export.rerank_layout reads it), so scoring tokenizes as training did. The pairs go through in
    forwards of `batch_size` pairs sorted by length (characters), each padded only to its own longest,
    as encode_texts does with texts.
    """
    from .collate import collate_rerank
    from .export import rerank_layout

    layout = layout or rerank_layout(tokenizer, settings)
    was_training = model.training
    model.eval()
    order = sorted(range(len(queries)), key=lambda i: -(len(queries[i]) + len(passages[i])))
    out = torch.empty(len(queries))
    for s in tqdm(range(0, len(order), batch_size), desc=desc, disable=not progress):
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


def encode_shard(model, tokenizer, texts, max_length, prefix="", batch_size=64, pooling="avg", normalize=True,
                 device="cpu", progress=False, desc="encode", side=None):
    """This rank's contiguous shard of `texts` (data.shard) embedded: ((n_own, H) float32 on CPU,
    index of its first text in `texts`). Every rank runs the same number of batches (a short shard
    repeats a text, dropped after), as FSDP2's collective forwards need."""
    from .data import shard
    from .dist import rank as get_rank, world_size

    world, rank = world_size(), get_rank()
    per = -(-len(texts) // world)
    own = shard(texts, rank, world)
    padded = own + [texts[-1]] * (per - len(own)) if texts else []
    mine = encode_texts(model, tokenizer, padded, max_length, prefix, batch_size, pooling, normalize, device,
                        progress and rank == 0, desc, side)
    if mine.is_sparse:
        return mine.index_select(0, torch.arange(len(own))), min(rank * per, len(texts))
    return mine[:len(own)], min(rank * per, len(texts))


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


def encode_blocks(model, tokenizer, texts, max_length, prefix, batch_size, pooling, normalize, device, parts, name,
                  block_size, progress=False, side=None):
    """Embed `texts` in blocks of `block_size`, block b on rank b % world, each saved to
    `parts`/NAME_b.pt as soon as it is done (a temporary file renamed, its checksum written beside
    it), so a run killed and started again skips the blocks already written, on any number of ranks.
    Returns this rank's blocks (b % world == rank, encoded now or read back) as ((n_own, H) float32,
    their indices into `texts`). The model must not be sharded (each rank runs its own forwards)."""
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
            emb = encode_texts(model, tokenizer, [texts[i] for i in rows], max_length, prefix, batch_size, pooling,
                               normalize, device, side=side)
            save_block(path, lambda tmp: torch.save(emb, tmp))
        embs.append(emb)
        ids.append(torch.arange(rows.start, rows.stop))
    if not embs:
        return torch.empty(0, 0), torch.empty(0, dtype=torch.long)
    return torch.cat(embs), torch.cat(ids)


def encode_sharded(model, tokenizer, texts, max_length, prefix="", batch_size=64, pooling="avg", normalize=True,
                   device="cpu", progress=False, desc="encode", side=None):
    """encode_texts split over the ranks of the process group, gathered back in order on every rank."""
    import torch.distributed as tdist

    from .data import shard
    from .dist import world_size

    world = world_size()
    if world == 1:
        return encode_texts(model, tokenizer, texts, max_length, prefix, batch_size, pooling, normalize, device,
                            progress, desc, side)
    mine, _ = encode_shard(model, tokenizer, texts, max_length, prefix, batch_size, pooling, normalize, device,
                           progress, desc, side)
    mine = mine.to_dense() if mine.is_sparse else mine  # (gathered dense: queries, a few at a time)
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

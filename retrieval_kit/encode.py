"""Inference-time encoding of many texts: sorted by length, batched, original order restored.

Sorting by length means each batch pads only to its own longest text, so little work goes to
padding; the embedding of a text depends only on its own tokens, so the result is the same.
"""

import torch
from tqdm import tqdm

from .collate import tokenize
from .models import BiEncoder, encode, split_chunks


@torch.no_grad()
def encode_texts(model, tokenizer, texts, max_length, prefix="", batch_size=64, pooling="avg",
                 normalize=True, device="cpu", progress=False, desc="encode"):
    """Embed `texts` -> (N, H) float32 tensor on CPU, rows in the order of `texts`.

    `model` is an HF encoder (pooled with `pooling` / `normalize`) or a BiEncoder (its own settings).
    """
    was_training = model.training
    model.eval()
    lengths = [len(t) for t in texts]  # characters are a cheap, good proxy for tokens
    order = sorted(range(len(texts)), key=lambda i: -lengths[i])
    out = [None] * len(texts)
    starts = range(0, len(texts), batch_size)
    for s in tqdm(starts, desc=desc, disable=not progress):
        idx = order[s:s + batch_size]
        batch = tokenize(tokenizer, [texts[i] for i in idx], max_length, prefix).to(device)
        if isinstance(model, BiEncoder):  # a (possibly FSDP2-sharded) BiEncoder: go through its forward
            reps = model(p_batch=batch)[1].float().cpu()
        else:
            reps = encode(model, batch, pooling, normalize).float().cpu()
        for row, i in enumerate(idx):
            out[i] = reps[row]
    model.train(was_training)
    if not texts:
        return torch.empty(0, 0)
    return torch.stack(out)


@torch.no_grad()
def score_groups(model, tokenizer, queries, groups, settings, batch_size=16, device="cpu", layout=None):
    """Cross-encoder scores (Q, n) for each query against its own group of n passages.

    `model` is a CrossEncoder; `settings` holds the tokenization saved with the export or checkpoint
    (export.rerank_layout reads it), so scoring tokenizes as training did.
    """
    from .collate import collate_rerank
    from .export import rerank_layout

    layout = layout or rerank_layout(tokenizer, settings)
    was_training = model.training
    model.eval()
    n = len(groups[0])
    out = []
    for s in range(0, len(queries), batch_size):
        batch = collate_rerank(tokenizer, queries[s:s + batch_size], groups[s:s + batch_size],
                               max_length=settings["rerank_max_length"],
                               pad_to_multiple_of=settings.get("pad_to_multiple_of"), layout=layout)
        out.append(model(batch.to(device)).float().view(-1, n).cpu())
    model.train(was_training)
    return torch.cat(out)


def encode_sharded(model, tokenizer, texts, max_length, prefix="", batch_size=64, pooling="avg", normalize=True,
                   device="cpu", progress=False, desc="encode"):
    """encode_texts split over the ranks of the process group, gathered back in order on every rank."""
    import torch.distributed as tdist

    from .data import shard

    world = tdist.get_world_size() if tdist.is_initialized() else 1
    if world == 1:
        return encode_texts(model, tokenizer, texts, max_length, prefix, batch_size, pooling, normalize, device,
                            progress, desc)
    rank = tdist.get_rank()
    per = -(-len(texts) // world)
    own = shard(texts, rank, world)
    padded_texts = own + [texts[-1]] * (per - len(own))  # same batch count on every rank (FSDP2 forwards are collective)
    mine = encode_texts(model, tokenizer, padded_texts, max_length, prefix, batch_size, pooling,
                        normalize, device, progress and rank == 0, desc)[:len(own)]
    dim = torch.tensor([mine.shape[1] if mine.numel() else 0], device=device)
    tdist.all_reduce(dim, op=tdist.ReduceOp.MAX)
    padded = torch.zeros(per, int(dim), device=device)
    padded[:mine.shape[0]] = mine.to(device)
    parts = [torch.empty_like(padded) for _ in range(world)]
    tdist.all_gather(parts, padded)
    sizes = [len(shard(texts, r, world)) for r in range(world)]
    return torch.cat([p[:n] for p, n in zip(parts, sizes)]).cpu()


def exact_topk(q_emb, p_emb, k, query_chunk=256, corpus_chunk=8192):
    """Exact top-k by inner product, never building the full (Q, P) score matrix.

    Scores are computed for query_chunk x corpus_chunk blocks and merged into a running top-k.
    Returns (scores (Q, k'), indices (Q, k')) with k' = min(k, P), best first.
    """
    k = min(k, p_emb.shape[0])
    all_scores, all_idx = [], []
    for qs in range(0, q_emb.shape[0], query_chunk):
        q = q_emb[qs:qs + query_chunk]
        best_s = torch.full((q.shape[0], 0), float("-inf"))
        best_i = torch.zeros((q.shape[0], 0), dtype=torch.long)
        for ps in range(0, p_emb.shape[0], corpus_chunk):
            s = q @ p_emb[ps:ps + corpus_chunk].T  # (q, c)
            cand_s = torch.cat([best_s, s], dim=1)
            cand_i = torch.cat([best_i, torch.arange(ps, ps + s.shape[1]).expand(q.shape[0], -1)], dim=1)
            top = cand_s.topk(min(k, cand_s.shape[1]), dim=1)
            best_s, best_i = top.values, cand_i.gather(1, top.indices)
        all_scores.append(best_s)
        all_idx.append(best_i)
    return torch.cat(all_scores), torch.cat(all_idx)


def _rng_state():
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if torch.cuda.is_available() else None)


def _set_rng_state(state):
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


def grad_cache(model, parts, rows, run, loss_fn, sync=True):
    """The GradCache pattern (Gao et al., 2021) over any split of a batch; returns (loss, outputs)
    with the parameter gradients accumulated as one plain backward of the whole batch would leave them.

    parts: [(name, row indices, sub-batch)]; rows: {name: rows of that output in batch order};
    run(model, name, sub_batch) -> (len(row indices), ...) outputs; loss_fn({name: outputs}) -> loss.
    1. Run every part without a graph, recording the RNG state before each, into one buffer per name
       (nothing but the small RNG states outlives a part, so the allocator reuses its memory).
    2. loss_fn on the full outputs (gathers included), backward to d loss / d outputs.
    3. Run each part again with a graph, replaying its RNG state (same dropout), and backpropagate
       the cached output gradients. Only one part's activations live at a time, so memory stays
       flat as the batch grows. Gradients sync only on the last part's backward (when `sync`).
    """
    from .dist import grad_sync

    full, states = {}, []
    with torch.no_grad():
        for name, idx, sub in parts:
            states.append(_rng_state())
            out = run(model, name, sub)
            if name not in full:
                full[name] = out.new_empty((rows[name],) + tuple(out.shape[1:]))
            full[name][torch.tensor(idx, device=out.device)] = out
            del out
    for t in full.values():
        t.requires_grad_(True)
    loss = loss_fn(full)
    loss.backward()
    after = _rng_state()
    for i, ((name, idx, sub), state) in enumerate(zip(parts, states)):
        _set_rng_state(state)
        with grad_sync(model, sync and i == len(parts) - 1):
            out = run(model, name, sub)
            cached = full[name].grad[torch.tensor(idx, device=out.device)]
            (out * cached).sum().backward()  # d loss / d params through this part's outputs
    _set_rng_state(after)
    return loss.detach(), {name: t.detach() for name, t in full.items()}


def _chunk_parts(name, batch, chunk_tokens):
    pieces = split_chunks(batch, chunk_tokens)
    if pieces is None:
        pieces = [(list(range(batch["attention_mask"].shape[0])), batch)]
    return [(name, idx, sub) for idx, sub in pieces]


def grad_cache_biencoder(model, q_batch, p_batch, loss_fn, chunk_tokens, sync=True):
    """GradCache for a bi-encoder: `model` is the wrapped BiEncoder, the parts are the length chunks
    of the queries and of the passages, loss_fn(q, p) gets the full (B, H) and (B*n, H) embeddings.
    Returns (loss, q, p), detached."""
    from .dist import unwrap

    inner = unwrap(model)
    inner_chunk, inner.chunk_tokens = inner.chunk_tokens, 0  # chunks are cut here, not again inside
    try:
        parts = _chunk_parts("q", q_batch, chunk_tokens) + _chunk_parts("p", p_batch, chunk_tokens)
        rows = {"q": q_batch["attention_mask"].shape[0], "p": p_batch["attention_mask"].shape[0]}
        loss, out = grad_cache(model, parts, rows,
                               lambda m, name, b: m(q_batch=b)[0] if name == "q" else m(p_batch=b)[1],
                               lambda full: loss_fn(full["q"], full["p"]), sync)
    finally:
        inner.chunk_tokens = inner_chunk
    return loss, out["q"], out["p"]


def grad_cache_reranker(model, batch, loss_fn, chunk_tokens, sync=True):
    """GradCache for a cross-encoder: `model` is the wrapped CrossEncoder, the parts are the length
    chunks of the (query, passage) pairs, loss_fn(scores) gets all (B*n,) scores. Returns (loss, scores),
    detached."""
    from .dist import unwrap

    inner = unwrap(model)
    inner_chunk, inner.chunk_tokens = inner.chunk_tokens, 0
    try:
        loss, out = grad_cache(model, _chunk_parts("s", batch, chunk_tokens), {"s": batch["attention_mask"].shape[0]},
                               lambda m, name, b: m(b), lambda full: loss_fn(full["s"]), sync)
    finally:
        inner.chunk_tokens = inner_chunk
    return loss, out["s"]

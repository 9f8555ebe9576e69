"""Tokenize and pad: (queries, passages) for bi-encoders, templated pairs for rerankers.

Each side pads to the longest sequence in its own batch (optionally rounded up to a multiple
of 8 for tensor cores), never to the max length.
"""


def tokenize(tokenizer, texts, max_length, prefix="", pad_to_multiple_of=None):
    """Tokenize `texts` (with an optional prefix such as "query: ") to a padded batch of tensors."""
    texts = [prefix + t for t in texts] if prefix else list(texts)
    return tokenizer(
        texts,
        max_length=max_length,
        truncation=True,
        padding="longest",
        pad_to_multiple_of=pad_to_multiple_of or None,
        return_tensors="pt",
    )


def collate_biencoder(tokenizer, queries, groups, query_max_length, passage_max_length,
                      query_prefix="", passage_prefix="", pad_to_multiple_of=None):
    """Batch B queries and their groups of n passages each.

    Passages are flattened query-major: [q0_pos, q0_neg1, ..., q1_pos, ...], so the positive of
    query i sits at row i * n_passages.  Returns (q_batch (B, Lq), p_batch (B*n, Lp)).
    """
    n = len(groups[0])
    if any(len(g) != n for g in groups):
        raise ValueError(f"all groups must have the same size; got sizes {sorted({len(g) for g in groups})}")
    if len(queries) != len(groups):
        raise ValueError(f"{len(queries)} queries but {len(groups)} groups")
    passages = [p for g in groups for p in g]
    q_batch = tokenize(tokenizer, queries, query_max_length, query_prefix, pad_to_multiple_of)
    p_batch = tokenize(tokenizer, passages, passage_max_length, passage_prefix, pad_to_multiple_of)
    return q_batch, p_batch

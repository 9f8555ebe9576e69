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


DEFAULT_TEMPLATE = "question:{query} \n \n passage:{passage}"


def _split_template(template):
    if template.count("{passage}") != 1 or template.count("{query}") != 1:
        raise ValueError(f"--prompt-template must contain {{query}} and {{passage}} once each: {template!r}")
    head, tail = template.split("{passage}")
    return head, tail


def special_tokens_around(tokenizer):
    """(prefix, suffix) ids the tokenizer adds around one sequence, e.g. ([CLS], [SEP]) or ([BOS], [])."""
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i], full[i + len(bare):]
    raise ValueError(f"{type(tokenizer).__name__}: cannot locate the special tokens it adds")


def encode_pair(tokenizer, query, passage, template, max_length, append_eos=False, specials=None):
    """Token ids of one templated (query, passage) pair, at most `max_length` long.

    The passage is truncated first: the template around it and the query are kept whole while
    they fit, so a long passage never pushes the query out. Only a query too long to fit on its
    own is cut (from its end). The pieces are tokenized separately and joined, and the same
    function serves training and evaluation, so both see identical ids.
    """
    head_tpl, tail_tpl = _split_template(template)
    tok = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"] if s else []  # noqa: E731
    head, body, tail = tok(head_tpl.replace("{query}", query)), tok(passage), tok(tail_tpl.replace("{query}", query))
    eos = [tokenizer.eos_token_id] if append_eos and tokenizer.eos_token_id is not None else []
    prefix, suffix = specials or special_tokens_around(tokenizer)
    budget = max_length - len(prefix) - len(suffix) - len(eos)
    room = budget - len(head) - len(tail)
    if room < 0:  # the query part alone is too long: drop the passage, cut the query part
        head, body = head[:max(0, budget - len(tail))], []
        tail = tail[:max(0, budget - len(head))]
    else:
        body = body[:room]
    return prefix + head + body + tail + suffix + eos


def collate_rerank(tokenizer, queries, groups, template=DEFAULT_TEMPLATE, max_length=512,
                   append_eos=False, pad_to_multiple_of=None):
    """Batch B queries x n passages as B*n templated pairs, query-major, positive first in each group.

    Padding follows `tokenizer.padding_side` (left or right). Labels are not returned: the loss
    derives them from the batch shape (n_queries = n_pairs // n_passages).
    """
    specials = special_tokens_around(tokenizer)
    ids = [encode_pair(tokenizer, q, p, template, max_length, append_eos, specials)
           for q, g in zip(queries, groups) for p in g]
    return tokenizer.pad({"input_ids": ids}, padding="longest", pad_to_multiple_of=pad_to_multiple_of or None,
                         return_tensors="pt")

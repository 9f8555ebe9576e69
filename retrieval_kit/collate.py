"""Tokenize and pad: (queries, passages) for bi-encoders, (query, passage) pairs for rerankers (each pair's
ids as its layout renders them: pairs.py).

Each side pads to the longest sequence in its own batch (optionally rounded up to a multiple
of 8 for tensor cores), never to the max length.
"""

import torch

from .chunking import chunk_batch
from .pairs import PAIR, pair_layout

class PooledWithout(str):
    """A prefix (prompt) that the pooling leaves out, as a sentence-transformers Pooling with
    `include_prompt: false` does: the encoder still reads its tokens, the embedding is pooled from
    the rest (st_format.resolve_biencoder_settings makes the prefixes of such a model this type)."""

    excluded = True


def prompt_length(tokenizer, prompt):
    """Tokens of `prompt` at the start of a tokenized text, as sentence-transformers counts them: the
    prompt tokenized alone, less a trailing special token ([SEP], EOS); the leading one ([CLS]) counts."""
    ids = tokenizer([prompt])["input_ids"][0]
    return len(ids) - (1 if ids and ids[-1] in set(tokenizer.all_special_ids) else 0)


def tokenize(tokenizer, texts, max_length, prefix="", pad_to_multiple_of=None, side=None):
    """Tokenize `texts` (with an optional prefix such as "query: ", left off a text that carries its
    own prompt: textstore.PromptedQuery) to a padded batch of tensors. A PooledWithout prefix adds
    "pool_mask": the attention mask with the prefix's tokens off, which the pooling then uses. A
    `side` (a head's, head.sides: `side.apply(batch)` adds what the head reads, and with `side.fixed_width`
    every text is padded to max_length) is applied last."""
    got = [not getattr(t, "prompted", False) for t in texts]
    texts = [prefix + t if g else t for t, g in zip(texts, got)] if prefix else list(texts)
    if side is not None and side.fixed_width:  # (e.g. ColBERT's query expansion)
        return side.apply(tokenizer(texts, max_length=max_length, truncation=True, padding="max_length",
                                    return_tensors="pt"))
    if pad_to_multiple_of and max_length % pad_to_multiple_of:
        # transformers refuses to truncate to a length that is not a multiple of the padding's: truncate,
        # then round the padding up (the width may pass max_length; no row's tokens do)
        batch = tokenizer.pad(tokenizer(texts, max_length=max_length, truncation=True), padding="longest",
                              pad_to_multiple_of=pad_to_multiple_of, return_tensors="pt")
    else:
        batch = tokenizer(
            texts,
            max_length=max_length,
            truncation=True,
            padding="longest",
            pad_to_multiple_of=pad_to_multiple_of or None,
            return_tensors="pt",
        )
    if prefix and getattr(prefix, "excluded", False):
        n = prompt_length(tokenizer, prefix)
        mask = batch["attention_mask"]
        first = mask.to(torch.int32).argmax(dim=1, keepdim=True)  # left padding: where each row starts
        positions = torch.arange(mask.shape[1]).unsqueeze(0)
        off = (positions < first + n) & torch.tensor(got).unsqueeze(1)  # a row with its own prompt pools all
        batch["pool_mask"] = mask.masked_fill(off, 0)
    return side.apply(batch) if side is not None else batch


def collate_biencoder(tokenizer, queries, groups, query_max_length, passage_max_length,
                      query_prefix="", passage_prefix="", pad_to_multiple_of=None, sides=None):
    """Batch B queries and their groups of n passages each.

    Passages are flattened query-major: [q0_pos, q0_neg1, ..., q1_pos, ...], so the positive of
    query i sits at row i * n_passages.  Returns (q_batch (B, Lq), p_batch (B*n, Lp)). `sides`:
    {"q", "p"}: how the head tokenizes each side (head.sides), or None.
    """
    n = len(groups[0])
    if any(len(g) != n for g in groups):
        raise ValueError(f"all groups must have the same size; got sizes {sorted({len(g) for g in groups})}")
    if len(queries) != len(groups):
        raise ValueError(f"{len(queries)} queries but {len(groups)} groups")
    passages = [p for g in groups for p in g]
    sides = sides or {}
    q_batch = tokenize(tokenizer, queries, query_max_length, query_prefix, pad_to_multiple_of, sides.get("q"))
    p_batch = tokenize(tokenizer, passages, passage_max_length, passage_prefix, pad_to_multiple_of, sides.get("p"))
    return q_batch, p_batch


def collate_rerank(tokenizer, queries, groups, template=PAIR, max_length=512,
                   append_eos=False, pad_to_multiple_of=None, layout=None):
    """Batch B queries x n passages as B*n pairs, query-major, positive first in each group.

    `template` is PAIR (the tokenizer's pair encoding, with token type ids where the model takes
    them) or a prompt template (rendered as one string: TemplateLayout). Padding follows
    `tokenizer.padding_side` (left or right). Labels are not returned: the loss derives them from
    the batch shape (n_queries = n_pairs // n_passages).
    """
    layout = layout or pair_layout(tokenizer, template, append_eos)
    rows = layout.encode_pairs([q for q, g in zip(queries, groups) for _ in g], [p for g in groups for p in g],
                               max_length)
    features = {"input_ids": [r[0] for r in rows]}
    if layout.with_types:
        features["token_type_ids"] = [r[1] for r in rows]
    return tokenizer.pad(features, padding="longest", pad_to_multiple_of=pad_to_multiple_of or None,
                         return_tensors="pt")


def text_keys(texts):
    """A 64-bit key per text (blake2b of its UTF-8 bytes): equal texts, equal keys, on every rank
    and in every process (Python's hash() is salted per process)."""
    import hashlib

    return torch.tensor([int.from_bytes(hashlib.blake2b(t.encode("utf-8"), digest_size=8).digest(), "little",
                                        signed=True) for t in texts], dtype=torch.int64)


def biencoder_inputs(queries, groups, *, tokenizer, query_max_length, passage_max_length, query_prefix="",
                     passage_prefix="", pad_to_multiple_of=None, chunk_tokens=0, same_chunk_count=False, sides=None):
    """One bi-encoder micro-batch as BiEncoder takes it: {"q": Chunked, "p": Chunked}, each cut into
    length chunks of at most `chunk_tokens` padded tokens (chunking.chunk_batch), of widths rounded
    to `pad_to_multiple_of`; `same_chunk_count`: as many chunks on every rank (FSDP2). Also
    "p_keys", each passage's text_keys, for the loss's duplicate masking, and "q_keys", each query's, for a
    teacher file's lookup (embed.TeacherFile; neither a model input). `sides`:
    {"q", "p"}: how the head tokenizes each side (head.sides), or None."""
    q, p = collate_biencoder(tokenizer, queries, groups, query_max_length, passage_max_length, query_prefix,
                             passage_prefix, pad_to_multiple_of, sides)
    return {"q": chunk_batch(q, chunk_tokens, pad_to_multiple_of, query_max_length if same_chunk_count else None),
            "p": chunk_batch(p, chunk_tokens, pad_to_multiple_of, passage_max_length if same_chunk_count else None),
            "p_keys": text_keys([t for g in groups for t in g]), "q_keys": text_keys(queries)}


def rerank_inputs(queries, groups, *, tokenizer, layout, max_length, pad_to_multiple_of=None, chunk_tokens=0,
                  same_chunk_count=False):
    """One reranker micro-batch as CrossEncoder takes it: {"pairs": Chunked}, query-major pairs,
    chunked as in biencoder_inputs."""
    batch = collate_rerank(tokenizer, queries, groups, max_length=max_length, pad_to_multiple_of=pad_to_multiple_of,
                           layout=layout)
    return {"pairs": chunk_batch(batch, chunk_tokens, pad_to_multiple_of, max_length if same_chunk_count else None)}

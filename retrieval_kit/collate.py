"""Tokenize and pad: (queries, passages) for bi-encoders, (query, passage) pairs for rerankers.

Each side pads to the longest sequence in its own batch (optionally rounded up to a multiple
of 8 for tensor cores), never to the max length.
"""

import re

import torch

from .chunking import chunk_batch

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


PAIR = "pair"  # --prompt-template value: the tokenizer's own (query, passage) pair encoding
DEFAULT_TEMPLATE = "question:{query} \n \n passage:{passage}"  # the default for decoders
QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# --prompt-template presets. qwen3: Qwen3-Reranker's layout (its model card): a system line, the user turn
# with <Instruct>, <Query> and <Document>, and the assistant prefix after which "yes" / "no" is scored
TEMPLATE_PRESETS = {
    "qwen3": ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
              f"<Instruct>: {QWEN3_INSTRUCTION}\n<Query>: {{query}}\n<Document>: {{passage}}<|im_end|>\n"
              "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
}


def parse_template(template):
    """[("text", str) | ("query", None) | ("passage", None)] pieces of a prompt template, in order."""
    if template.count("{passage}") != 1 or template.count("{query}") != 1:
        raise ValueError(f"--prompt-template must contain {{query}} and {{passage}} once each: {template!r}")
    pieces = re.split(r"(\{query\}|\{passage\})", template)
    return [(p[1:-1], None) if p in ("{query}", "{passage}") else ("text", p) for p in pieces if p]


def _find(seq, sub, start=0):
    for i in range(start, len(seq) - len(sub) + 1):
        if seq[i:i + len(sub)] == sub:
            return i
    return -1


def special_tokens_around(tokenizer):
    """(prefix, suffix) ids the tokenizer adds around one sequence, e.g. ([CLS], [SEP]) or ([BOS], [])."""
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    i = _find(full, bare)
    if i < 0:
        raise ValueError(f"{type(tokenizer).__name__}: cannot locate the special tokens it adds")
    return full[:i], full[i + len(bare):]


_warned = set()


def warn_once(key, message):
    """Print `message` to stderr the first time `key` is seen in this process."""
    import sys

    if key not in _warned:
        _warned.add(key)
        print(f"warning: {message}", file=sys.stderr, flush=True)


QUERY_CUT = ("a query alone takes more than --rerank-max-length {} tokens in its pair: its end is cut and "
             "its passage dropped (said once)")


class PairLayout:
    """The tokenizer's own pair encoding (`--prompt-template pair`): fixed id runs around a query slot
    and a passage slot, found by encoding a probe pair (`[CLS] q [SEP] p [SEP]` with token type ids
    0 / 1 for BERT), the query and the passage each tokenized on their own, as a tokenizer encodes a
    pair; so `tokenizer(query, passage)` gives the same ids (with an appended EOS, the export's pair
    post-processor adds it: `pair_post_processor`).
    """

    def __init__(self, tokenizer, segments, with_types, eos_id=None):
        self.tokenizer = tokenizer
        self.segments = segments  # [("ids", ids, types) | ("query", None, type) | ("passage", None, type)]
        self.with_types = with_types
        if eos_id is not None:  # appended after everything, with the type id of the last token
            last = next((s[2][-1] if s[0] == "ids" else s[2]) for s in reversed(segments) if s[0] != "ids" or s[1])
            self.segments = segments + [("ids", [eos_id], [last])]
        self.n_fixed = sum(len(s[1]) for s in self.segments if s[0] == "ids")

    def check(self, max_length):
        """One sentence when the fixed tokens alone leave no room for text at `max_length`."""
        self.encode([], [], max_length)

    def encode(self, q_ids, p_ids, max_length):
        """(ids, type ids) of one pair at most `max_length` long. The passage is cut first; the query
        is kept whole while it fits and cut from its end (dropping the passage) only when it alone is too long."""
        budget = max_length - self.n_fixed
        if budget < 1:
            raise ValueError(f"--rerank-max-length {max_length} leaves no room for text: the template and special "
                             f"tokens alone take {self.n_fixed} tokens")
        if len(q_ids) >= budget:
            if len(q_ids) > budget:
                warn_once("query", QUERY_CUT.format(max_length))
            q_ids, p_ids = q_ids[:budget], []
        else:
            p_ids = p_ids[:budget - len(q_ids)]
        ids, types = [], []
        for kind, seg, t in self.segments:
            if kind == "ids":
                ids += seg
                types += t
            else:
                part = q_ids if kind == "query" else p_ids
                ids += part
                types += [t] * len(part)
        return ids, types

    def encode_pairs(self, queries, passages, max_length):
        """[(ids, type ids)] of the pairs (queries[i], passages[i]); a query repeated over its group is
        tokenized once."""
        unique = list(dict.fromkeys(queries))
        q_ids = dict(zip(unique, tokenize_bare(self.tokenizer, unique, max_length)))
        p_ids = tokenize_bare(self.tokenizer, passages, max_length)
        return [self.encode(q_ids[q], p, max_length) for q, p in zip(queries, p_ids)]


class TemplateLayout:
    """A prompt template rendered as the model's own tools render it: the query and the passage put
    into the template's text, the string tokenized as one (so byte-level BPE merges across each seam
    as it does for a user who formats the string and calls the tokenizer), inside the tokenizer's
    single-sequence special tokens (and an appended EOS).

    Too long for `max_length`: the passage's end is cut first; should the query alone not fit, the
    tokens just before the template's tail (the query's end, then the text between it and the
    passage) go next, with one warning. The tail - the tokens after the last slot, such as the
    assistant prefix an LM head scores after - is never cut. For a template whose passage comes last
    this is `ids[:max_length - len(tail)] + tail`: what sentence-transformers does to a chat-template
    pair (it restores the suffix after truncating) and what Qwen3-Reranker's reference code does
    (prefix + the body cut to fit + suffix).
    """

    def __init__(self, tokenizer, template, eos_id=None):
        self.tokenizer = tokenizer
        self.template = template
        self.pieces = parse_template(template)
        self.with_types = "token_type_ids" in tokenizer.model_input_names
        self.before, after = special_tokens_around(tokenizer)
        self.after = after + ([eos_id] if eos_id is not None else [])
        self.n_fixed = len(self.encode_pairs([""], [""], None)[0][0])

    def passage_first(self):
        """Does the template put the passage before the query?"""
        slots = [kind for kind, _ in self.pieces if kind != "text"]
        return slots[0] == "passage"

    def render(self, query, passage):
        """(text, (query start, end), (passage start, end)): the template with both filled in, and
        where each lies in it (characters)."""
        text, spans = "", {}
        for kind, piece in self.pieces:
            value = piece if kind == "text" else (query if kind == "query" else passage)
            if kind != "text":
                spans[kind] = (len(text), len(text) + len(value))
            text += value
        return text, spans["query"], spans["passage"]

    def check(self, max_length):
        if max_length - self.n_fixed < 1:
            raise ValueError(f"--rerank-max-length {max_length} leaves no room for text: the template and special "
                             f"tokens alone take {self.n_fixed} tokens")

    def encode_pairs(self, queries, passages, max_length):
        """[(ids, type ids)] of the pairs (queries[i], passages[i]), each at most `max_length` long
        (None: uncut)."""
        rendered = [self.render(q, p) for q, p in zip(queries, passages)]
        enc = self.tokenizer([r[0] for r in rendered], add_special_tokens=False, return_offsets_mapping=True,
                             verbose=False)
        out = []
        for (text, q_span, p_span), ids, offsets in zip(rendered, enc["input_ids"], enc["offset_mapping"]):
            if max_length is not None:
                ids = self._cut(ids, offsets, q_span, p_span, max_length - len(self.before) - len(self.after))
            ids = self.before + ids + self.after
            out.append((ids, [0] * len(ids)))
        return out

    def _cut(self, ids, offsets, q_span, p_span, room):
        excess = len(ids) - room
        if excess <= 0:
            return ids
        first_after = lambda char: next((i for i, (a, _) in enumerate(offsets) if a >= char), len(ids))  # noqa: E731
        p_first = first_after(p_span[0])  # the passage's tokens: [p_first, p_end)
        p_end = max(p_first, first_after(p_span[1]))
        k = min(excess, p_end - p_first)
        tail = first_after(max(q_span[1], p_span[1]))  # the tokens after the last slot: never cut
        ids = ids[:p_end - k] + ids[p_end:]
        tail -= k if tail >= p_end else 0  # (a passage before the query: the tail moved by k)
        rest = excess - k
        if rest > 0:  # the query alone does not fit: its end (and what stands between it and the tail) goes
            warn_once("query", QUERY_CUT.format(room + len(self.before) + len(self.after)))
            ids = ids[:tail - rest] + ids[tail:]
        return ids


def pair_layout(tokenizer, template=PAIR, append_eos=False):
    """The layout of `template` for `tokenizer`: PairLayout for PAIR (the tokenizer's pair encoding),
    TemplateLayout for a string with {query} and {passage}."""
    eos = tokenizer.eos_token_id if append_eos else None
    if template != PAIR:
        return TemplateLayout(tokenizer, template, eos)
    with_types = "token_type_ids" in tokenizer.model_input_names
    qa, pb = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("x", "y"))
    enc = tokenizer("x", "y", return_token_type_ids=True)
    full, ftypes = enc["input_ids"], enc["token_type_ids"]
    i = _find(full, qa)
    j = _find(full, pb, i + len(qa)) if i >= 0 else -1
    if j < 0:
        raise ValueError(f"{type(tokenizer).__name__}: cannot locate the query and passage in its pair encoding")
    seg = lambda a, b: ("ids", full[a:b], ftypes[a:b])  # noqa: E731
    segments = [seg(0, i), ("query", None, ftypes[i]), seg(i + len(qa), j), ("passage", None, ftypes[j]),
                seg(j + len(pb), len(full))]
    return PairLayout(tokenizer, segments, with_types, eos)


def rerank_layout(tokenizer, settings):
    """The layout to score with: the saved template of a reranker's settings (an export's tokenizer renders
    it as training did)."""
    return pair_layout(tokenizer, settings.get("prompt_template", PAIR), settings.get("append_eos", False))


def tokenize_bare(tokenizer, texts, max_length):
    """Ids without special tokens, cut at max_length (so no over-length warning for long passages)."""
    return tokenizer(list(texts), add_special_tokens=False, truncation=True, max_length=max_length)["input_ids"]


def encode_pair(tokenizer, query, passage, template=PAIR, max_length=512, append_eos=False, layout=None):
    """Token ids of one (query, passage) pair, at most `max_length` long."""
    layout = layout or pair_layout(tokenizer, template, append_eos)
    return layout.encode_pairs([query], [passage], max_length)[0][0]


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


def pair_post_processor(tokenizer, layout):
    """A `tokenizers` TemplateProcessing whose pair encoding is `layout` (and whose single-text encoding
    is the tokenizer's own), so `tokenizer(query, passage)` gives the kit's ids: each fixed run of ids
    becomes one multi-id special token of its type id."""
    from tokenizers import processors

    specials, pair = [], []
    for kind, ids, t in layout.segments:
        if kind != "ids":
            pair.append(f"${'A' if kind == 'query' else 'B'}:{t}")
            continue
        start = 0
        for end in range(1, len(ids) + 1):  # split the run where the type id changes
            if end == len(ids) or t[end] != t[start]:
                name = f"[rk{len(specials)}]"
                specials.append({"id": name, "ids": ids[start:end], "tokens": tokenizer.convert_ids_to_tokens(ids[start:end])})
                pair.append(f"{name}:{t[start]}")
                start = end
    prefix, suffix = special_tokens_around(tokenizer)
    single = []
    for ids, where in ((prefix, "pre"), (suffix, "post")):
        if ids:
            name = f"[rk_{where}]"
            specials.append({"id": name, "ids": ids, "tokens": tokenizer.convert_ids_to_tokens(ids)})
            single.append(name)
    single.insert(1 if prefix else 0, "$A")
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair), special_tokens=specials)


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
    "p_keys", each passage's text_keys, for the loss's duplicate masking (not a model input). `sides`:
    {"q", "p"}: how the head tokenizes each side (head.sides), or None."""
    q, p = collate_biencoder(tokenizer, queries, groups, query_max_length, passage_max_length, query_prefix,
                             passage_prefix, pad_to_multiple_of, sides)
    return {"q": chunk_batch(q, chunk_tokens, pad_to_multiple_of, query_max_length if same_chunk_count else None),
            "p": chunk_batch(p, chunk_tokens, pad_to_multiple_of, passage_max_length if same_chunk_count else None),
            "p_keys": text_keys([t for g in groups for t in g])}


def rerank_inputs(queries, groups, *, tokenizer, layout, max_length, pad_to_multiple_of=None, chunk_tokens=0,
                  same_chunk_count=False):
    """One reranker micro-batch as CrossEncoder takes it: {"pairs": Chunked}, query-major pairs,
    chunked as in biencoder_inputs."""
    batch = collate_rerank(tokenizer, queries, groups, max_length=max_length, pad_to_multiple_of=pad_to_multiple_of,
                           layout=layout)
    return {"pairs": chunk_batch(batch, chunk_tokens, pad_to_multiple_of, max_length if same_chunk_count else None)}

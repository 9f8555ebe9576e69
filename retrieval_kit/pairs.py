"""A reranker's (query, passage) pairs as token ids: the tokenizer's own pair encoding (PAIR) or a prompt
template rendered as one string (TemplateLayout: Qwen3-Reranker's chat layout, FlagEmbedding's LLM
rerankers), the query kept whole where the pair is cut (query-preserving truncation), and the template the
run and each --train-mix file uses (resolve_template, run_layout, file_layout). collate.py pads them.
"""

import re

from .models import check_max_lengths, find_subsequence, is_decoder_only, special_tokens_around


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
    i = find_subsequence(full, qa)
    j = find_subsequence(full, pb, i + len(qa)) if i >= 0 else -1
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



# ----- the run's templates (train_reranker.py) ---------------------------------------------------

def resolve_template(template, config):
    """--prompt-template (or a --train-mix line's "prompt_template"): 'auto' = 'pair' for encoders,
    the default template for decoders; a preset's name (TEMPLATE_PRESETS) = its template."""
    if template == "auto":
        return DEFAULT_TEMPLATE if is_decoder_only(config) else PAIR
    return TEMPLATE_PRESETS.get(template, template)


def run_layout(tokenizer, template, append_eos, max_length, config, multiple):
    """The run's pair layout (--prompt-template), checked against --rerank-max-length before any
    step (a template longer than the pairs may be; pairs longer than the model's positions), or one
    sentence naming the flag at fault."""
    check_max_lengths(config, tokenizer, {"--rerank-max-length": max_length}, multiple)
    try:
        layout = pair_layout(tokenizer, template, append_eos)
        layout.check(max_length)
        return layout
    except ValueError as e:
        raise SystemExit(str(e)) from None


def file_layout(tokenizer, file, config, layout, append_eos):
    """The pair layout of one training file: the run's, or its --train-mix line's "prompt_template"
    ('pair', 'auto' or a template holding {query} and {passage})."""
    template = file.prompts.get("prompt_template")
    if template is None:
        return layout
    try:
        return pair_layout(tokenizer, resolve_template(template, config), append_eos)
    except ValueError as e:
        raise SystemExit(f"--train-mix: {file.path}: {e}".replace("--prompt-template", '"prompt_template"')) from None

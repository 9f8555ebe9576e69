"""The kinds of model the kit trains, one module each, the same plain functions in each; the kind is
chosen once by the caller - from --head, or from the spec st_format reads from the model dir - and
spelled one way: the module's NAME, the value of --head.

    head = heads.get(settings["head"])          # the only lookup; nothing else branches on the kind
    model = head.load(path, dtype, spec=spec)   # the backbone with the head on it

Embedding heads (train_biencoder.py; the step runs `head.embedder(...)`, scored by `head.scores`):

    name            module          representation of a text                    corpus stored as
    single-vector   single_vector   one pooled (normalized) vector (B, H)       fp32 (N, H)
    multi-vector    multi_vector    projected token vectors + mask (B, W, d+1)  bf16 (N, W, d+1), MaxSim
    sparse          sparse          log(1 + relu(vocabulary logits)), max (B, V) sparse COO (N, V) non-zeros
    csr             csr             top k of a sparse auto-encoder's latents    sparse COO (N, D) non-zeros
                                    over the pooled vector (B, D)

  NAME, FLAGS       its name; {flag dest: flags.Flag} of the flags only this head takes: their default,
                    name, type and help, whether a resume may change them (cli.add_head_args adds them to
                    the parser; cli.head_flags refuses another head's, fills in these defaults)
  SETTINGS          {setting: default} it keeps beyond st_format.SETTING_KEYS (multi-vector: its tokenization)
  TEMPERATURE       the InfoNCE temperature it trains at by default
  load(path, dtype, *, spec, meta, dim, seed, **load_kw)   the backbone with the head, from a plain HF dir
                    or a dir of this kind (its spec: read_spec); `meta`: on the meta device (FSDP2)
  lora_trained(model)            what LoRA trains in full beside the adapters (a fresh projection, an
                                 untied vocabulary head), [] for none
  embedding_size(model)          the size of its vectors (a token's, for multi-vector)
  prepare(tokenizer, model, settings)   the tokenizer made ready for the head; returns settings to record
  serving(settings)              the settings inference reads where training's differ (one vector: queries
                                 up to the passages' max length, as sentence-transformers reads them)
  embedder(model, settings, multiple)   the module the step runs: model(q=batch, p=batch) -> {"q", "p"}
                                 reps; a batch is a tokenized dict or a chunking.Chunked
  sides(tokenizer, settings)     how each side is tokenized beyond the prefix ({"q", "p"}: a side object or None)
  scores(q, p, n_passages, in_batch)   fp32 training scores: (B, P) in-batch, else (B, n)
  pair_scores(q, p)              (N,) scores of the pairs (q[i], p[i]) (dense reps)
  store(reps, width, dtype)      one batch's reps as the rows a corpus keeps (on the CPU)
  stack(rows)                    the corpus of those rows; select(stored, index): rows of it, as stored
  as_dense(stored)               as a dense tensor (for gathers and pair scores)
  search(q, p, k)                exact top-k of dense queries against a stored corpus (shard), in blocks
  corpus_stats(q, p)             what evaluation reports of a corpus beyond the metrics ({} for none)
  empty_rows(stored)             how many stored vectors are all zero (a sparse model that activates nothing)
  regularizer(flags, state, count_scale, max_steps)   a term added to the loss (sparse: FLOPS) or None
  split_export(weights)          pop the head's own module weights from the model's state dict
  start_from_data(model, texts, tokenizer)   set what starts from the training passages (sparse: the IDF)
  write_export(stage, model, settings, head_weights, out_dir)   its sentence-transformers files ->
                                 {"files": bool, "warnings": [...]}
  memory_note(model)             a line for python -m retrieval_kit.plan, or None

Reranker heads (train_reranker.py; the step runs `head.scorer(...)`, a logit per pair):

    name        module      score of a (query, passage) pair
    classifier  classifier  the one logit of a *ForSequenceClassification head (fresh on an encoder)
    lm          lm          logit(true word) - logit(false word) of a causal LM after the pair's last token

  NAME, FLAGS, load(path, dtype, *, meta, **load_kw), lora_trained(model), memory_note(model)   as above
  fresh_params(model)            the parameters that start untrained (--head-lr-mult scales their LR)
  finish_export(stage, settings, trust_remote_code, seq_cls)   files written from the finished dir (lm: seq_cls/)
  padding_side(flag)             the side pairs pad on (--padding-side; lm: left, it reads the last token)
  token_ids(tokenizer, words)    what the score reads of the vocabulary (lm: --lm-tokens), or None
  scorer(net, pooling, token_ids)   the module the step runs: model(pairs=batch) -> {"pairs": (n,)} fp32 logits
  kit_only_reasons(pooling, bidirectional)   why stock loaders would score the export otherwise
  write_export(stage, settings, tokenizer)   its files for CrossEncoder / AutoModelFor...Classification

A dir's part of each kind (heads own their dirs; st_format reads and writes only what all kinds share):

  read_dir(path)                 embedding heads: None for a dir of another kind, else (its sentence-
                                 transformers settings in the kit's keys, its own part: DirSpec.own)
  RECORD_FIELDS                  (optional) {key: (check, what)} of what it keeps in retrieval_kit.json
  RESUME_FIXED                   (optional) {flag dest: why} a resume cannot change (rundir.start_run)

A head writes only what it needs: a name it leaves out reads as DEFAULTS (below), the interface's defaults
in one place (lora_trained, fresh_params, dir_flags, prepare, serving, sides, stack, select, as_dense,
corpus_stats, empty_rows, regularizer, split_export, memory_note, token_ids, finish_export, SETTINGS ...).

Adding a kind: one module here with these functions, one line in KINDS, its tests (docs/architecture.md).
"""

import os

import torch

from .. import dist
from ..models import decoder_dir
from ..st_format import (KIT_DEFAULTS, SETTINGS_FILE, DirSpec, bad_field, check_hf_files, check_linear, hidden_size_of,
                         is_cross_encoder, load_settings, resolve_biencoder_settings)
from . import classifier, csr, lm, multi_vector, single_vector, sparse

KINDS = {"embedding": (single_vector, multi_vector, sparse, csr), "reranker": (classifier, lm)}  # the first: the default
DEFAULTS = {  # what a head leaves out reads as this: the defaults of the interface, in one place
    "SETTINGS": {}, "LOAD_FLAGS": (), "RECORD_FIELDS": {}, "RESUME_FIXED": {},
    "lora_trained": lambda model: [],  # nothing trained in full beside LoRA's adapters
    "fresh_params": lambda model: [],  # nothing starts untrained
    "dir_flags": lambda spec: {},  # no flag fixed by the dir
    "prepare": lambda tokenizer, model, settings: {},  # the tokenizer as it is
    "serving": lambda settings: {},  # inference reads the training settings
    "sides": lambda tokenizer, settings: {"q": None, "p": None},  # no tokenization beyond the prefix
    "stack": torch.stack, "select": lambda stored, index: stored[index], "as_dense": lambda stored: stored,  # dense rows
    "corpus_stats": lambda q, p: {}, "empty_rows": lambda stored: 0,  # (a normalized vector is never all zero)
    "regularizer": lambda flags, state, count_scale=1.0, max_steps=0: None,  # no loss term of its own
    "split_export": lambda weights: {},  # no module weights of its own
    "start_from_data": lambda model, texts, tokenizer: None,  # nothing of it set from the training data
    "memory_note": lambda model: None,  # nothing beyond the plan
    "token_ids": lambda tokenizer, words: None,  # no vocabulary rows read
    "finish_export": lambda stage, settings, trust_remote_code, seq_cls: settings,  # nothing written afterwards
}
MODULES = {m.NAME: m for group in KINDS.values() for m in group}


def _fill_defaults(modules):
    """Each of DEFAULTS that a head's module leaves out, set on it: callers read every name of the interface."""
    for module in modules:
        for name, value in DEFAULTS.items():
            if not hasattr(module, name):
                setattr(module, name, value)


_fill_defaults(MODULES.values())
EMBEDDING = tuple(m.NAME for m in KINDS["embedding"])
RERANKER = tuple(m.NAME for m in KINDS["reranker"])
READS = (multi_vector, csr, sparse, single_vector)  # the order a dir is asked whose kind it holds (most specific first)
RECORD_FIELDS = {k: v for m in MODULES.values() for k, v in m.RECORD_FIELDS.items()}
RESUME_FIXED = {k: v for m in MODULES.values() for k, v in m.RESUME_FIXED.items()}
LOAD_FLAGS = frozenset(k for m in MODULES.values() for k in m.LOAD_FLAGS)


def default(family="embedding"):
    """The module of the family's default kind (the first of KINDS[family])."""
    return KINDS[family][0]


def get(name):
    """The module of the kind `name` (one of MODULES); one sentence for an unknown name."""
    if name not in MODULES:
        raise SystemExit(f"unknown head {name!r}: the kit trains {', '.join(MODULES)}")
    return MODULES[name]


def load_args(head, values):
    """The keyword arguments of `head`'s load() among `values` (flags, or an export's settings): its LOAD_FLAGS."""
    return {k: values.get(k) for k in head.LOAD_FLAGS}


def read_spec(model_dir):
    """The dir read as a whole, before any weights load: retrieval_kit.json (st_format.load_settings, with
    every head's RECORD_FIELDS), the Hugging Face files' fields, then each embedding head asked in turn
    (READS) whether the dir is of its kind; the linear modules it brings checked against the model's width
    (config.json's hidden_size) and their own weights. One sentence naming the file and the field for
    anything wrong."""
    kit = load_settings(model_dir, RECORD_FIELDS)
    if "head" in kit and not (isinstance(kit["head"], str) and kit["head"] in MODULES):
        bad_field(os.path.join(model_dir, SETTINGS_FILE), "head", kit["head"], "one of " + ", ".join(MODULES))
    check_hf_files(model_dir)
    if kit.get("kind") == "reranker" or is_cross_encoder(model_dir):  # its modules score pairs: no embedding spec
        return DirSpec(model_dir, (kit.get("head") or RERANKER[0]) if kit.get("kind") == "reranker" else None, kit)
    found, st, own = None, {}, {}
    for head in READS:
        part = head.read_dir(model_dir)
        if part is not None:
            (st, own), found = part, head.NAME
            break
    head = kit.get("head") or found or (EMBEDDING[0] if kit.get("kind") == "biencoder" else None)
    spec = DirSpec(model_dir, head, kit, st, own)
    if spec.model_path != model_dir:  # (a Router dir: its document model in a module folder)
        check_hf_files(spec.model_path)
    hidden = hidden_size_of(spec.model_path)
    for linear, what in own.get("linear", []):
        check_linear(model_dir, linear, hidden, what)
    return spec


def resolve_head(spec, flags, defaults=None):
    """The head a bi-encoder run or tool takes, in resolve_biencoder_settings' order; EMBEDDING[0] at last."""
    return next((v["head"] for v in (flags, spec.kit, spec.st, defaults or {}) if v.get("head") is not None),
                EMBEDDING[0])


def biencoder_settings(spec, flags, training=False):
    """The embedding head and its settings - pooling, normalization, prefixes, max lengths and the head's
    own: explicit flags (not None), else the export's retrieval_kit.json, else the dir's sentence-
    transformers files (`spec`: read_spec), else the kit's defaults (a decoder's pooling: last, the token
    that has read the whole text); prints what it read from sentence-transformers files. A reranker export,
    or a dir whose own head is not the one asked for (check_dir), is one sentence. `training`: an export's
    queries at the length it was trained at (train_query_max_length), not the one it is served at."""
    defaults = {**KIT_DEFAULTS, "head": EMBEDDING[0], **({"pooling": "last"} if decoder_dir(spec.path) else {})}
    name = resolve_head(spec, flags, defaults)
    if spec.kit.get("kind") == "reranker" or name not in EMBEDDING:  # a classification head embeds nothing
        raise SystemExit(f"{spec.path}: a reranker export (its retrieval_kit.json), not a bi-encoder: pass a dir "
                         "train_biencoder.py exported (or any embedding model) where a bi-encoder is asked for")
    check_dir(spec, name)
    settings, read = resolve_biencoder_settings(spec, flags, defaults, get(name).SETTINGS, training)
    if read:
        dist.print0(read)
    return settings


def choose(spec, flags, group="embedding", training=False):
    """The kind a run or tool takes, chosen once: (its module, its settings), `group` a key of KINDS. An
    embedding model's settings resolve as biencoder_settings says (flags, the export, the dir's files, the
    defaults; --head or the dir's head); a reranker's head is `flags["head"]`, else the dir's, else the
    group's default, and its settings are what the dir's retrieval_kit.json holds. A dir of another kind is
    one sentence (check_dir)."""
    if group == "embedding":
        settings = biencoder_settings(spec, flags, training)
        return get(settings["head"]), settings
    name = flags.get("head") or (spec.head if spec.head in RERANKER else None) or RERANKER[0]
    check_dir(spec, name)
    return get(name), dict(spec.kit)


def group_of(name):
    """The key of KINDS whose heads hold `name` ("embedding" for None: the default family)."""
    return next((group for group, modules in KINDS.items() if name in (m.NAME for m in modules)), "embedding")


def family(name):
    """The heads of the same family as `name` (EMBEDDING or RERANKER): the ones a run could have chosen instead."""
    return EMBEDDING if name in EMBEDDING else RERANKER


def check_dir(spec, name):
    """A model dir given with a head it does not hold: one sentence naming both. A plain dir, or a plain
    sentence-transformers one-vector dir (all-MiniLM-L6-v2), starts any head; a dir that holds a head of
    its own (a multi-vector projection, a sparse vocabulary head, a Dense, a reranker export's head)
    continues as that head only, since another would drop or misread it."""
    if spec.head is None or spec.head == name:
        return
    if spec.head == "single-vector" and spec.own.get("dense") is None and not spec.kit.get("kind") == "reranker":
        return
    if spec.head in EMBEDDING and name in RERANKER and spec.head == "single-vector":
        return  # (a Dense after the pooling is not part of a cross-encoder's input)
    raise SystemExit(f"{spec.path} is {spec.what()}: the head it holds is {spec.head}, and --head {name} would "
                     f"{'drop' if name in family(spec.head) else 'not read'} it; pass --head {spec.head}, or start "
                     "from the model it was trained from")

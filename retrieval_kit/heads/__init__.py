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

  NAME, FLAGS       its name; {flag dest: default} of the flags only this head takes (cli.head_flags
                    refuses another head's, fills in these defaults)
  SETTINGS          {setting: default} it keeps beyond st_format.SETTING_KEYS (multi-vector: its tokenization)
  TEMPERATURE       the InfoNCE temperature it trains at by default
  load(path, dtype, *, spec, meta, dim, seed, **load_kw)   the backbone with the head, from a plain HF dir
                    or a dir of this kind (its spec: st_format.read_spec); `meta`: on the meta device (FSDP2)
  lora_trained(model)            what LoRA trains in full beside the adapters (a fresh projection, an
                                 untied vocabulary head), [] for none
  embedding_size(model)          the size of its vectors (a token's, for multi-vector)
  prepare(tokenizer, model, settings)   the tokenizer made ready for the head; returns settings to record
  serving(settings)              the settings inference reads where training's differ (one vector: queries
                                 up to the passages' max length, as sentence-transformers reads them)
  embedder(model, settings, multiple)   the module the step runs: model(q=batch, p=batch) -> {"q", "p"}
                                 reps; a batch is a tokenized dict or a chunking.Chunked
  sides(tokenizer, settings)     how each side is tokenized beyond the prefix ({"q", "p"}: collate.MaxSimSide or None)
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

Adding a kind: one module here with these functions, one line in MODULES, its tests (docs/architecture.md).
"""

import importlib

MODULES = {"single-vector": "single_vector", "multi-vector": "multi_vector", "sparse": "sparse",  # embedding heads
           "classifier": "classifier", "lm": "lm"}  # reranker heads
EMBEDDING = ("single-vector", "multi-vector", "sparse")  # the first: the default bi-encoder head
RERANKER = ("classifier", "lm")  # the first: the default reranker head
SINGLE_VECTOR, MULTI_VECTOR, SPARSE = EMBEDDING  # the names, for a dir's spec (st_format) to say what it holds
CLASSIFIER, LM = RERANKER


def get(name):
    """The module of the kind `name` (one of MODULES); one sentence for an unknown name."""
    if name not in MODULES:
        raise SystemExit(f"unknown head {name!r}: the kit trains {', '.join(MODULES)}")
    return importlib.import_module(f"{__name__}.{MODULES[name]}")


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
    if spec.head == "single-vector" and spec.dense is None and not spec.kit.get("kind") == "reranker":
        return
    if spec.head in EMBEDDING and name in RERANKER and spec.head == "single-vector":
        return  # (a Dense after the pooling is not part of a cross-encoder's input)
    raise SystemExit(f"{spec.path} is {spec.what()}: the head it holds is {spec.head}, and --head {name} would "
                     f"{'drop' if name in family(spec.head) else 'not read'} it; pass --head {spec.head}, or start "
                     "from the model it was trained from")

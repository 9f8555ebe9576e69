"""The sentence-transformers model-dir format for bi-encoders: read the settings a dir declares,
and write them beside an export, so `SentenceTransformer(dir)` embeds as the kit does.

A sentence-transformers dir is a plain Hugging Face dir plus
    modules.json                       Transformer -> Pooling (1_Pooling/config.json) [-> Normalize]
    sentence_bert_config.json          max_seq_length (sentence-transformers >= 6 also reads the
                                       tokenizer's model_max_length)
    config_sentence_transformers.json  prompts ("query", "document"), similarity_fn_name
The files are written in the layout every sentence-transformers version since 2.x reads (the one
all-MiniLM-L6-v2 ships with); 6.x reads it too.

Settings resolve in this order: explicit flags, then the kit's own retrieval_kit.json (an export),
then the sentence-transformers files, then the kit's defaults (`resolve_biencoder_settings`).
"""

import json
import os
import string

SETTINGS_FILE = "retrieval_kit.json"  # the kit's own settings, beside an exported model
KIT_DEFAULTS = {"pooling": "avg", "normalize": True, "query_prefix": "", "passage_prefix": "",
                "query_max_length": 32, "passage_max_length": 128, "include_prompt": True, "head": "single-vector"}
SETTING_KEYS = tuple(KIT_DEFAULTS)
# sentence-transformers pooling modes -> the kit's
ST_POOLING = {"mean": "avg", "cls": "cls", "lasttoken": "last"}
LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
               "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
               "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
DOCUMENT_PROMPTS = ("document", "passage", "corpus")  # the names encode_document looks for, in its order


def _json(path):
    """A model dir's JSON file; one sentence naming it when it is missing or not JSON (a damaged dir)."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise SystemExit(f"{path}: cannot read it ({e.strerror or e}); copy the model dir whole again")
    except ValueError as e:
        raise SystemExit(f"{path}: not valid JSON ({e}); copy the model dir whole again")


def _pooling_mode(config, path):
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [m for k, m in LEGACY_KEYS.items() if config.get(k)]
        mode = modes[0] if len(modes) == 1 else modes
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if mode not in ST_POOLING:
        raise SystemExit(f"{path}: pooling {mode!r} is not one the kit trains ({', '.join(ST_POOLING)}); "
                         "pass --pooling avg|cls|last to choose one")
    return ST_POOLING[mode]


def read_st_settings(model_dir):
    """The bi-encoder settings a sentence-transformers dir declares ({} for a dir without modules.json),
    as the kit's keys: pooling, normalize, query_prefix, passage_prefix, query/passage_max_length; a
    multi-vector dir's (MultiVectorEncoder, PyLate, Stanford ColBERT: read_multi_vector) with its head,
    query_expansion and skiplist_words."""
    multi = read_multi_vector(model_dir)
    if multi is not None:  # token vectors: per-task lengths, prompts (markers first), expansion, skiplist
        max_len = _max_length(model_dir)
        return {**({"query_max_length": max_len, "passage_max_length": max_len} if max_len else {}),
                **multi["settings"]}
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return {}
    out = {"normalize": False}
    if read_sparse(model_dir):  # a SparseEncoder (SPLADE): vocabulary-sized vectors, dot product
        out.update(head="sparse")
    for m in _json(modules_path):
        kind = m.get("type", "").rsplit(".", 1)[-1]
        if kind == "SpladePooling":
            continue
        if kind == "Pooling":
            path = os.path.join(model_dir, m.get("path", ""), "config.json")
            config = _json(path)
            out["pooling"] = _pooling_mode(config, path)
            if config.get("include_prompt") is False:  # the prompt's tokens are not pooled
                out["include_prompt"] = False
        elif kind == "Normalize":
            out["normalize"] = True
        elif kind not in ("Transformer", "Dense"):  # a Dense rides with the model (read_st_dense)
            raise SystemExit(_unsupported(model_dir, modules_path, m, kind))
    max_len = _max_length(model_dir)
    if max_len:
        out["query_max_length"] = out["passage_max_length"] = max_len
    st_config = os.path.join(model_dir, "config_sentence_transformers.json")
    prompts = {}
    if os.path.isfile(st_config):
        prompts = _json(st_config).get("prompts") or {}
    if "query" in prompts:
        out["query_prefix"] = prompts["query"]
    doc = next((n for n in DOCUMENT_PROMPTS if n in prompts), None)
    if doc:
        out["passage_prefix"] = prompts[doc]
    return out


def _max_length(model_dir):
    """A sentence-transformers dir's one max length: sentence_bert_config.json's max_seq_length, else the
    tokenizer's model_max_length (not its "no limit" sentinel); None when neither says."""
    max_len = None
    sbert = os.path.join(model_dir, "sentence_bert_config.json")
    if os.path.isfile(sbert):
        max_len = _json(sbert).get("max_seq_length")
    tok_config = os.path.join(model_dir, "tokenizer_config.json")
    if max_len is None and os.path.isfile(tok_config):
        max_len = _json(tok_config).get("model_max_length")
        max_len = max_len if isinstance(max_len, int) and max_len < 1_000_000 else None  # "no limit" sentinels
    return int(max_len) if max_len else None


def _unsupported(model_dir, modules_path, module, kind):
    """The sentence naming a module the kit does not reproduce (Dense, LayerNorm, WordWeights...)."""
    what = ""
    config = os.path.join(model_dir, module.get("path", ""), "config.json")
    if kind == "Dense" and os.path.isfile(config):
        c = _json(config)
        what = (f": a {c.get('in_features')} -> {c.get('out_features')} linear layer, so sentence-transformers "
                f"embeds to {c.get('out_features')} dimensions")
    return (f"{modules_path}: module {module.get('name')!r} is a {kind}{what}; the kit does not carry it (training, "
            "evaluation and the export would embed without it): fine-tune a dir without it (its modules.json "
            "listing Transformer, Pooling and Normalize only), or train it with sentence-transformers")


DENSE_ACTIVATIONS = ("torch.nn.modules.activation.Tanh", "torch.nn.modules.linear.Identity",
                     "torch.nn.modules.activation.ReLU", "torch.nn.modules.activation.GELU",
                     "torch.nn.modules.activation.Sigmoid")


MULTI_VECTOR_LAYOUT = ("Transformer", "Dense", "MultiVectorMask", "Normalize")  # MultiVectorEncoder's default
MAXSIM_KEYS = ("query_expansion", "skiplist_words")  # --head multi-vector's tokenization (collate.maxsim_sides)
MAXSIM_DEFAULTS = {"query_expansion": False, "skiplist_words": []}  # MultiVectorEncoder's defaults: neither
PUNCTUATION = list(string.punctuation)  # PyLate's and Stanford ColBERT's default skiplist


def _colbert_config(model_dir):
    """The ColBERT settings of a PyLate dir (at the top of its config_sentence_transformers.json) or of a
    Stanford-NLP ColBERT dir (its artifact.metadata), in PyLate's names; None for any other dir."""
    config = os.path.join(model_dir, "config.json")
    if os.path.isfile(config) and "HF_ColBERT" in (_json(config).get("architectures") or []):
        meta_path = os.path.join(model_dir, "artifact.metadata")
        meta = _json(meta_path) if os.path.isfile(meta_path) else {}
        return {"stanford": True, "query_prefix": (meta.get("query_token_id") or "[unused0]") + " ",
                "document_prefix": (meta.get("doc_token_id") or "[unused1]") + " ",
                "query_length": meta.get("query_maxlen") or 32, "document_length": meta.get("doc_maxlen"),
                "do_query_expansion": True, "attend_to_expansion_tokens": bool(meta.get("attend_to_mask_tokens")),
                "skiplist_words": PUNCTUATION if meta.get("mask_punctuation", True) else []}
    st_config = os.path.join(model_dir, "config_sentence_transformers.json")
    c = _json(st_config) if os.path.isfile(st_config) else {}
    pylate = ("query_prefix", "document_prefix", "do_query_expansion", "attend_to_expansion_tokens", "skiplist_words")
    if c.get("model_type") == "ColBERT" or any(k in c for k in pylate):
        return c
    return None


def read_multi_vector(model_dir):
    """A multi-vector (ColBERT-style) dir as sentence-transformers 6.3's MultiVectorEncoder reads it, or
    None for any other dir: {"path", "key" (the projection's weight file and key), "in_features",
    "out_features", "settings" (the kit's: head, lengths, prefixes, query_expansion, skiplist_words),
    "markers" (legacy prefix tokens the tokenizer must keep whole: register_markers)}. Three layouts:
      - MultiVectorEncoder's own (Transformer, Dense, MultiVectorMask, Normalize): its query_expansion
        (the fixed strategy) and its skiplist (on documents);
      - PyLate's (Transformer, Dense; config_sentence_transformers.json: query_prefix / document_prefix,
        inserted as tokens, query_length, document_length, do_query_expansion (default on),
        attend_to_expansion_tokens, skiplist_words (default: punctuation));
      - Stanford-NLP ColBERT's (config.json's architectures HF_ColBERT; artifact.metadata: [unused0] /
        [unused1] markers, query_maxlen, doc_maxlen, attend_to_mask_tokens, mask_punctuation; the
        projection as linear.weight among the model's weights; queries always expanded).
    Anything else (a bias or an activation on the projection, expansion to a minimum width, a skiplist
    on queries or an allowlist) is one sentence."""
    legacy = _colbert_config(model_dir)
    modules_path = os.path.join(model_dir, "modules.json")
    if legacy is not None and legacy.get("stanford"):
        from safetensors import safe_open

        weights = os.path.join(model_dir, "model.safetensors")
        if not os.path.isfile(weights):
            raise SystemExit(f"{model_dir}: a Stanford-NLP ColBERT dir without model.safetensors (its projection, "
                             "linear.weight, is read from there): save it with safetensors")
        with safe_open(weights, "pt") as f:
            out_f, in_f = f.get_slice("linear.weight").get_shape()
        spec = {"path": model_dir, "key": "linear.weight", "in_features": in_f, "out_features": out_f}
        kinds, modules = (), []
    elif not os.path.isfile(modules_path):
        return None
    else:
        modules = _json(modules_path)
        kinds = tuple(m.get("type", "").rsplit(".", 1)[-1] for m in modules)
        pylate = legacy is not None and kinds == ("Transformer", "Dense")
        if "MultiVectorMask" not in kinds and not pylate:
            return None
        if kinds != MULTI_VECTOR_LAYOUT and not pylate:
            _refuse_mv(modules_path, f"modules {', '.join(kinds)} (the kit carries {', '.join(MULTI_VECTOR_LAYOUT)}, "
                                     "or PyLate's Transformer, Dense)")
        dense = _json(os.path.join(model_dir, modules[1].get("path", ""), "config.json"))
        if dense.get("bias") or dense.get("use_residual") or dense.get(
                "activation_function", "torch.nn.modules.linear.Identity") != "torch.nn.modules.linear.Identity":
            _refuse_mv(modules_path, "a token projection with a bias, a residual or an activation (the kit trains a "
                                     "bias-free linear one)")
        spec = {"path": os.path.join(model_dir, modules[1].get("path", "")), "key": "linear.weight",
                "in_features": dense["in_features"], "out_features": dense["out_features"]}
    sbert_path = os.path.join(model_dir, "sentence_bert_config.json")
    sbert = _json(sbert_path) if os.path.isfile(sbert_path) else {}
    st_config = os.path.join(model_dir, "config_sentence_transformers.json")
    prompts = dict((_json(st_config).get("prompts") or {}) if os.path.isfile(st_config) else {})
    out = {"head": "multi-vector", "normalize": True}
    markers = []
    if legacy is not None:  # PyLate / Stanford: the markers go before the prompts, kept whole as tokens
        for key, name in (("query_prefix", "query"), ("document_prefix", "document")):
            if legacy.get(key):
                markers.append(legacy[key])
                prompts[name] = legacy[key] + (prompts.get(name) or "").removeprefix(legacy[key])
        expand = legacy.get("do_query_expansion", True) is not False
        out["query_expansion"] = {"attend": bool(legacy.get("attend_to_expansion_tokens")), "token": None} if expand \
            else False
        if expand or legacy.get("query_length"):
            out["query_max_length"] = int(legacy.get("query_length") or 32)
        if legacy.get("document_length"):
            out["passage_max_length"] = int(legacy["document_length"])
        out["skiplist_words"] = list(PUNCTUATION if legacy.get("skiplist_words") is None else legacy["skiplist_words"])
    else:
        mask = _json(os.path.join(model_dir, modules[2].get("path", ""), "config.json"))
        tasks = mask.get("skiplist_tasks", ["document"])
        if mask.get("keep_only_token_ids") or (mask.get("skiplist_words") and list(
                [tasks] if isinstance(tasks, str) else tasks) != ["document"]):
            _refuse_mv(modules_path, "a MultiVectorMask with an allowlist (keep_only_token_ids) or a skiplist on "
                                     "queries (the kit carries a skiplist on documents)")
        out["skiplist_words"] = list(mask.get("skiplist_words") or [])
        expansion = sbert.get("query_expansion")
        if expansion and expansion.get("strategy") != "fixed":
            _refuse_mv(modules_path, f"query expansion of strategy {expansion.get('strategy')!r} (the kit expands "
                                     "queries to a fixed width: strategy 'fixed')")
        out["query_expansion"] = {"attend": bool(expansion.get("attend")), "token": expansion.get("token")} \
            if expansion else False
        for key, ours in (("query_length", "query_max_length"), ("document_length", "passage_max_length")):
            if sbert.get(key):
                out[ours] = int(sbert[key])
        if expansion:
            out["query_max_length"] = int(expansion["length"])
    if "query" in prompts:
        out["query_prefix"] = prompts["query"]
    doc = next((n for n in DOCUMENT_PROMPTS if n in prompts), None)
    if doc:
        out["passage_prefix"] = prompts[doc]
    return {**spec, "settings": out, "markers": markers}


def _refuse_mv(modules_path, problem):
    raise SystemExit(f"{modules_path}: {problem}; the kit does not reproduce it: fine-tune it with "
                     "sentence-transformers")


def register_markers(tokenizer, markers):
    """Make a PyLate / Stanford ColBERT dir's prefix markers ("[Q] ", "[unused0] ") single tokens when
    the tokenizer knows them but would split them, as MultiVectorEncoder does on loading such a dir:
    each marker (or its first word) that is in the vocabulary or an added token, and does not tokenize
    to itself, becomes a special token that is not normalized. Prepending the marker as text then gives
    the ids PyLate inserted. Returns the tokens registered."""
    from tokenizers import AddedToken

    added, vocab = set(tokenizer.added_tokens_encoder), tokenizer.get_vocab()
    todo = []
    for value in markers:
        for token in (value, value.split(None, 1)[0] if value.split() else value):
            if token not in added and token not in vocab:
                continue
            if tokenizer.tokenize(token) != [token]:
                todo.append(AddedToken(token, normalized=False, special=True))
            break
    if todo:
        tokenizer.add_special_tokens({"additional_special_tokens": todo})
    return [t.content for t in todo]


def read_sparse(model_dir):
    """Is `model_dir` a sentence-transformers SparseEncoder of SPLADE's layout (a fill-mask or causal-LM
    Transformer, then SpladePooling with max pooling of relu: log(1 + relu) of the vocabulary logits)?
    Another sparse layout (inference-free Router / SparseStaticEmbedding, sum pooling, CSR) is one
    sentence."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return False
    modules = _json(modules_path)
    kinds = tuple(m.get("type", "").rsplit(".", 1)[-1] for m in modules)
    st_config = os.path.join(model_dir, "config_sentence_transformers.json")
    sparse_model = os.path.isfile(st_config) and _json(st_config).get("model_type") == "SparseEncoder"
    if "SpladePooling" not in kinds and not sparse_model:
        return False
    pooling = _json(os.path.join(model_dir, modules[-1].get("path", ""), "config.json")) if kinds[-1:] == (
        "SpladePooling",) else {}
    if kinds != ("Transformer", "SpladePooling"):
        problem = f"modules {', '.join(kinds)} (the kit carries Transformer, SpladePooling)"
    elif pooling.get("pooling_strategy", "max") != "max" or pooling.get("activation_function", "relu") != "relu":
        problem = (f"SpladePooling {pooling.get('pooling_strategy')} / {pooling.get('activation_function')} (the kit "
                   "trains max / relu)")
    else:
        return True
    raise SystemExit(f"{modules_path}: {problem}; the kit does not reproduce it: fine-tune it with sentence-transformers")


def _write_files(out_dir, files):
    """{path under out_dir: JSON object}, folders made as needed."""
    for name, obj in files.items():
        os.makedirs(os.path.dirname(os.path.join(out_dir, name)), exist_ok=True)
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(obj, f, indent=2)


def write_sparse_files(out_dir, settings):
    """Write the sentence-transformers SparseEncoder files of a --head sparse export (SPLADE): the
    Transformer reading the vocabulary logits of the saved *ForMaskedLM model, with
    per-task lengths, then 1_SpladePooling (max of log(1 + relu)); dot-product similarity, the
    prefixes as prompts."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
               {"idx": 1, "name": "1", "path": "1_SpladePooling",
                "type": "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling"}]
    files = {"modules.json": modules,
             "sentence_bert_config.json": {
                 "transformer_task": "fill-mask",
                 "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
                 "module_output_name": "token_embeddings", "max_seq_length": settings["passage_max_length"],
                 "query_length": settings["query_max_length"], "document_length": settings["passage_max_length"]},
             os.path.join("1_SpladePooling", "config.json"): {"pooling_strategy": "max", "activation_function": "relu",
                                                             "embedding_dimension": None},
             "config_sentence_transformers.json": {
                 "model_type": "SparseEncoder", "similarity_fn_name": "dot", "default_prompt_name": None,
                 "prompts": {"query": settings["query_prefix"], "document": settings["passage_prefix"]}}}
    _write_files(out_dir, files)


def write_multi_vector_files(out_dir, settings, hidden_size, dim):
    """Write the sentence-transformers MultiVectorEncoder files of a --head multi-vector export, in the
    layout MultiVectorEncoder 6.3 saves for a fresh model: Transformer (token_embeddings, per-task
    lengths query_length / document_length), 1_Dense (the projection: its weights are written by the
    export), 2_MultiVectorMask (the skiplist, on documents), 3_Normalize; MaxSim similarity, the prefixes
    as prompts; query expansion (the fixed strategy, to the query max length) on the Transformer."""
    expansion = settings.get("query_expansion")
    expansion = {"strategy": "fixed", "attend": bool(expansion.get("attend")), "token": expansion.get("token"),
                 "length": settings["query_max_length"]} if expansion else None
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Dense", "type": "sentence_transformers.base.modules.dense.Dense"},
               {"idx": 2, "name": "2", "path": "2_MultiVectorMask",
                "type": "sentence_transformers.multi_vector_encoder.modules.multi_vector_mask.MultiVectorMask"},
               {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.base.modules.normalize.Normalize"}]
    tokens = {"module_input_name": "token_embeddings", "module_output_name": "token_embeddings"}
    files = {"modules.json": modules,
             "sentence_bert_config.json": {
                 "transformer_task": "feature-extraction",
                 "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
                 "module_output_name": "token_embeddings", "max_seq_length": settings["passage_max_length"],
                 "query_length": settings["query_max_length"], "document_length": settings["passage_max_length"],
                 **({"query_expansion": expansion} if expansion else {})},
             os.path.join("1_Dense", "config.json"): {"in_features": hidden_size, "out_features": dim, "bias": False,
                                                      "activation_function": "torch.nn.modules.linear.Identity",
                                                      **tokens},
             os.path.join("2_MultiVectorMask", "config.json"): {"skiplist_words": list(settings.get("skiplist_words") or []),
                                                               "skiplist_tasks": ["document"],
                                                               "keep_only_token_ids": None},
             os.path.join("3_Normalize", "config.json"): tokens,
             "config_sentence_transformers.json": {
                 "model_type": "MultiVectorEncoder", "similarity_fn_name": "maxsim", "default_prompt_name": None,
                 "prompts": {"query": settings["query_prefix"], "document": settings["passage_prefix"]}}}
    _write_files(out_dir, files)


def read_st_dense(model_dir):
    """The Dense projection a sentence-transformers dir applies after pooling (before Normalize):
    {"path", "in_features", "out_features", "bias", "activation_function"}, or None. One Dense, after
    the Pooling, with one of DENSE_ACTIVATIONS and no residual; anything else is one sentence."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    modules = _json(modules_path)
    kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    if "Dense" not in kinds or read_multi_vector(model_dir) is not None:  # (a token projection: read_multi_vector)
        return None
    i = kinds.index("Dense")
    config = _json(os.path.join(model_dir, modules[i].get("path", ""), "config.json"))
    problem = None
    if kinds.count("Dense") > 1:
        problem = f"{kinds.count('Dense')} Dense modules (the kit carries one)"
    elif "Pooling" not in kinds[:i] or "Normalize" in kinds[:i]:
        problem = "a Dense that is not between the Pooling and the Normalize"
    elif config.get("activation_function", DENSE_ACTIVATIONS[0]) not in DENSE_ACTIVATIONS:
        problem = f"a Dense with activation {config.get('activation_function')!r}"
    elif config.get("use_residual"):
        problem = "a Dense with a residual connection"
    if problem:
        raise SystemExit(f"{modules_path}: {problem}; the kit does not carry it: fine-tune it with sentence-transformers")
    return {"path": os.path.join(model_dir, modules[i].get("path", "")), "in_features": config["in_features"],
            "out_features": config["out_features"], "bias": config.get("bias", True),
            "activation_function": config.get("activation_function", DENSE_ACTIVATIONS[0])}


def load_settings(model_dir):
    """The retrieval_kit settings saved beside an exported model ({} for a plain HF dir)."""
    path = os.path.join(model_dir, SETTINGS_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def resolve_biencoder_settings(model_dir, flags, defaults=KIT_DEFAULTS):
    """(settings, message): each of SETTING_KEYS from the explicit flag (not None), else the kit's
    retrieval_kit.json, else the dir's sentence-transformers files, else `defaults`. `message`
    says what was read from the sentence-transformers files (None when nothing was)."""
    kit, st = load_settings(model_dir), read_st_settings(model_dir)
    out, from_st = {}, {}
    for k in SETTING_KEYS:
        if flags.get(k) is not None:
            out[k] = flags[k]
        elif k in kit:
            out[k] = kit[k]
        elif k in st:
            out[k] = from_st[k] = st[k]
        else:
            out[k] = defaults.get(k, KIT_DEFAULTS[k])
    for k in MAXSIM_KEYS if out["head"] == "multi-vector" else ():  # its tokenization: the same order
        out[k] = next((v[k] for v in (flags, kit, st) if v.get(k) is not None), MAXSIM_DEFAULTS[k])
        if k in st and k not in kit and flags.get(k) is None and st[k]:
            from_st[k] = st[k]
    if out["include_prompt"] is False:  # the prefixes' tokens stay out of the pooling (collate.tokenize)
        from .collate import PooledWithout

        out["query_prefix"], out["passage_prefix"] = PooledWithout(out["query_prefix"]), PooledWithout(
            out["passage_prefix"])
    message = None
    if from_st:
        message = f"{model_dir}: read its sentence-transformers settings: " + ", ".join(
            f"{k} {v!r}" if not isinstance(v, list) else f"{k} ({len(v)}: {''.join(map(str, v))[:40]})"
            for k, v in from_st.items()) + " (flags override them)"
    return out, message


def write_st_files(out_dir, settings, hidden_size, dense=None):
    """Write the sentence-transformers files for a bi-encoder export with these kit settings (pooling,
    normalize, prefixes, max lengths, include_prompt). Returns warnings: sentence-transformers has one max length,
    the passage one; a different query max length cannot be declared."""
    if settings["pooling"] not in ST_POOLING.values():
        raise ValueError(f"unknown pooling {settings['pooling']!r}")
    st_mode = {v: k for k, v in ST_POOLING.items()}[settings["pooling"]]
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if dense is not None:  # its weights: written by the export (model.safetensors in 2_Dense)
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
        os.makedirs(os.path.join(out_dir, "2_Dense"), exist_ok=True)
        with open(os.path.join(out_dir, "2_Dense", "config.json"), "w") as f:
            json.dump(dense, f, indent=2)
    if settings["normalize"]:
        n = len(modules)
        modules.append({"idx": n, "name": str(n), "path": f"{n}_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(out_dir, f"{n}_Normalize"), exist_ok=True)
    pooling = {"word_embedding_dimension": hidden_size, **{k: m == st_mode for k, m in LEGACY_KEYS.items()},
               "include_prompt": settings.get("include_prompt", True)}  # False: the prefix's tokens not pooled
    os.makedirs(os.path.join(out_dir, "1_Pooling"), exist_ok=True)
    files = {"modules.json": modules, os.path.join("1_Pooling", "config.json"): pooling,
             "sentence_bert_config.json": {"max_seq_length": settings["passage_max_length"], "do_lower_case": False},
             "config_sentence_transformers.json": {
                 "prompts": {"query": settings["query_prefix"], "document": settings["passage_prefix"]},
                 "default_prompt_name": None, "similarity_fn_name": "cosine" if settings["normalize"] else "dot"}}
    for name, obj in files.items():
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(obj, f, indent=2)
    warnings = []
    if settings["query_max_length"] != settings["passage_max_length"]:
        warnings.append(f"sentence-transformers applies one max length ({settings['passage_max_length']} tokens, the "
                        f"passages') to queries too; the kit trained queries at {settings['query_max_length']}: "
                        f"queries longer than that embed differently there (pass --query-max-length "
                        f"{settings['passage_max_length']} to match)")
    return warnings

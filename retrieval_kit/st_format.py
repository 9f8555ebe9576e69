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

A dir is read once, as a whole, by `read_spec`: every file the kit reads of it, each field's type and
range, the widths of its Dense / projection against the model and against their own weights; any
failure is one sentence naming the file and the field. The spec says which kind of model the dir holds
(its `head`), and is passed to the head that loads it (retrieval_kit/heads/).
"""

import json
import os
import string
from dataclasses import dataclass, field

from .heads import CLASSIFIER, MODULES, MULTI_VECTOR, SINGLE_VECTOR, SPARSE  # the kinds' names (the registry alone)

SETTINGS_FILE = "retrieval_kit.json"  # the kit's own settings, beside an exported model
KIT_DEFAULTS = {"pooling": "avg", "normalize": True, "query_prefix": "", "passage_prefix": "",
                "query_max_length": 32, "passage_max_length": 128, "include_prompt": True, "head": SINGLE_VECTOR}
SETTING_KEYS = tuple(KIT_DEFAULTS)
# sentence-transformers pooling modes -> the kit's
ST_POOLING = {"mean": "avg", "cls": "cls", "lasttoken": "last"}
LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
               "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
               "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
DOCUMENT_PROMPTS = ("document", "passage", "corpus")  # the names encode_document looks for, in its order


def _json(path, kind=dict):
    """A model dir's JSON file (an object, or `kind`); one sentence naming it when it is missing, not JSON
    or not that kind of value (a damaged dir)."""
    try:
        with open(path) as f:
            got = json.load(f)
    except OSError as e:
        raise SystemExit(f"{path}: cannot read it ({e.strerror or e}); copy the model dir whole again")
    except ValueError as e:
        raise SystemExit(f"{path}: not valid JSON ({e}); copy the model dir whole again")
    if not isinstance(got, kind):
        raise SystemExit(f"{path}: holds a {type(got).__name__}, not a JSON {'list' if kind is list else 'object'}; "
                         "copy the model dir whole again")
    return got


def _bad(path, key, value, what):
    raise SystemExit(f"{path}: {key} {value!r} must be {what}; fix the file or copy the model dir whole again")


def _length(path, key, value, optional=True):
    """A positive token count from a dir's file (an int, or a whole number written as a float)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        _bad(path, key, value, "a positive whole number of tokens")
    return int(value)


def _words(path, key, value):
    """A list of words (a skiplist): a string would be read letter by letter, numbers and null are not words."""
    if not isinstance(value, list) or not all(isinstance(w, str) and w for w in value):
        _bad(path, key, value if not isinstance(value, str) else value[:40],
             "a list of words (a string would be read letter by letter, as MultiVectorEncoder reads it)"
             if isinstance(value, str) else "a list of non-empty strings")
    return list(value)


def _modules(model_dir):
    """modules.json's entries (a list of objects with a "type"), or None without the file."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return None
    modules = _json(path, list)
    for i, m in enumerate(modules):
        if not isinstance(m, dict) or not isinstance(m.get("type", ""), str) or not isinstance(m.get("path", ""), str):
            _bad(path, f"entry {i}", m, "an object with a string \"type\" and \"path\"")
    return modules


def _pooling_mode(config, path):
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [m for k, m in LEGACY_KEYS.items() if config.get(k)]
        mode = modes[0] if len(modes) == 1 else modes
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str) or mode not in ST_POOLING:
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
    modules = _modules(model_dir)
    if modules is None:
        return {}
    out = {"normalize": False}
    if read_sparse(model_dir):  # a SparseEncoder (SPLADE): vocabulary-sized vectors, dot product
        out.update(head=SPARSE)
    for m in modules:
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
    out.update(_prompts(model_dir, {}))
    return out


def _prompts(model_dir, prompts):
    """{"query_prefix", "passage_prefix"} from the dir's prompts (config_sentence_transformers.json,
    after `prompts` given first), each a string."""
    st_config = os.path.join(model_dir, "config_sentence_transformers.json")
    given = (_json(st_config).get("prompts") or {}) if os.path.isfile(st_config) else {}
    if not isinstance(given, dict):
        _bad(st_config, "prompts", given, "an object of prompt strings")
    prompts = {**given, **prompts}
    out = {}
    if "query" in prompts:
        out["query_prefix"] = prompts["query"]
    doc = next((n for n in DOCUMENT_PROMPTS if n in prompts), None)
    if doc:
        out["passage_prefix"] = prompts[doc]
    for k, v in out.items():
        if not isinstance(v, str):
            _bad(st_config, f"prompt ({k})", v, "a string")
    return out


def _max_length(model_dir):
    """A sentence-transformers dir's one max length: sentence_bert_config.json's max_seq_length, else the
    tokenizer's model_max_length (not its "no limit" sentinel); None when neither says."""
    max_len = None
    sbert = os.path.join(model_dir, "sentence_bert_config.json")
    if os.path.isfile(sbert):
        max_len = _length(sbert, "max_seq_length", _json(sbert).get("max_seq_length"))
    tok_config = os.path.join(model_dir, "tokenizer_config.json")
    if max_len is None and os.path.isfile(tok_config):
        max_len = _json(tok_config).get("model_max_length")
        max_len = max_len if isinstance(max_len, int) and 0 < max_len < 1_000_000 else None  # "no limit" sentinels
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
PUNCTUATION = list(string.punctuation)  # PyLate's and Stanford ColBERT's default skiplist


def _colbert_config(model_dir):
    """The ColBERT settings of a PyLate dir (at the top of its config_sentence_transformers.json) or of a
    Stanford-NLP ColBERT dir (its artifact.metadata), in PyLate's names; None for any other dir."""
    config = os.path.join(model_dir, "config.json")
    if os.path.isfile(config) and "HF_ColBERT" in (_json(config).get("architectures") or []):
        meta_path = os.path.join(model_dir, "artifact.metadata")
        meta = _json(meta_path) if os.path.isfile(meta_path) else {}
        for key in ("query_token_id", "doc_token_id"):
            if not isinstance(meta.get(key) or "", str):
                _bad(meta_path, key, meta[key], "a marker token, a string")
        return {"stanford": True, "source": meta_path, "query_prefix": (meta.get("query_token_id") or "[unused0]") + " ",
                "document_prefix": (meta.get("doc_token_id") or "[unused1]") + " ",
                "query_length": _length(meta_path, "query_maxlen", meta.get("query_maxlen")) or 32,
                "document_length": _length(meta_path, "doc_maxlen", meta.get("doc_maxlen")),
                "do_query_expansion": True, "attend_to_expansion_tokens": bool(meta.get("attend_to_mask_tokens")),
                "skiplist_words": PUNCTUATION if meta.get("mask_punctuation", True) else []}
    st_config = os.path.join(model_dir, "config_sentence_transformers.json")
    c = _json(st_config) if os.path.isfile(st_config) else {}
    pylate = ("query_prefix", "document_prefix", "do_query_expansion", "attend_to_expansion_tokens", "skiplist_words")
    if c.get("model_type") == "ColBERT" or any(k in c for k in pylate):
        for key in ("query_prefix", "document_prefix"):
            if not isinstance(c.get(key) or "", str):
                _bad(st_config, key, c[key], "a marker, a string")
        for key in ("query_length", "document_length"):
            c[key] = _length(st_config, key, c.get(key))
        if c.get("skiplist_words") is not None:
            c["skiplist_words"] = _words(st_config, "skiplist_words", c["skiplist_words"])
        return {**c, "source": st_config}
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
        weights = os.path.join(model_dir, "model.safetensors")
        if not os.path.isfile(weights):
            raise SystemExit(f"{model_dir}: a Stanford-NLP ColBERT dir without model.safetensors (its projection, "
                             "linear.weight, is read from there): save it with safetensors")
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(weights, "pt") as f:
                if "linear.weight" not in f.keys():
                    raise SystemExit(f"{weights}: holds no linear.weight (a Stanford-NLP ColBERT dir's projection); copy "
                                     "the model dir whole again")
                shape = f.get_slice("linear.weight").get_shape()
        except SafetensorError as e:
            raise SystemExit(f"{weights}: cannot read it ({e}); copy the model dir whole again") from None
        if len(shape) != 2:
            raise SystemExit(f"{weights}: linear.weight is {'x'.join(map(str, shape))}, not a matrix; copy the model "
                             "dir whole again")
        spec = {"path": model_dir, "key": "linear.weight", "in_features": shape[1], "out_features": shape[0],
                "config": weights}
        kinds, modules = (), []
    elif not os.path.isfile(modules_path):
        return None
    else:
        modules = _modules(model_dir)
        kinds = tuple(m.get("type", "").rsplit(".", 1)[-1] for m in modules)
        pylate = legacy is not None and kinds == ("Transformer", "Dense")
        if "MultiVectorMask" not in kinds and not pylate:
            return None
        if kinds != MULTI_VECTOR_LAYOUT and not pylate:
            _refuse_mv(modules_path, f"modules {', '.join(kinds)} (the kit carries {', '.join(MULTI_VECTOR_LAYOUT)}, "
                                     "or PyLate's Transformer, Dense)")
        dense_path = os.path.join(model_dir, modules[1].get("path", ""), "config.json")
        dense = _json(dense_path)
        if dense.get("bias") or dense.get("use_residual") or dense.get(
                "activation_function", "torch.nn.modules.linear.Identity") != "torch.nn.modules.linear.Identity":
            _refuse_mv(modules_path, "a token projection with a bias, a residual or an activation (the kit trains a "
                                     "bias-free linear one)")
        spec = {"path": os.path.join(model_dir, modules[1].get("path", "")), "key": "linear.weight",
                "in_features": _length(dense_path, "in_features", dense.get("in_features"), optional=False),
                "out_features": _length(dense_path, "out_features", dense.get("out_features"), optional=False),
                "config": dense_path}
    sbert_path = os.path.join(model_dir, "sentence_bert_config.json")
    sbert = _json(sbert_path) if os.path.isfile(sbert_path) else {}
    prompts = {}
    out = {"head": MULTI_VECTOR, "normalize": True}
    markers = []
    if legacy is not None:  # PyLate / Stanford: the markers go before the prompts, kept whole as tokens
        st_config = os.path.join(model_dir, "config_sentence_transformers.json")
        given = (_json(st_config).get("prompts") or {}) if os.path.isfile(st_config) else {}
        for key, name in (("query_prefix", "query"), ("document_prefix", "document")):
            if legacy.get(key):
                markers.append(legacy[key])
                prompt = given.get(name) or "" if isinstance(given, dict) else ""
                prompts[name] = legacy[key] + (prompt if isinstance(prompt, str) else "").removeprefix(legacy[key])
        expand = legacy.get("do_query_expansion", True) is not False
        out["query_expansion"] = {"attend": bool(legacy.get("attend_to_expansion_tokens")), "token": None} if expand \
            else False
        if expand or legacy.get("query_length"):
            out["query_max_length"] = int(legacy.get("query_length") or 32)
        if legacy.get("document_length"):
            out["passage_max_length"] = int(legacy["document_length"])
        out["skiplist_words"] = list(PUNCTUATION if legacy.get("skiplist_words") is None else legacy["skiplist_words"])
    else:
        mask_path = os.path.join(model_dir, modules[2].get("path", ""), "config.json")
        mask = _json(mask_path)
        tasks = mask.get("skiplist_tasks", ["document"])
        if mask.get("keep_only_token_ids") or (mask.get("skiplist_words") and list(
                [tasks] if isinstance(tasks, str) else tasks if isinstance(tasks, list) else [tasks]) != ["document"]):
            _refuse_mv(modules_path, "a MultiVectorMask with an allowlist (keep_only_token_ids) or a skiplist on "
                                     "queries (the kit carries a skiplist on documents)")
        out["skiplist_words"] = _words(mask_path, "skiplist_words", mask.get("skiplist_words") or [])
        expansion = sbert.get("query_expansion")
        if expansion and not isinstance(expansion, dict):
            _bad(sbert_path, "query_expansion", expansion, "an object (strategy, length, attend, token) or null")
        if expansion and expansion.get("strategy") != "fixed":
            _refuse_mv(modules_path, f"query expansion of strategy {expansion.get('strategy')!r} (the kit expands "
                                     "queries to a fixed width: strategy 'fixed')")
        if expansion and not isinstance(expansion.get("token") or "", str):
            _bad(sbert_path, "query_expansion.token", expansion.get("token"), "a token, a string, or null")
        out["query_expansion"] = {"attend": bool(expansion.get("attend")), "token": expansion.get("token")} \
            if expansion else False
        for key, ours in (("query_length", "query_max_length"), ("document_length", "passage_max_length")):
            if sbert.get(key) is not None:
                out[ours] = _length(sbert_path, key, sbert[key])
        if expansion:
            out["query_max_length"] = _length(sbert_path, "query_expansion.length", expansion.get("length"),
                                              optional=False)
    out.update(_prompts(model_dir, prompts))
    return {**spec, "settings": out, "markers": markers}


def _refuse_mv(modules_path, problem):
    raise SystemExit(f"{modules_path}: {problem}; the kit does not reproduce it: fine-tune it with "
                     "sentence-transformers")


def read_sparse(model_dir):
    """Is `model_dir` a sentence-transformers SparseEncoder of SPLADE's layout (a fill-mask or causal-LM
    Transformer, then SpladePooling with max pooling of relu: log(1 + relu) of the vocabulary logits)?
    Another sparse layout (inference-free Router / SparseStaticEmbedding, sum pooling, CSR) is one
    sentence."""
    modules_path = os.path.join(model_dir, "modules.json")
    modules = _modules(model_dir)
    if modules is None:
        return False
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
    modules = _modules(model_dir)
    if modules is None:
        return None
    kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    if "Dense" not in kinds or read_multi_vector(model_dir) is not None:  # (a token projection: read_multi_vector)
        return None
    i = kinds.index("Dense")
    config_path = os.path.join(model_dir, modules[i].get("path", ""), "config.json")
    config = _json(config_path)
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
    if not isinstance(config.get("bias", True), bool):
        _bad(config_path, "bias", config.get("bias"), "true or false")
    return {"path": os.path.join(model_dir, modules[i].get("path", "")), "config": config_path,
            "in_features": _length(config_path, "in_features", config.get("in_features"), optional=False),
            "out_features": _length(config_path, "out_features", config.get("out_features"), optional=False),
            "bias": config.get("bias", True), "key": "linear.weight",
            "activation_function": config.get("activation_function", DENSE_ACTIVATIONS[0])}


def load_settings(model_dir):
    """The retrieval_kit settings saved beside an exported model ({} for a plain HF dir), each field the
    kit reads checked (KIT_FIELDS): one sentence naming the file and the field otherwise."""
    path = os.path.join(model_dir, SETTINGS_FILE)
    if not os.path.isfile(path):
        return {}
    settings = _json(path)
    for key, (ok, what) in KIT_FIELDS.items():
        if key in settings and not ok(settings[key]):
            _bad(path, key, settings[key], what)
    return settings


def _is_length(v):
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _is_words(v):
    return isinstance(v, list) and all(isinstance(w, str) and w for w in v)


KIT_FIELDS = {  # what the kit reads of a retrieval_kit.json: (check, what it must be)
    "kind": (lambda v: v in ("biencoder", "reranker") if isinstance(v, str) else False, "'biencoder' or 'reranker'"),
    "head": (lambda v: v in MODULES if isinstance(v, str) else False, "one of " + ", ".join(MODULES)),
    "pooling": (lambda v: v in ("avg", "cls", "last", "native") if isinstance(v, str) else False,
                "avg, cls, last (or native for a reranker)"),
    "normalize": (lambda v: isinstance(v, bool), "true or false"),
    "include_prompt": (lambda v: isinstance(v, bool), "true or false"),
    "query_prefix": (lambda v: isinstance(v, str), "a string"),
    "passage_prefix": (lambda v: isinstance(v, str), "a string"),
    "query_max_length": (_is_length, "a positive whole number of tokens"),
    "passage_max_length": (_is_length, "a positive whole number of tokens"),
    "rerank_max_length": (_is_length, "a positive whole number of tokens"),
    "train_query_max_length": (_is_length, "a positive whole number of tokens"),
    "multi_vector_dim": (_is_length, "a positive whole number"),
    "skiplist_words": (_is_words, "a list of non-empty strings"),
    "query_expansion": (lambda v: v is False or v is None or (isinstance(v, dict) and isinstance(v.get("token") or "", str)),
                        "false, or an object with attend and token"),
    "matryoshka_dims": (lambda v: isinstance(v, list) and all(_is_length(d) for d in v), "a list of positive sizes"),
    "prompt_template": (lambda v: isinstance(v, str) and (v == "pair" or v.count("{query}") == v.count("{passage}") == 1),
                        "'pair' or a template holding {query} and {passage} once each"),
    "append_eos": (lambda v: isinstance(v, bool), "true or false"),
    "bidirectional": (lambda v: isinstance(v, bool), "true or false"),
    "padding_side": (lambda v: v in ("left", "right") if isinstance(v, str) else False, "left or right"),
    "pad_to_multiple_of": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
                           "a whole number or null"),
    "lm_token_ids": (lambda v: v is None or (isinstance(v, list) and len(v) == 2 and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)), "two vocabulary ids, or null"),
    "fusion": (lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("weight"), (int, float))
                                       and _is_length(v.get("top_k"))), "null or {weight, top_k, ndcg@10}"),
}


@dataclass
class DirSpec:
    """What the kit reads of a model dir (read_spec), passed to whoever loads it."""
    path: str
    head: str = None  # the kind the dir holds (heads.MODULES); None: a plain Hugging Face dir, any head
    kit: dict = field(default_factory=dict)  # its retrieval_kit.json (an export of the kit)
    st: dict = field(default_factory=dict)  # its sentence-transformers settings, in the kit's keys
    dense: dict = None  # the Dense a one-vector dir applies after the pooling (read_st_dense)
    projection: dict = None  # a multi-vector dir's token projection (read_multi_vector)
    markers: list = field(default_factory=list)  # prefix markers its tokenizer keeps whole (PyLate, Stanford)
    sparse: bool = False  # a SparseEncoder dir (read_sparse)

    def what(self):
        """The dir's kind in words, for a refusal."""
        if self.kit.get("kind"):
            return f"an export of the kit with head {self.head} (its {SETTINGS_FILE})"
        if self.projection is not None:
            return "a multi-vector (ColBERT-style) dir, with its token projection"
        if self.sparse:
            return "a SparseEncoder (SPLADE) dir"
        return "a sentence-transformers dir" + (" with a Dense projection after its pooling" if self.dense else "")


def read_spec(model_dir):
    """The dir read as a whole, before any weights load: retrieval_kit.json (load_settings), the
    sentence-transformers files of any of the layouts the kit reads (read_st_settings, read_st_dense,
    read_multi_vector, read_sparse), each field checked, and the Dense / projection checked against the
    model's width (config.json's hidden_size) and their own weights (present, of that shape). One
    sentence naming the file and the field for anything wrong."""
    kit = load_settings(model_dir)
    _check_hf_files(model_dir)
    if kit.get("kind") == "reranker" or _cross_encoder(model_dir):  # its modules score pairs: no embedding spec
        head = kit.get("head") or CLASSIFIER if kit.get("kind") == "reranker" else None
        return DirSpec(model_dir, head, kit)
    multi = read_multi_vector(model_dir)
    sparse = read_sparse(model_dir)
    st = read_st_settings(model_dir)
    dense = read_st_dense(model_dir)
    hidden = _hidden_size(model_dir)
    for part, what in ((dense, "Dense"), (multi, "token projection")):
        if part is not None:
            _check_linear(model_dir, part, hidden, what)
    if kit.get("head"):
        head = kit["head"]
    elif kit.get("kind") == "reranker":
        head = CLASSIFIER
    else:
        head = MULTI_VECTOR if multi else SPARSE if sparse else SINGLE_VECTOR if (
            st or kit.get("kind") == "biencoder") else None
    return DirSpec(model_dir, head, kit, st, dense, multi, list(multi["markers"]) if multi else [], sparse)


HF_FIELDS = {  # what the kit (and transformers before it) reads of a Hugging Face dir's own files
    "config.json": {"model_type": (lambda v: isinstance(v, str) and v, "a model type, a string"),
                    "architectures": (lambda v: v is None or (isinstance(v, list) and all(isinstance(a, str) for a in v)),
                                      "a list of class names"),
                    "hidden_size": (_is_length, "a positive whole number"),
                    "d_model": (_is_length, "a positive whole number"),
                    "num_attention_heads": (_is_length, "a positive whole number"),
                    "vocab_size": (_is_length, "a positive whole number")},
    "tokenizer_config.json": {"model_max_length": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   and v > 0, "a positive number of tokens")}}


def _check_hf_files(model_dir):
    """A Hugging Face dir's config.json and tokenizer_config.json, where present: JSON objects whose fields
    the kit reads have their types (HF_FIELDS); one sentence naming the file and the field otherwise."""
    for name, fields in HF_FIELDS.items():
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        got = _json(path)
        for key, (ok, what) in fields.items():
            if key in got and not ok(got[key]):
                _bad(path, key, got[key], what)


def _cross_encoder(model_dir):
    """Is `model_dir` a sentence-transformers CrossEncoder dir (its config says so, or a LogitScore module)?"""
    st_config = os.path.join(model_dir, "config_sentence_transformers.json")
    if os.path.isfile(st_config) and _json(st_config).get("model_type") == "CrossEncoder":
        return True
    modules = _modules(model_dir) or []
    return any(m.get("type", "").endswith("LogitScore") for m in modules)


def _hidden_size(model_dir):
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    config = _json(path)
    size = config.get("hidden_size", config.get("d_model"))
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _check_linear(model_dir, part, hidden, what):
    """A Dense / projection's in_features against the model's width, and its weight file's tensor
    against (out_features, in_features); fills in the sizes a Stanford dir leaves to its weights."""
    from safetensors import SafetensorError, safe_open

    folder, key = part["path"], part["key"]
    weights = os.path.join(folder, "model.safetensors")
    shape = None
    if os.path.isfile(weights):
        try:
            with safe_open(weights, "pt") as f:
                if key not in f.keys():
                    raise SystemExit(f"{weights}: holds no {key} (the {what}'s weight); copy the model dir whole again")
                shape = tuple(f.get_slice(key).get_shape())
        except SafetensorError as e:
            raise SystemExit(f"{weights}: cannot read it ({e}); copy the model dir whole again") from None
    elif not os.path.isfile(os.path.join(folder, "pytorch_model.bin")):
        raise SystemExit(f"{folder}: the {what} has no weights (model.safetensors or pytorch_model.bin); copy the "
                         "model dir whole again")
    if shape is not None and shape != (part["out_features"], part["in_features"]):
        raise SystemExit(f"{weights}: {key} is {'x'.join(map(str, shape))}, its config "
                         f"({part.get('config')}) says {part['out_features']}x{part['in_features']}; copy the model "
                         "dir whole again")
    if hidden is not None and part["in_features"] != hidden:
        raise SystemExit(f"{part.get('config')}: in_features {part['in_features']} is not the model's width (hidden_size "
                         f"{hidden} in {os.path.join(model_dir, 'config.json')}): the {what} belongs to another model")


def resolve_head(spec, flags, defaults=KIT_DEFAULTS):
    """The head a bi-encoder run or tool takes, in resolve_biencoder_settings' order."""
    return next(v["head"] for v in (flags, spec.kit, spec.st, defaults, KIT_DEFAULTS) if v.get("head") is not None)


def resolve_biencoder_settings(spec, flags, defaults=KIT_DEFAULTS, head_settings=None, training=False):
    """(settings, message): each of SETTING_KEYS from the explicit flag (not None), else the kit's
    retrieval_kit.json, else the dir's sentence-transformers files (its spec: read_spec), else
    `defaults`; then the head's own settings (`head_settings`, {key: default}: its SETTINGS) in the same
    order. `message` says what was read from the sentence-transformers files (None when nothing was).
    `training`: an export's query length is the one it trained at (train_query_max_length), not the one
    inference reads (query_max_length)."""
    model_dir, kit, st = spec.path, spec.kit, spec.st
    if training and "train_query_max_length" in kit:
        kit = {**kit, "query_max_length": kit["train_query_max_length"]}
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
    for k, default in (head_settings or {}).items():  # e.g. multi-vector's tokenization: the same order
        out[k] = next((v[k] for v in (flags, kit, st) if v.get(k) is not None), default)
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


# ----- files of a reranker export (export.py writes the dir; heads/ add their parts) ---------------

IDENTITY = "torch.nn.modules.linear.Identity"  # sentence-transformers' activation_fn path for raw logits


def edit_json(path, fn):
    """Rewrite the JSON file at `path` with fn(obj) applied."""
    with open(path) as f:
        obj = json.load(f)
    fn(obj)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


def write_chat_template(out_dir, template):
    """`template` as the dir's chat template (chat_template.jinja, which transformers reads first)."""
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    edit_json(os.path.join(out_dir, "tokenizer_config.json"), lambda c: c.pop("chat_template", None))


def drop_chat_template(out_dir):
    """No chat template in the dir: sentence-transformers then encodes a pair as `tokenizer(query, passage)`."""
    for name in ("chat_template.jinja", "chat_template.json"):
        if os.path.isfile(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    edit_json(os.path.join(out_dir, "tokenizer_config.json"), lambda c: c.pop("chat_template", None))


def write_lm_cross_encoder_files(out_dir, token_ids, max_length, chat=False):
    """The sentence-transformers files (6.x layout) that make `CrossEncoder(out_dir)` score a --head lm
    export as the kit does: its Transformer module on the causal LM ("text-generation", logits of the
    last position, left padding), then LogitScore: logit(true) - logit(false), no activation.
    `chat`: pairs go through the chat template's query / document roles (the "message" modality,
    flat: each message's content a string)."""
    text = {"method": "forward", "method_output_name": "logits"}
    modality = {"text": text, **({"message": {**text, "format": "flat"}} if chat else {})}
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
               {"idx": 1, "name": "1", "path": "1_LogitScore",
                "type": "sentence_transformers.cross_encoder.modules.logit_score.LogitScore"}]
    files = {"modules.json": modules,
             os.path.join("1_LogitScore", "config.json"): {"true_token_id": token_ids[0], "false_token_id": token_ids[1],
                                                           "module_input_name": "causal_logits"},
             "sentence_bert_config.json": {"transformer_task": "text-generation", "max_seq_length": max_length,
                                           "modality_config": modality,
                                           "module_output_name": "causal_logits"},
             "config_sentence_transformers.json": {"model_type": "CrossEncoder", "activation_fn": IDENTITY,
                                                   "prompts": {}, "default_prompt_name": None}}
    _write_files(out_dir, files)

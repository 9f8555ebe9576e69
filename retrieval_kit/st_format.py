"""What every kind of model dir shares: the sentence-transformers files common to all kinds, and the
kit's own retrieval_kit.json. Each kind reads and writes its own modules (heads/*.read_dir and
write_export); the registry (heads.read_spec) asks each head in turn and builds the one DirSpec.

A sentence-transformers dir is a plain Hugging Face dir plus
    modules.json                       Transformer -> Pooling (1_Pooling/config.json) [-> Normalize]
    sentence_bert_config.json          max_seq_length (sentence-transformers >= 6 also reads the
                                       tokenizer's model_max_length)
    config_sentence_transformers.json  prompts ("query", "document"), similarity_fn_name
The files are written in the layout every sentence-transformers version since 2.x reads (the one
all-MiniLM-L6-v2 ships with); 6.x reads it too.

Settings resolve in this order: explicit flags, then the kit's own retrieval_kit.json (an export),
then the sentence-transformers files, then the kit's defaults (`resolve_biencoder_settings`).

Every file is read with its fields checked (type and range; a linear module's widths against the model
and its own weights: check_linear); any failure is one sentence naming the file and the field. This
module imports no head.
"""

import json
import os
from dataclasses import dataclass, field

SETTINGS_FILE = "retrieval_kit.json"  # the kit's own settings, beside an exported model
KIT_DEFAULTS = {"pooling": "avg", "normalize": True, "query_prefix": "", "passage_prefix": "",
                "query_max_length": 32, "passage_max_length": 128, "include_prompt": True,
                "head": None}  # (head: the registry's default, heads.EMBEDDING[0])
SETTING_KEYS = tuple(KIT_DEFAULTS)
# sentence-transformers pooling modes -> the kit's
ST_POOLING = {"mean": "avg", "cls": "cls", "lasttoken": "last"}
LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
               "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
               "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
DOCUMENT_PROMPTS = ("document", "passage", "corpus")  # the names encode_document looks for, in its order


def read_json(path, kind=dict):
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


def bad_field(path, key, value, what):
    raise SystemExit(f"{path}: {key} {value!r} must be {what}; fix the file or copy the model dir whole again")


def check_length(path, key, value, optional=True):
    """A positive token count from a dir's file (an int, or a whole number written as a float)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        bad_field(path, key, value, "a positive whole number of tokens")
    return int(value)


def check_words(path, key, value):
    """A list of words (a skiplist): a string would be read letter by letter, numbers and null are not words."""
    if not isinstance(value, list) or not all(isinstance(w, str) and w for w in value):
        bad_field(path, key, value if not isinstance(value, str) else value[:40],
                  "a list of words (a string would be read letter by letter, as MultiVectorEncoder reads it)"
                  if isinstance(value, str) else "a list of non-empty strings")
    return list(value)


def read_modules(model_dir):
    """modules.json's entries (a list of objects with a "type"), or None without the file."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return None
    modules = read_json(path, list)
    for i, m in enumerate(modules):
        if not isinstance(m, dict) or not isinstance(m.get("type", ""), str) or not isinstance(m.get("path", ""), str):
            bad_field(path, f"entry {i}", m, "an object with a string \"type\" and \"path\"")
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


def read_st_settings(model_dir, carried=()):
    """The bi-encoder settings a sentence-transformers dir declares ({} for a dir without modules.json),
    as the kit's keys: pooling, normalize, query_prefix, passage_prefix, query/passage_max_length. The
    modules every kind shares are read here (Transformer, Pooling, Normalize); those in `carried` (the
    module types of the head reading the dir: heads/*.read_dir) are the head's; any other is one sentence."""
    modules_path = os.path.join(model_dir, "modules.json")
    modules = read_modules(model_dir)
    if modules is None:
        return {}
    out = {"normalize": False}
    for m in modules:
        kind = m.get("type", "").rsplit(".", 1)[-1]
        if kind in carried:
            continue
        if kind == "Pooling":
            path = os.path.join(model_dir, m.get("path", ""), "config.json")
            config = read_json(path)
            out["pooling"] = _pooling_mode(config, path)
            if config.get("include_prompt") is False:  # the prompt's tokens are not pooled
                out["include_prompt"] = False
        elif kind == "Normalize":
            out["normalize"] = True
        elif kind != "Transformer":
            raise SystemExit(unsupported(model_dir, modules_path, m, kind))
    max_len = max_length(model_dir)
    if max_len:
        out["query_max_length"] = out["passage_max_length"] = max_len
    out.update(read_prompts(model_dir, {}))
    return out


def module_kinds(modules):
    """modules.json's entries by class name ("...models.Dense" -> "Dense")."""
    return tuple(m.get("type", "").rsplit(".", 1)[-1] for m in modules)


def read_prompts(model_dir, prompts):
    """{"query_prefix", "passage_prefix"} from the dir's prompts (config_sentence_transformers.json,
    after `prompts` given first), each a string."""
    st_config = os.path.join(model_dir, "config_sentence_transformers.json")
    given = (read_json(st_config).get("prompts") or {}) if os.path.isfile(st_config) else {}
    if not isinstance(given, dict):
        bad_field(st_config, "prompts", given, "an object of prompt strings")
    prompts = {**given, **prompts}
    out = {}
    if "query" in prompts:
        out["query_prefix"] = prompts["query"]
    doc = next((n for n in DOCUMENT_PROMPTS if n in prompts), None)
    if doc:
        out["passage_prefix"] = prompts[doc]
    for k, v in out.items():
        if not isinstance(v, str):
            bad_field(st_config, f"prompt ({k})", v, "a string")
    return out


def max_length(model_dir):
    """A sentence-transformers dir's one max length: sentence_bert_config.json's max_seq_length, else the
    tokenizer's model_max_length (not its "no limit" sentinel); None when neither says."""
    max_len = None
    sbert = os.path.join(model_dir, "sentence_bert_config.json")
    if os.path.isfile(sbert):
        max_len = check_length(sbert, "max_seq_length", read_json(sbert).get("max_seq_length"))
    tok_config = os.path.join(model_dir, "tokenizer_config.json")
    if max_len is None and os.path.isfile(tok_config):
        max_len = read_json(tok_config).get("model_max_length")
        max_len = max_len if isinstance(max_len, int) and 0 < max_len < 1_000_000 else None  # "no limit" sentinels
    return int(max_len) if max_len else None


def unsupported(model_dir, modules_path, module, kind):
    """The sentence naming a module the kit does not reproduce (Dense, LayerNorm, WordWeights...)."""
    what = ""
    config = os.path.join(model_dir, module.get("path", ""), "config.json")
    if kind == "Dense" and os.path.isfile(config):
        c = read_json(config)
        what = (f": a {c.get('in_features')} -> {c.get('out_features')} linear layer, so sentence-transformers "
                f"embeds to {c.get('out_features')} dimensions")
    return (f"{modules_path}: module {module.get('name')!r} is a {kind}{what}; the kit does not carry it (training, "
            "evaluation and the export would embed without it): fine-tune a dir without it (its modules.json "
            "listing Transformer, Pooling and Normalize only), or train it with sentence-transformers")


def write_json_files(out_dir, files):
    """{path under out_dir: JSON object}, folders made as needed."""
    for name, obj in files.items():
        os.makedirs(os.path.dirname(os.path.join(out_dir, name)), exist_ok=True)
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(obj, f, indent=2)


def load_settings(model_dir, fields=None):
    """The retrieval_kit settings saved beside an exported model ({} for a plain HF dir), each field the
    kit reads checked (KIT_FIELDS, and `fields` of the same form: the heads' own, heads.read_spec): one
    sentence naming the file and the field otherwise."""
    path = os.path.join(model_dir, SETTINGS_FILE)
    if not os.path.isfile(path):
        return {}
    settings = read_json(path)
    for key, (ok, what) in {**KIT_FIELDS, **(fields or {})}.items():
        if key in settings and not ok(settings[key]):
            bad_field(path, key, settings[key], what)
    return settings


def is_length(v):
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def is_words(v):
    return isinstance(v, list) and all(isinstance(w, str) and w for w in v)


KIT_FIELDS = {  # what the kit reads of a retrieval_kit.json: (check, what it must be); "head": heads.read_spec
    "kind": (lambda v: v in ("biencoder", "reranker") if isinstance(v, str) else False, "'biencoder' or 'reranker'"),
    "pooling": (lambda v: v in ("avg", "cls", "last", "native") if isinstance(v, str) else False,
                "avg, cls, last (or native for a reranker)"),
    "normalize": (lambda v: isinstance(v, bool), "true or false"),
    "include_prompt": (lambda v: isinstance(v, bool), "true or false"),
    "query_prefix": (lambda v: isinstance(v, str), "a string"),
    "passage_prefix": (lambda v: isinstance(v, str), "a string"),
    "query_max_length": (is_length, "a positive whole number of tokens"),
    "passage_max_length": (is_length, "a positive whole number of tokens"),
    "rerank_max_length": (is_length, "a positive whole number of tokens"),
    "train_query_max_length": (is_length, "a positive whole number of tokens"),
    "matryoshka_dims": (lambda v: isinstance(v, list) and all(is_length(d) for d in v), "a list of positive sizes"),
    "prompt_template": (lambda v: isinstance(v, str) and (v == "pair" or v.count("{query}") == v.count("{passage}") == 1),
                        "'pair' or a template holding {query} and {passage} once each"),
    "append_eos": (lambda v: isinstance(v, bool), "true or false"),
    "bidirectional": (lambda v: isinstance(v, bool), "true or false"),
    "padding_side": (lambda v: v in ("left", "right") if isinstance(v, str) else False, "left or right"),
    "pad_to_multiple_of": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
                           "a whole number or null"),
    "fusion": (lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("weight"), (int, float))
                                       and is_length(v.get("top_k"))), "null or {weight, top_k, ndcg@10}"),
}


@dataclass
class DirSpec:
    """What the kit reads of a model dir (heads.read_spec), passed to whoever loads it."""
    path: str
    head: str = None  # the kind the dir holds (heads.MODULES); None: a plain Hugging Face dir, any head
    kit: dict = field(default_factory=dict)  # its retrieval_kit.json (an export of the kit)
    st: dict = field(default_factory=dict)  # its sentence-transformers settings, in the kit's keys
    own: dict = field(default_factory=dict)  # the head's own part (heads/*.read_dir): its modules' configs

    @property
    def model_path(self):
        """Where the dir's Hugging Face model and tokenizer are: the dir, or the folder its head names
        (own["model_dir"]: an inference-free Router keeps its document model in a module folder)."""
        return os.path.join(self.path, self.own["model_dir"]) if self.own.get("model_dir") else self.path

    def prepare_tokenizer(self, tokenizer):
        """What the dir asks of its tokenizer, its head's steps (own["tokenizer"]: e.g. PyLate's prefix markers
        kept whole tokens): models.load_tokenizer(path, prepare=spec.prepare_tokenizer)."""
        for step in self.own.get("tokenizer", ()):
            step(tokenizer)

    def what(self):
        """The dir's kind in words, for a refusal."""
        if self.kit.get("kind"):
            return f"an export of the kit with head {self.head} (its {SETTINGS_FILE})"
        return self.own.get("what", "a sentence-transformers dir")


HF_FIELDS = {  # what the kit (and transformers before it) reads of a Hugging Face dir's own files
    "config.json": {"model_type": (lambda v: isinstance(v, str) and v, "a model type, a string"),
                    "architectures": (lambda v: v is None or (isinstance(v, list) and all(isinstance(a, str) for a in v)),
                                      "a list of class names"),
                    "hidden_size": (is_length, "a positive whole number"),
                    "d_model": (is_length, "a positive whole number"),
                    "num_attention_heads": (is_length, "a positive whole number"),
                    "vocab_size": (is_length, "a positive whole number")},
    "tokenizer_config.json": {"model_max_length": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   and v > 0, "a positive number of tokens")}}


def check_hf_files(model_dir):
    """A Hugging Face dir's config.json and tokenizer_config.json, where present: JSON objects whose fields
    the kit reads have their types (HF_FIELDS); one sentence naming the file and the field otherwise."""
    for name, fields in HF_FIELDS.items():
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        got = read_json(path)
        for key, (ok, what) in fields.items():
            if key in got and not ok(got[key]):
                bad_field(path, key, got[key], what)


def is_cross_encoder(model_dir):
    """Is `model_dir` a sentence-transformers CrossEncoder dir (its config says so, or a LogitScore module)?"""
    st_config = os.path.join(model_dir, "config_sentence_transformers.json")
    if os.path.isfile(st_config) and read_json(st_config).get("model_type") == "CrossEncoder":
        return True
    modules = read_modules(model_dir) or []
    return any(m.get("type", "").endswith("LogitScore") for m in modules)


def hidden_size_of(model_dir):
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    config = read_json(path)
    size = config.get("hidden_size", config.get("d_model"))
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def check_linear(model_dir, part, hidden, what):
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



"""--head multi-vector: late interaction (ColBERT). Every token's state through a bias-free linear
projection, L2-normalized; a query scores a passage by MaxSim, the sum over the query's tokens of its
best dot product with any of the passage's tokens, as sentence-transformers' MultiVectorEncoder and
PyLate do (query expansion and a skiplist: MaxSimSide). The interface: heads/__init__.py."""

import os
import string

import torch
import torch.nn.functional as F

from ..chunking import Chunked, run_chunked
from ..flags import Flag, positive_int
from ..models import STDense, load_encoder
from ..st_format import (bad_field, check_length, check_words, is_length, is_words, max_length, module_kinds,
                         read_json, read_modules, read_prompts, write_json_files)

NAME = "multi-vector"
TEMPERATURE = 1.0  # MaxSim sums over the query's tokens: PyLate's and sentence-transformers' scale 1
# --query-expansion / --skiplist -> its settings query_expansion / skiplist_words (maxsim_sides)
QUERY_EXPANSION = {"off": False, "on": {"attend": False, "token": None}, "attend": {"attend": True, "token": None}}
SKIPLISTS = {"none": [], "punctuation": list(string.punctuation)}
FLAGS = {  # its flags (cli.py adds them to the bi-encoder script's parser; cli.head_flags checks them)
    "multi_vector_dim": Flag(
        128, "--multi-vector-dim", type=positive_int,
        help="--head multi-vector: the size of each token's vector (default 128, as sentence-transformers' "
             "MultiVectorEncoder; a MultiVectorEncoder dir's own projection keeps its size)"),
    "query_expansion": Flag(
        None, "--query-expansion", choices=tuple(QUERY_EXPANSION), setting=("query_expansion", QUERY_EXPANSION),
        help="--head multi-vector: ColBERT's query expansion. on = every query padded to --query-max-length with "
             "the [MASK] token (the tokenizer's mask token, else its EOS), which MaxSim scores and the encoder does "
             "not attend to; attend = the encoder attends to them too (PyLate's attend_to_expansion_tokens); off = "
             "none (default: the model dir's - a PyLate or Stanford ColBERT dir expands - else off, as "
             "sentence-transformers' MultiVectorEncoder)"),
    "skiplist": Flag(
        None, "--skiplist", choices=tuple(SKIPLISTS), setting=("skiplist_words", SKIPLISTS),
        help="--head multi-vector: passage tokens MaxSim does not score. punctuation = each character of Python's "
             "string.punctuation that is one token (ColBERT's and PyLate's default) (default: the model dir's, else "
             "none, as sentence-transformers' MultiVectorEncoder)"),
}
RESUME_FIXED = {"multi_vector_dim": "its token projection has that many rows: start a new run (another --output-dir) "
                                    "to train another size"}  # what a resume cannot change (rundir.start_run)
LOAD_FLAGS = ("multi_vector_dim",)  # the flags load() takes (heads.load_args); an export keeps it in its settings
SETTINGS = {"query_expansion": False, "skiplist_words": []}  # its tokenization (maxsim_sides): MultiVectorEncoder's
# defaults, neither; read from the flags, the export, the dir's files in that order (heads.biencoder_settings)
MAX_DIM = 4096  # --multi-vector-dim beyond this is one sentence (ColBERT uses 128)
PREFIX = "multi_vector."
STORAGE = torch.bfloat16  # a corpus's token vectors in evaluate and mine (scored in fp32, maxsim): 2 bytes a number
MAXSIM_BLOCK = 1 << 22  # elements of one block of token-pair similarities (16 MiB in fp32)
RECORD_FIELDS = {  # what it keeps in an export's retrieval_kit.json: (check, what it must be)
    "multi_vector_dim": (is_length, "a positive whole number"),
    "skiplist_words": (is_words, "a list of non-empty strings"),
    "query_expansion": (lambda v: v is False or v is None or (isinstance(v, dict) and isinstance(v.get("token") or "",
                                                                                                  str)),
                        "false, or an object with attend and token"),
}


# ----- the model ---------------------------------------------------------------------------------

def load(path, dtype=torch.float32, *, spec=None, meta=False, multi_vector_dim=None, seed=0, **load_kw):
    """The encoder with its token projection as `model.multi_vector` (an STDense with no activation:
    sentence-transformers' token-level Dense of a MultiVectorEncoder), trained with the encoder. A dir
    that brings one (its spec's projection: MultiVectorEncoder, PyLate, Stanford ColBERT) gives its size
    and weights; else `dim` wide, drawn as torch's nn.Linear init from a generator seeded by `seed`:
    the same on every rank and in every world size."""
    model = load_encoder(path, dtype, meta=meta, **load_kw)
    projection = spec.own.get("projection") if spec is not None else None
    hidden = model.config.hidden_size
    dim = projection["out_features"] if projection is not None else multi_vector_dim or FLAGS["multi_vector_dim"].default
    if dim > MAX_DIM:
        raise SystemExit(f"--multi-vector-dim {dim}: at most {MAX_DIM} (ColBERT projects to 128)")
    with torch.device("meta" if meta else "cpu"):
        dense = STDense(hidden, dim, bias=False, activation_function="torch.nn.modules.linear.Identity")
    if not meta:
        if projection is not None:
            from safetensors import safe_open

            with safe_open(os.path.join(projection["path"], "model.safetensors"), "pt") as f:  # (Stanford: the model's)
                dense.load_state_dict({"linear.weight": f.get_tensor(projection["key"])})
        else:
            bound = 1.0 / hidden ** 0.5  # nn.Linear's kaiming_uniform(a=sqrt(5)) bound, from a fixed generator
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                dense.linear.weight.uniform_(-bound, bound, generator=gen)
    model.multi_vector = dense.to(next(model.parameters()).dtype)
    return model


def lora_trained(model):
    return list(model.multi_vector.parameters())


def embedding_size(model):
    """The size of each token's vector."""
    return model.multi_vector.linear.out_features


def token_vectors(model, batch, width=None):
    """Each token's state through `model.multi_vector`, L2-normalized, in fp32: (B, width, dim + 1), the
    last channel the token mask (1 = a token MaxSim scores, 0 = padding; the batch's "maxsim_mask" where
    MaxSimSide made one: query expansion, a skiplist), padded with zero rows to `width` (None:
    the batch's own) so chunks and ranks concatenate."""
    extra = {k: batch[k] for k in ("token_type_ids", "position_ids") if k in batch}
    hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra).last_hidden_state
    dense = model.multi_vector
    vec = F.normalize(dense(hidden.to(dense.linear.weight.dtype)).float(), dim=-1)
    mask = batch.get("maxsim_mask", batch["attention_mask"]).to(vec.dtype).unsqueeze(-1)
    out = torch.cat([vec * mask, mask], dim=-1)
    if width is not None:
        if out.shape[1] > width:
            raise ValueError(f"a batch {out.shape[1]} tokens wide; the multi-vector width is {width}")
        out = F.pad(out, (0, 0, 0, width - out.shape[1]))
    return out


class LateInteraction(torch.nn.Module):
    """Encoder + token projection as one module (one forward per backward, as BiEncoder):
    `model(q=q_batch, p=p_batch)` -> {"q": (B, Wq, dim + 1), "p": (B * n, Wp, dim + 1)} (token_vectors),
    each name padded to its width in `widths` ({name: tokens}; others: their batch's own). A batch is a
    tokenized dict or a chunking.Chunked."""

    def __init__(self, encoder, widths=None):
        super().__init__()
        self.encoder, self.widths = encoder, dict(widths or {})
        self.train(encoder.training)  # a wrapper takes its model's mode (from_pretrained: eval)

    def embed(self, batch, width=None):
        if isinstance(batch, Chunked):
            width = width or batch.batch["input_ids"].shape[1]
            return run_chunked(lambda b: token_vectors(self.encoder, b, width), batch)
        return token_vectors(self.encoder, batch, width)

    def forward(self, **batches):
        return {name: self.embed(b, self.widths.get(name)) for name, b in batches.items()}


def dir_flags(spec):
    """The flags a dir fixes: a projection it brings is --multi-vector-dim wide (cli.head_flags refuses another)."""
    projection = spec.own.get("projection")
    return {"multi_vector_dim": projection["out_features"]} if projection is not None else {}


def embedder(model, settings, multiple=None):
    """LateInteraction padded to the max lengths as collate pads them, so chunks and ranks concatenate."""
    widths = {"q": settings["query_max_length"], "p": settings["passage_max_length"]}
    return LateInteraction(model, {k: -(-n // multiple) * multiple if multiple else n for k, n in widths.items()})


def prepare(tokenizer, model, settings):
    """Prefixes that are one vocabulary token ("[unused0] ", Stanford ColBERT's markers) stay one token
    (register_markers; the export's tokenizer keeps them); the projection's size."""
    markers = register_markers(tokenizer, [settings["query_prefix"], settings["passage_prefix"]])
    return {"multi_vector_dim": model.multi_vector.linear.out_features, **({"markers": markers} if markers else {})}


def sides(tokenizer, settings):
    return maxsim_sides(tokenizer, settings)


# ----- its tokenization: query expansion, the skiplist, whole-token markers ------------------------

class MaxSimSide:
    """How --head multi-vector tokenizes one side (queries or passages), as sentence-transformers'
    MultiVectorEncoder does (its Transformer's query_expansion, its MultiVectorMask's skiplist):

      expansion_id: the query side's ColBERT query expansion (None: off): every query is padded to
                    its max length and its pad positions take this id (the [MASK] token), which
                    MaxSim scores; the encoder attends to them only with `attend`
      skip_ids:     ids MaxSim does not score (ColBERT's punctuation, on the passage side)

    collate.tokenize applies it: it adds "maxsim_mask" to the batch, the tokens MaxSim scores
    (token_vectors). Built by `maxsim_sides` from a model's settings."""

    def __init__(self, expansion_id=None, attend=False, skip_ids=()):
        self.expansion_id, self.attend = expansion_id, attend
        self.skip_ids = torch.tensor(sorted(set(skip_ids)), dtype=torch.long)
        self.fixed_width = expansion_id is not None  # (collate.tokenize pads such a side to its max length)

    def apply(self, batch):
        mask = batch["attention_mask"]
        score = mask.bool()
        if self.expansion_id is not None:  # (right padding: maxsim_sides refuses left)
            pads = mask == 0
            batch["input_ids"] = batch["input_ids"].masked_fill(pads, self.expansion_id)
            score = score | pads
            if self.attend:
                batch["attention_mask"] = mask.masked_fill(pads, 1)
        if len(self.skip_ids):
            score = score & ~torch.isin(batch["input_ids"], self.skip_ids)
        batch["maxsim_mask"] = score.to(mask.dtype)
        return batch


def skiplist_ids(tokenizer, words):
    """The ids of a skiplist's words, as MultiVectorMask resolves them: each word's id in the vocabulary,
    a word that is not one token (the unknown token's id) left out."""
    unk = tokenizer.unk_token_id
    ids = [tokenizer.convert_tokens_to_ids(w) for w in words]
    return [i for i, w in zip(ids, words) if i is not None and (i != unk or w == tokenizer.unk_token)]


def maxsim_sides(tokenizer, settings):
    """{"q": MaxSimSide | None, "p": MaxSimSide | None} of a --head multi-vector model's settings
    (query_expansion: None or {"attend", "token"}; skiplist_words: the passage side's); both None for a
    multi-vector model with neither (sides)."""
    q = p = None
    expansion = settings.get("query_expansion")
    if expansion:
        token = expansion.get("token")
        token_id = tokenizer.convert_tokens_to_ids(token) if token else (
            tokenizer.mask_token_id if tokenizer.mask_token_id is not None else tokenizer.eos_token_id)
        if token_id is None:
            raise SystemExit(f"--query-expansion: {type(tokenizer).__name__} has no mask token and no EOS token to "
                             "expand queries with; pass --query-expansion off")
        if tokenizer.padding_side == "left":
            raise SystemExit("--query-expansion: the tokenizer pads on the left (a decoder); ColBERT's query "
                             "expansion fills the padding after each query: pass --query-expansion off")
        q = MaxSimSide(token_id, bool(expansion.get("attend")))
    if settings.get("skiplist_words"):
        p = MaxSimSide(skip_ids=skiplist_ids(tokenizer, settings["skiplist_words"]))
    return {"q": q, "p": p}


def register_markers(tokenizer, markers):
    """Make prefix markers ("[Q] ", "[unused0] ") single tokens when the tokenizer knows them but would
    split them, as MultiVectorEncoder does on loading a PyLate or Stanford ColBERT dir: each marker (or its
    first word) that is in the vocabulary or an added token, and does not tokenize to itself, becomes a
    special token that is not normalized. Prepending the marker as text then gives the ids PyLate
    inserted. Returns the tokens registered."""
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


# ----- MaxSim ------------------------------------------------------------------------------------

def maxsim_blocks(n_queries, q_width, n_passages, p_width, budget=MAXSIM_BLOCK):
    """[(start, end)] ranges of passages scored together by maxsim, each block's (queries, passages,
    query tokens, passage tokens) similarity tensor at most `budget` elements (at least one passage)."""
    step = max(1, budget // max(1, n_queries * q_width * p_width))
    return [(s, min(s + step, n_passages)) for s in range(0, n_passages, step)]


def _maxsim_block(qv, q_mask, p):
    pv, pad = p[..., :-1].float(), p[..., -1] == 0  # (a bf16-stored corpus: one block in fp32)
    sim = torch.einsum("aqd,bkd->abqk", qv, pv).masked_fill(pad[None, :, None, :], -1e4)
    return (sim.amax(-1) * q_mask[:, None, :]).sum(-1)  # (Q, block)


def maxsim(q, p, budget=MAXSIM_BLOCK):
    """Late-interaction scores in fp32: (Q, P) from q: (Q, Wq, d + 1), p: (P, Wp, d + 1) token vectors
    with the token mask as the last channel (token_vectors): a query's padding adds nothing, a passage's
    padding never wins. Columns that are padding in every row are dropped first; then blocks of passages
    (maxsim_blocks) are scored one at a time, and under autograd each block is recomputed in the backward
    (activation checkpointing) instead of kept: the (Q, P, Wq, Wp) similarities never exist at once."""
    from torch.utils.checkpoint import checkpoint

    with torch.autocast(q.device.type, enabled=False):
        q, p = q[:, q[..., -1].any(0)], p[:, p[..., -1].any(0)]
        qv, q_mask = q[..., :-1].float(), q[..., -1].float()
        grad = torch.is_grad_enabled() and (q.requires_grad or p.requires_grad)
        out = [checkpoint(_maxsim_block, qv, q_mask, p[s:e], use_reentrant=False) if grad
               else _maxsim_block(qv, q_mask, p[s:e])
               for s, e in maxsim_blocks(q.shape[0], q.shape[1], p.shape[0], p.shape[1], budget)]
        return torch.cat(out, dim=1) if out else qv.new_zeros((q.shape[0], 0))


def pair_scores(q, p):
    """maxsim of each (q[i], p[i]) pair: (N,) fp32, from (N, Wq, d + 1) and (N, Wp, d + 1) token vectors."""
    with torch.autocast(q.device.type, enabled=False):
        sim = torch.einsum("nqd,nkd->nqk", q[..., :-1].float(), p[..., :-1].float())
        sim = sim.masked_fill((p[..., -1] == 0)[:, None, :], -1e4)
        return (sim.amax(-1) * q[..., -1].float()).sum(-1)


def scores(q, p, n_passages, in_batch=True):
    """MaxSim logits in fp32: (B, P) with in-batch negatives, (B, n_passages) without."""
    if in_batch:
        return maxsim(q, p)
    groups = p.view(q.shape[0], n_passages, *p.shape[1:])
    return torch.cat([maxsim(q[i:i + 1], groups[i]) for i in range(q.shape[0])])  # (B, n)


# ----- corpus, search ----------------------------------------------------------------------------

def store(reps, width, dtype=STORAGE):
    """(rows, width, dim + 1) token vectors in `dtype` (columns past `width`, which a configured width
    may add, are padding: cut)."""
    return F.pad(reps, (0, 0, 0, width - reps.shape[1])).to(dtype or STORAGE).cpu()


def search(q, p, k, query_chunk=64, corpus_chunk=1024):
    """Exact top-k by MaxSim (fp32, in blocks of at most MAXSIM_BLOCK token pairs) for query_chunk x
    corpus_chunk blocks, merged into a running top-k: besides the stored vectors, memory holds one
    block's similarities and one corpus chunk in fp32."""
    from ..search import exact_topk

    return exact_topk(q.float(), p, k, query_chunk, corpus_chunk, score=maxsim)


# ----- export ------------------------------------------------------------------------------------

def split_export(weights):
    return {k[len(PREFIX):]: weights.pop(k) for k in list(weights) if k.startswith(PREFIX)}


def write_export(stage, model, settings, head_weights, out_dir):
    """MultiVectorEncoder's files (write_files), the projection's weights in 1_Dense."""
    from safetensors.torch import save_file

    write_files(stage, settings, model.config.hidden_size, model.multi_vector.linear.out_features)
    save_file({k: v.contiguous() for k, v in head_weights.items()}, os.path.join(stage, "1_Dense", "model.safetensors"))
    return {"files": True, "warnings": []}


def memory_note(model):
    return (f"multi-vector head: the projection ({model.config.hidden_size} x {model.multi_vector.linear.out_features}) "
            f"is in the plan; MaxSim scores are computed in blocks of at most {MAXSIM_BLOCK:,} token-pair "
            f"similarities ({MAXSIM_BLOCK * 4 / 2 ** 20:.0f} MiB in fp32, maxsim_blocks), plus the "
            "gathered token vectors: ranks x queries x width x (dim + 1) fp32 numbers, passages likewise")


# ----- its dir: MultiVectorEncoder, PyLate and Stanford ColBERT layouts --------------------------

def read_dir(model_dir):
    """Its part of a dir's spec (heads.read_spec asks each head in turn): None for a dir of another kind,
    else (the dir's sentence-transformers settings in the kit's keys, its own part: the projection, the
    markers its tokenizer keeps whole, the linear modules to check against the model)."""
    found = read_multi_vector(model_dir)
    if found is None:
        return None
    max_len = max_length(model_dir)
    st = {**({"query_max_length": max_len, "passage_max_length": max_len} if max_len else {}), **found["settings"]}
    projection = {k: v for k, v in found.items() if k not in ("settings", "markers")}
    markers = list(found["markers"])
    return st, {"projection": projection, "linear": [(projection, "token projection")],
                "tokenizer": [lambda tokenizer: register_markers(tokenizer, markers)] if markers else [],
                "what": "a multi-vector (ColBERT-style) dir, with its token projection"}


MULTI_VECTOR_LAYOUT = ("Transformer", "Dense", "MultiVectorMask", "Normalize")  # MultiVectorEncoder's default
PUNCTUATION = list(string.punctuation)  # PyLate's and Stanford ColBERT's default skiplist


def _colbert_config(model_dir):
    """The ColBERT settings of a PyLate dir (at the top of its config_sentence_transformers.json) or of a
    Stanford-NLP ColBERT dir (its artifact.metadata), in PyLate's names; None for any other dir."""
    config = os.path.join(model_dir, "config.json")
    if os.path.isfile(config) and "HF_ColBERT" in (read_json(config).get("architectures") or []):
        meta_path = os.path.join(model_dir, "artifact.metadata")
        meta = read_json(meta_path) if os.path.isfile(meta_path) else {}
        for key in ("query_token_id", "doc_token_id"):
            if not isinstance(meta.get(key) or "", str):
                bad_field(meta_path, key, meta[key], "a marker token, a string")
        return {"stanford": True, "source": meta_path, "query_prefix": (meta.get("query_token_id") or "[unused0]") + " ",
                "document_prefix": (meta.get("doc_token_id") or "[unused1]") + " ",
                "query_length": check_length(meta_path, "query_maxlen", meta.get("query_maxlen")) or 32,
                "document_length": check_length(meta_path, "doc_maxlen", meta.get("doc_maxlen")),
                "do_query_expansion": True, "attend_to_expansion_tokens": bool(meta.get("attend_to_mask_tokens")),
                "skiplist_words": PUNCTUATION if meta.get("mask_punctuation", True) else []}
    st_config = os.path.join(model_dir, "config_sentence_transformers.json")
    c = read_json(st_config) if os.path.isfile(st_config) else {}
    pylate = ("query_prefix", "document_prefix", "do_query_expansion", "attend_to_expansion_tokens", "skiplist_words")
    if c.get("model_type") == "ColBERT" or any(k in c for k in pylate):
        for key in ("query_prefix", "document_prefix"):
            if not isinstance(c.get(key) or "", str):
                bad_field(st_config, key, c[key], "a marker, a string")
        for key in ("query_length", "document_length"):
            c[key] = check_length(st_config, key, c.get(key))
        if c.get("skiplist_words") is not None:
            c["skiplist_words"] = check_words(st_config, "skiplist_words", c["skiplist_words"])
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
        modules = read_modules(model_dir)
        kinds = module_kinds(modules)
        pylate = legacy is not None and kinds == ("Transformer", "Dense")
        if "MultiVectorMask" not in kinds and not pylate:
            return None
        if kinds != MULTI_VECTOR_LAYOUT and not pylate:
            _refuse_mv(modules_path, f"modules {', '.join(kinds)} (the kit carries {', '.join(MULTI_VECTOR_LAYOUT)}, "
                                     "or PyLate's Transformer, Dense)")
        dense_path = os.path.join(model_dir, modules[1].get("path", ""), "config.json")
        dense = read_json(dense_path)
        if dense.get("bias") or dense.get("use_residual") or dense.get(
                "activation_function", "torch.nn.modules.linear.Identity") != "torch.nn.modules.linear.Identity":
            _refuse_mv(modules_path, "a token projection with a bias, a residual or an activation (the kit trains a "
                                     "bias-free linear one)")
        spec = {"path": os.path.join(model_dir, modules[1].get("path", "")), "key": "linear.weight",
                "in_features": check_length(dense_path, "in_features", dense.get("in_features"), optional=False),
                "out_features": check_length(dense_path, "out_features", dense.get("out_features"), optional=False),
                "config": dense_path}
    sbert_path = os.path.join(model_dir, "sentence_bert_config.json")
    sbert = read_json(sbert_path) if os.path.isfile(sbert_path) else {}
    prompts = {}
    out = {"head": NAME, "normalize": True}
    markers = []
    if legacy is not None:  # PyLate / Stanford: the markers go before the prompts, kept whole as tokens
        st_config = os.path.join(model_dir, "config_sentence_transformers.json")
        given = (read_json(st_config).get("prompts") or {}) if os.path.isfile(st_config) else {}
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
        mask = read_json(mask_path)
        tasks = mask.get("skiplist_tasks", ["document"])
        if mask.get("keep_only_token_ids") or (mask.get("skiplist_words") and list(
                [tasks] if isinstance(tasks, str) else tasks if isinstance(tasks, list) else [tasks]) != ["document"]):
            _refuse_mv(modules_path, "a MultiVectorMask with an allowlist (keep_only_token_ids) or a skiplist on "
                                     "queries (the kit carries a skiplist on documents)")
        out["skiplist_words"] = check_words(mask_path, "skiplist_words", mask.get("skiplist_words") or [])
        expansion = sbert.get("query_expansion")
        if expansion and not isinstance(expansion, dict):
            bad_field(sbert_path, "query_expansion", expansion, "an object (strategy, length, attend, token) or null")
        if expansion and expansion.get("strategy") != "fixed":
            _refuse_mv(modules_path, f"query expansion of strategy {expansion.get('strategy')!r} (the kit expands "
                                     "queries to a fixed width: strategy 'fixed')")
        if expansion and not isinstance(expansion.get("token") or "", str):
            bad_field(sbert_path, "query_expansion.token", expansion.get("token"), "a token, a string, or null")
        out["query_expansion"] = {"attend": bool(expansion.get("attend")), "token": expansion.get("token")} \
            if expansion else False
        for key, ours in (("query_length", "query_max_length"), ("document_length", "passage_max_length")):
            if sbert.get(key) is not None:
                out[ours] = check_length(sbert_path, key, sbert[key])
        if expansion:
            out["query_max_length"] = check_length(sbert_path, "query_expansion.length", expansion.get("length"),
                                                   optional=False)
    out.update(read_prompts(model_dir, prompts))
    return {**spec, "settings": out, "markers": markers}


def _refuse_mv(modules_path, problem):
    raise SystemExit(f"{modules_path}: {problem}; the kit does not reproduce it: fine-tune it with "
                     "sentence-transformers")


def write_files(out_dir, settings, hidden_size, dim):
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
    write_json_files(out_dir, files)

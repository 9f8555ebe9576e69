"""--head multi-vector: late interaction (ColBERT). Every token's state through a bias-free linear
projection, L2-normalized; a query scores a passage by MaxSim, the sum over the query's tokens of its
best dot product with any of the passage's tokens, as sentence-transformers' MultiVectorEncoder and
PyLate do (query expansion and a skiplist: collate.MaxSimSide). The interface: heads/__init__.py."""

import os

import torch
import torch.nn.functional as F

from ..chunking import Chunked, run_chunked
from ..models import STDense, load_encoder

NAME = "multi-vector"
TEMPERATURE = 1.0  # MaxSim sums over the query's tokens: PyLate's and sentence-transformers' scale 1
FLAGS = {"multi_vector_dim": 128, "query_expansion": None, "skiplist": None}
SETTINGS = {"query_expansion": False, "skiplist_words": []}  # its tokenization (collate.maxsim_sides): MultiVectorEncoder's
# defaults, neither; read from the flags, the export, the dir's files in that order (st_format.resolve_biencoder_settings)
MAX_DIM = 4096  # --multi-vector-dim beyond this is one sentence (ColBERT uses 128)
PREFIX = "multi_vector."
STORAGE = torch.bfloat16  # a corpus's token vectors in evaluate and mine (scored in fp32, maxsim): 2 bytes a number
MAXSIM_BLOCK = 1 << 22  # elements of one block of token-pair similarities (16 MiB in fp32)


# ----- the model ---------------------------------------------------------------------------------

def load(path, dtype=torch.float32, *, spec=None, meta=False, dim=None, seed=0, **load_kw):
    """The encoder with its token projection as `model.multi_vector` (an STDense with no activation:
    sentence-transformers' token-level Dense of a MultiVectorEncoder), trained with the encoder. A dir
    that brings one (its spec's projection: MultiVectorEncoder, PyLate, Stanford ColBERT) gives its size
    and weights; else `dim` wide, drawn as torch's nn.Linear init from a generator seeded by `seed`:
    the same on every rank and in every world size."""
    model = load_encoder(path, dtype, meta=meta, **load_kw)
    projection = spec.projection if spec is not None else None
    hidden = model.config.hidden_size
    dim = projection["out_features"] if projection is not None else dim or FLAGS["multi_vector_dim"]
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
    collate.MaxSimSide made one: query expansion, a skiplist), padded with zero rows to `width` (None:
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
    return {"multi_vector_dim": spec.projection["out_features"]} if spec.projection is not None else {}


def serving(settings):
    return {}  # (its sentence-transformers files keep per-task lengths: queries are read at the trained length)


def embedder(model, settings, multiple=None):
    """LateInteraction padded to the max lengths as collate pads them, so chunks and ranks concatenate."""
    widths = {"q": settings["query_max_length"], "p": settings["passage_max_length"]}
    return LateInteraction(model, {k: -(-n // multiple) * multiple if multiple else n for k, n in widths.items()})


def prepare(tokenizer, model, settings):
    """Prefixes that are one vocabulary token ("[unused0] ", Stanford ColBERT's markers) stay one token
    (models.register_markers; the export's tokenizer keeps them); the projection's size."""
    from ..models import register_markers

    markers = register_markers(tokenizer, [settings["query_prefix"], settings["passage_prefix"]])
    return {"multi_vector_dim": model.multi_vector.linear.out_features, **({"markers": markers} if markers else {})}


def sides(tokenizer, settings):
    from ..collate import maxsim_sides

    return maxsim_sides(tokenizer, settings)


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


def stack(rows):
    return torch.stack(rows)


def select(stored, index):
    return stored[index]


def as_dense(stored):
    return stored


def search(q, p, k, query_chunk=64, corpus_chunk=1024):
    """Exact top-k by MaxSim (fp32, in blocks of at most MAXSIM_BLOCK token pairs) for query_chunk x
    corpus_chunk blocks, merged into a running top-k: besides the stored vectors, memory holds one
    block's similarities and one corpus chunk in fp32."""
    from ..search import exact_topk

    return exact_topk(q.float(), p, k, query_chunk, corpus_chunk, score=maxsim)


def corpus_stats(q, p):
    return {}


def empty_rows(stored):
    return 0  # (a normalized vector, a token's vector: never all zero)


def regularizer(flags, state, count_scale=1.0, max_steps=0):
    return None


# ----- export ------------------------------------------------------------------------------------

def split_export(weights):
    return {k[len(PREFIX):]: weights.pop(k) for k in list(weights) if k.startswith(PREFIX)}


def write_export(stage, model, settings, head_weights, out_dir):
    """MultiVectorEncoder's files (st_format.write_multi_vector_files), the projection's weights in 1_Dense."""
    from safetensors.torch import save_file

    from ..st_format import write_multi_vector_files

    write_multi_vector_files(stage, settings, model.config.hidden_size, model.multi_vector.linear.out_features)
    save_file({k: v.contiguous() for k, v in head_weights.items()}, os.path.join(stage, "1_Dense", "model.safetensors"))
    return {"files": True, "warnings": []}


def memory_note(model):
    return (f"multi-vector head: the projection ({model.config.hidden_size} x {model.multi_vector.linear.out_features}) "
            f"is in the plan; MaxSim scores are computed in blocks of at most {MAXSIM_BLOCK:,} token-pair "
            f"similarities ({MAXSIM_BLOCK * 4 / 2 ** 20:.0f} MiB in fp32, maxsim_blocks), plus the "
            "gathered token vectors: ranks x queries x width x (dim + 1) fp32 numbers, passages likewise")

"""--head csr: Contrastive Sparse Representation (CSR; Wen et al. 2025, arXiv 2503.01776). A dense model's
pooled vector goes through a sparse auto-encoder - hidden x 4 latents, the top k kept - and those latents,
scored by the dot product, are the text's sparse vector; no vocabulary head at all, so any one-vector model
(MiniLM) starts it. Trained with InfoNCE on the latents plus the auto-encoder's reconstruction terms: of the
pooled vector from the top k, from the top 4k (/ 8), and of what the top k missed from the top k_aux of the
dead latents (x --csr-aux-weight), as sentence-transformers' CSRLoss. Exported as sentence-transformers'
SparseEncoder (Transformer, Pooling, SparseAutoEncoder); stored and searched as the sparse head's vectors.
The interface: heads/__init__.py."""

import os

import torch
import torch.nn.functional as F

from ..chunking import Chunked, run_chunked
from ..flags import Flag, nonneg_float, positive_int
from ..losses import contrastive_scores
from ..models import load_encoder
from ..st_format import module_kinds, read_json, read_modules, read_st_settings, write_json_files
from . import single_vector, sparse

NAME = "csr"
TEMPERATURE = 1.0  # the dot product of unnormalized latents, scale 1, as CSRLoss's SparseMultipleNegativesRankingLoss
FLAGS = {  # its flags (cli.py adds them to the bi-encoder script's parser; cli.head_flags checks them)
    "pooling": Flag(),  # (declared by cli.py for every tool; no --normalize: the auto-encoder reads the pooled vector)
    "csr_dim": Flag(
        None, "--csr-dim", type=positive_int,
        help="--head csr: the auto-encoder's latents, the size of the sparse vector (default 4 x the model's hidden "
             "size, as CSR; a CSR dir's own)"),
    "csr_k": Flag(
        None, "--csr-k", type=positive_int,
        help="--head csr: the latents kept per text, its non-zeros (default the dir's, else 256 as sentence-"
             "transformers' CSR examples; 8 bytes each in the index: 192 is one fp32 vector of MiniLM's 384)"),
    "csr_aux_weight": Flag(
        0.1, "--csr-aux-weight", group="loss", type=nonneg_float,
        help="--head csr: the weight of the dead latents' auxiliary reconstruction (default 0.1, CSRLoss's beta)"),
}
LOAD_FLAGS = ("csr_dim", "csr_k")  # the flags load() takes (heads.load_args)
RESUME_FIXED = {"csr_dim": "the auto-encoder has that many latents: start a new run (another --output-dir) for "
                           "another size",
                "csr_k": "the latents kept per text are what the run trains: start a new run for another k"}
K, K_AUX, DEAD_AFTER = 256, 512, 30  # sentence-transformers' CSR defaults: kept, auxiliary, forwards until dead
PREFIX = "csr."  # the auto-encoder's keys in the model's state dict
EXTRA = 4  # rows of a training vector after its latents: the reconstruction terms (SparseAutoEncoderCSR.forward)
MODULE = "sentence_transformers.sparse_encoder.modules.sparse_auto_encoder.SparseAutoEncoder"


# ----- the model ---------------------------------------------------------------------------------

class SparseAutoEncoderCSR(torch.nn.Module):
    """sentence-transformers' SparseAutoEncoder (its parameter names and its tied decoder): latents =
    top_k(relu(W (x - pre_bias) + latent_bias)), x decoded as W^T latents + pre_bias. `stats_last_nonzero`:
    for each latent, the forwards with a graph since it was last among the top k (or 4k) of a text - as
    theirs counts them; more than `dead_after` and it is dead, and the auxiliary term trains the top k_aux
    of those. Run in fp32 whatever the compute dtype (top k of rounded latents would pick others)."""

    def __init__(self, input_dim, hidden_dim, k=K, k_aux=K_AUX, dead_after=DEAD_AFTER):
        super().__init__()
        self.k, self.k_aux, self.dead_after = min(k, hidden_dim), min(k_aux, hidden_dim), dead_after
        self.pre_bias = torch.nn.Parameter(torch.zeros(input_dim))
        self.encoder = torch.nn.Linear(input_dim, hidden_dim, bias=False)
        self.latent_bias = torch.nn.Parameter(torch.zeros(hidden_dim))
        self.register_buffer("stats_last_nonzero", torch.zeros(hidden_dim, dtype=torch.long))

    def config(self):
        """Its config.json as sentence-transformers' SparseAutoEncoder reads it."""
        return {"input_dim": self.encoder.in_features, "hidden_dim": self.encoder.out_features, "k": self.k,
                "k_aux": self.k_aux, "normalize": False, "dead_threshold": self.dead_after}

    def top(self, z, k, count):
        """relu of the top k of `z` where they are, zeros elsewhere; `count`: the kept latents reset their counters."""
        top = z.topk(k, dim=-1)
        if count:
            fired = torch.zeros_like(self.stats_last_nonzero)
            fired.scatter_add_(0, top.indices.reshape(-1), (top.values > 1e-5).long().reshape(-1))
            self.stats_last_nonzero.mul_(1 - fired.clamp(max=1)).add_(1)
        return torch.zeros_like(z).scatter(-1, top.indices, top.values).relu()

    def forward(self, x, extras):
        """(latents (B, hidden_dim), or with `extras` (training) also the reconstruction terms (B, EXTRA, H):
        x - decoded top k, x - decoded top 4k, decoded auxiliary - what top k missed, what top k missed)."""
        with torch.autocast(x.device.type, enabled=False):
            w, pre, lat = self.encoder.weight.float(), self.pre_bias.float(), self.latent_bias.float()
            x = x.float()
            z = F.linear(x - pre, w, lat)
            count = extras and torch.is_grad_enabled()
            latents = self.top(z, self.k, count)
            if not extras:
                return latents, None
            dead = self.stats_last_nonzero > self.dead_after  # (after this forward's count, as theirs reads it)
            missed = x - (latents @ w).detach()  # x less the top k's decoding without its bias
            aux = self.top(z * dead, self.k_aux, False) @ w + pre if self.k_aux else missed
            four = self.top(z, min(4 * self.k, z.shape[-1]), count)
            terms = [x - (latents @ w + pre), x - (four @ w + pre), aux - missed, missed]
        return latents, torch.stack(terms, dim=1)


def load(path, dtype=torch.float32, *, spec=None, meta=False, seed=0, csr_dim=None, csr_k=None, **load_kw):
    """The encoder with its auto-encoder as `model.csr`: a CSR dir's (its spec's), else fresh - csr_dim
    latents (4 x hidden), W drawn as torch's nn.Linear init from a generator seeded by `seed` (the same on
    every rank and world size), the biases zero, as sentence-transformers starts one."""
    model = load_encoder(path, dtype, meta=meta, **load_kw)
    own = spec.own.get("sae") if spec is not None else None
    hidden = model.config.hidden_size
    config = own["config"] if own else {}
    dim = config.get("hidden_dim") or csr_dim or 4 * hidden
    if (csr_k or 0) > dim:
        raise SystemExit(f"--csr-k {csr_k}: more than the auto-encoder's {dim} latents (--csr-dim); give at most {dim}")
    with torch.device("meta" if meta else "cpu"):
        sae = SparseAutoEncoderCSR(hidden, dim, csr_k or config.get("k", K), config.get("k_aux", K_AUX),
                                   config.get("dead_threshold", DEAD_AFTER))
    if not meta and own:
        sae.load_state_dict(own_weights(own["path"]))
    elif not meta:
        bound = 1.0 / hidden ** 0.5  # nn.Linear's kaiming_uniform(a=sqrt(5)) bound
        with torch.no_grad():
            sae.encoder.weight.uniform_(-bound, bound, generator=torch.Generator().manual_seed(seed))
    if not own:  # (merge: a fresh auto-encoder is the tuned model's alone, never averaged with its start)
        model.fresh_keys = [*getattr(model, "fresh_keys", []), *(PREFIX + k for k in sae.state_dict())]
    model.csr = sae.to(next(model.parameters()).dtype)  # (the counters stay integers)
    return model


def own_weights(folder):
    """A SparseAutoEncoder folder's weights in the module's names (its tied weight saved as either name)."""
    from safetensors.torch import load_file

    weights = load_file(os.path.join(folder, "model.safetensors"))
    if "encoder.weight" not in weights:
        weights["encoder.weight"] = weights.pop("decoder.linear.weight")
    weights.pop("decoder.linear.weight", None)
    return weights


def lora_trained(model):
    return list(model.csr.parameters())


def embedding_size(model):
    return model.csr.encoder.out_features


def prepare(tokenizer, model, settings):
    return {"normalize": False}  # (the auto-encoder reads the pooled vector as it is, as CSR does)


serving = single_vector.serving  # (sentence-transformers reads queries up to the passages' length)


class CSR(torch.nn.Module):
    """The model the step runs: `model(q=q_batch, p=p_batch)` -> {"q", "p"}: (B, hidden_dim) latents, or in
    training mode (B, rows, H) - the latents laid out in rows of H (zero-padded), then the EXTRA rows of
    reconstruction terms the regularizer reads - so that gathers, GradCache and chunks carry them with the
    vectors. Save `.encoder`."""

    def __init__(self, encoder, pooling="avg"):
        super().__init__()
        self.encoder, self.pooling = encoder, pooling
        self.train(encoder.training)

    def embed(self, batch):
        pooled = single_vector.encode(self.encoder, batch, self.pooling, normalize=False)
        latents, terms = self.encoder.csr(pooled, self.training)
        if terms is None:
            return latents
        h = terms.shape[-1]
        pad = (-latents.shape[-1]) % h
        return torch.cat([F.pad(latents, (0, pad)).view(len(latents), -1, h), terms], dim=1)

    def forward(self, **batches):
        return {name: run_chunked(self.embed, b) if isinstance(b, Chunked) else self.embed(b)
                for name, b in batches.items()}


def embedder(model, settings, multiple=None):
    return CSR(model, settings["pooling"])


# ----- scores, corpus, search --------------------------------------------------------------------

def latents(reps):
    """The sparse vectors of a batch's reps (a training layout's rows before the reconstruction terms)."""
    return reps if reps.dim() == 2 else reps[:, :-EXTRA].flatten(1)


def scores(q, p, n_passages, in_batch=True):
    return contrastive_scores(latents(q), latents(p), n_passages, in_batch)


def pair_scores(q, p):
    return (latents(q).float() * latents(p).float()).sum(-1)


def store(reps, width=None, dtype=None):
    return sparse.store(latents(reps))


stack, select, as_dense, search, corpus_stats, empty_rows = (sparse.stack, sparse.select, sparse.as_dense,
                                                              sparse.search, sparse.corpus_stats, sparse.empty_rows)


class Reconstruction:
    """CSRLoss's reconstruction terms of the batch's (gathered) training vectors: mean squared error of the
    pooled vector from its top k latents, + the same from the top 4k / 8, + `beta` x the dead latents'
    reconstruction of what the top k missed, normalized by that target's variance over the batch (none
    dead: ~0). Each side's terms weighted as sentence-transformers weighs its columns (a query column,
    `n_passages` passage columns). `count_scale`: 1 / (ranks x micro-batches), so the logged totals are the
    step's means."""

    def __init__(self, beta, n_passages, count_scale=1.0):
        self.beta, self.n, self.count_scale = beta, n_passages, count_scale

    @staticmethod
    def terms(reps):
        d_k, d_4k, r_aux, missed = (reps[:, -EXTRA + i] for i in range(EXTRA))
        norm = (missed - missed.mean(0)).pow(2).mean()
        norm = torch.where(norm == 0, torch.ones_like(norm), norm)
        return d_k.pow(2).mean(), d_4k.pow(2).mean(), r_aux.pow(2).mean() / norm

    def __call__(self, q, p):
        (qk, q4, qa), (pk, p4, pa) = self.terms(q), self.terms(p)
        k, four, aux = ((a + self.n * b) / (1 + self.n) for a, b in ((qk, pk), (q4, p4), (qa, pa)))
        counts = {"csr_reconstruction_k": k.detach(), "csr_reconstruction_aux": aux.detach(),
                  "active_dims_q": (latents(q).detach() != 0).sum(1).float().mean(),
                  "active_dims_d": (latents(p).detach() != 0).sum(1).float().mean()}
        return k + four / 8 + self.beta * aux, {name: v * self.count_scale for name, v in counts.items()}


def regularizer(flags, state, count_scale=1.0, max_steps=0):
    beta = flags.get("csr_aux_weight")
    return Reconstruction(FLAGS["csr_aux_weight"].default if beta is None else beta, flags.get("n_passages", 1),
                          count_scale)


# ----- export ------------------------------------------------------------------------------------

def split_export(weights):
    return {k[len(PREFIX):]: weights.pop(k) for k in list(weights) if k.startswith(PREFIX)}


def write_export(stage, model, settings, head_weights, out_dir):
    """SparseEncoder's files: the one-vector files (Transformer, Pooling; single_vector.write_files) with the
    auto-encoder after the pooling in 2_SparseAutoEncoder (its config and weights, the tied weight under
    the decoder's name as sentence-transformers saves it), dot-product similarity."""
    from safetensors.torch import save_file

    settings = {**settings, "normalize": False}
    warnings = single_vector.write_files(stage, settings, model.config.hidden_size)
    folder = "2_SparseAutoEncoder"
    weights = {("decoder.linear.weight" if k == "encoder.weight" else k): v.detach().contiguous().cpu()
               for k, v in head_weights.items()}
    weights = {k: v if k == "stats_last_nonzero" else v.float() for k, v in weights.items()}
    os.makedirs(os.path.join(stage, folder))
    save_file(weights, os.path.join(stage, folder, "model.safetensors"))
    modules = read_json(os.path.join(stage, "modules.json"), list)[:2]
    modules.append({"idx": 2, "name": "2", "path": folder, "type": MODULE})
    write_json_files(stage, {
        "modules.json": modules, os.path.join(folder, "config.json"): model.csr.config(),
        "config_sentence_transformers.json": sparse.encoder_config(settings)})
    for w in warnings:
        print(f"warning: {out_dir}: {w}", flush=True)
    return {"files": True, "warnings": warnings}


def memory_note(model):
    sae = model.csr
    return (f"csr head: an auto-encoder of {sae.encoder.weight.numel():,} weights, {sae.k} of its "
            f"{sae.encoder.out_features:,} latents kept a text")


# ----- its dir: sentence-transformers' SparseEncoder with a SparseAutoEncoder ----------------------

def read_dir(model_dir):
    """Its part of a dir's spec (heads.read_spec asks it before the sparse head): None for a dir without a
    SparseAutoEncoder; (settings, own: the auto-encoder's folder and config) for sentence-transformers' CSR
    layout - Transformer, Pooling, SparseAutoEncoder - and one sentence for another."""
    modules = read_modules(model_dir)
    if modules is None or "SparseAutoEncoder" not in module_kinds(modules):
        return None
    modules_path = os.path.join(model_dir, "modules.json")
    kinds = module_kinds(modules)
    if kinds != ("Transformer", "Pooling", "SparseAutoEncoder"):
        raise SystemExit(f"{modules_path}: modules {', '.join(kinds)} (the kit carries Transformer, Pooling, "
                         "SparseAutoEncoder); the kit does not reproduce it: fine-tune it with sentence-transformers")
    folder = os.path.join(model_dir, modules[2].get("path", ""))
    config_path = os.path.join(folder, "config.json")
    config = read_json(config_path)
    if config.get("normalize"):
        raise SystemExit(f"{config_path}: a SparseAutoEncoder with normalize true (a layer norm of its input); the "
                         "kit does not reproduce it: fine-tune it with sentence-transformers")
    for key in ("input_dim", "hidden_dim"):
        if not isinstance(config.get(key), int) or config[key] < 1:
            raise SystemExit(f"{config_path}: {key} {config.get(key)!r}; a positive whole number expected")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        raise SystemExit(f"{folder}: no model.safetensors (the auto-encoder's weights); copy the model dir whole again")
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:  # (its tied weight: either name)
        key = "encoder.weight" if "encoder.weight" in f.keys() else "decoder.linear.weight"
    linear = {"path": folder, "key": key, "config": config_path, "in_features": config["input_dim"],
              "out_features": config["hidden_dim"]}  # (checked against the model: heads.read_spec)
    settings = {**read_st_settings(model_dir, carried=("SparseAutoEncoder",)), "head": NAME, "normalize": False}
    return settings, {"sae": {"path": folder, "config": config}, "linear": [(linear, "SparseAutoEncoder")],
                      "what": "a SparseEncoder (CSR) dir"}


def dir_flags(spec):
    """A CSR dir fixes the latents (--csr-dim)."""
    own = spec.own.get("sae")
    return {"csr_dim": own["config"]["hidden_dim"]} if own else {}


"""--head single-vector: one pooled vector per text (mean / CLS / last token, an optional
sentence-transformers Dense, L2-normalized), scored by the inner product (the cosine when normalized).
The default head, and what a plain sentence-transformers dir (all-MiniLM-L6-v2) is. The interface:
retrieval_kit/heads/__init__.py."""

import json
import os

import torch
import torch.nn.functional as F

from ..chunking import Chunked, run_chunked
from ..flags import Flag, listed, positive_float, positive_int
from ..losses import contrastive_scores
from ..models import POOLING_MODES, STDense, load_encoder, pool
from ..st_format import (LEGACY_KEYS, ST_POOLING, bad_field, check_length, module_kinds, read_json, read_modules,
                         read_st_settings)

NAME = "single-vector"
SETTINGS = {"matryoshka_dims": []}  # settings of its own beyond st_format.SETTING_KEYS (the trained prefixes)
TEMPERATURE = 0.05  # scale 20, what all-MiniLM-L6-v2 was trained at
FLAGS = {  # its flags (cli.py adds them to the bi-encoder script's parser; cli.head_flags checks them)
    "pooling": Flag(), "normalize": Flag(),  # (declared by cli.py for every tool; the dir's settings decide)
    "truncate_dims": Flag(),  # (evaluate's --truncate-dims)
    "matryoshka_dims": Flag(
        None, "--matryoshka-dims", group="loss", type=listed(positive_int),
        help="Matryoshka embeddings: the loss is the weighted sum of InfoNCE on each of these prefixes of "
             "the embedding, e.g. 384,256,128,64 (re-normalized when --normalize); --eval-beir reports "
             "each; the export lists them (default off)"),
    "matryoshka_weights": Flag(
        None, "--matryoshka-weights", group="loss", type=listed(positive_float),
        help="one weight per --matryoshka-dims value (default 1 each)"),
    "dense_dim": Flag(
        None, "--dense-dim", type=positive_int,
        help="a fresh Dense projection (linear, with bias) of the pooled vector to this size, trained with the "
             "model and exported as sentence-transformers' Dense - e.g. a student's embeddings made its "
             "--teacher-model's size, as sentence-transformers' distillation example does (default: none; a dir's "
             "own Dense fixes it)"),
}
LOAD_FLAGS = ("dense_dim",)  # the flags load() takes (heads.load_args)
RESUME_FIXED = {"dense_dim": "the Dense projection has that many rows: start a new run (another --output-dir) for "
                             "another size"}
IDENTITY = "torch.nn.modules.linear.Identity"
PREFIX = "st_dense."  # the Dense module's keys in the model's state dict


# ----- the model ---------------------------------------------------------------------------------

def load(path, dtype=torch.float32, *, spec=None, meta=False, seed=0, dense_dim=None, **load_kw):
    """The encoder (models.load_encoder) with the dir's sentence-transformers Dense after the pooling,
    if its spec has one (read_dense), as `model.st_dense` with its weights; else with `dense_dim` (--dense-dim)
    a fresh one to that size (fresh_dense)."""
    model = load_encoder(path, dtype, meta=meta, **load_kw)
    dense = spec.own.get("dense") if spec is not None else None
    if dense is None:
        return fresh_dense(model, dense_dim, seed, meta) if dense_dim else model
    args = [dense[k] for k in ("in_features", "out_features", "bias", "activation_function")]
    if meta:
        with torch.device("meta"):
            module = STDense(*args)
    else:
        module = STDense(*args)
        module.load_state_dict(dense_weights(dense["path"]))
    model.st_dense = module.to(dtype) if dtype is not None else module
    return model


def fresh_dense(model, size, seed, meta=False):
    """A fresh Dense (no activation) from the hidden size to `size` on `model`, its weight and bias drawn as
    torch's nn.Linear init from a generator seeded by `seed` (the same on every rank and world size); said
    fresh (merge leaves it out of the average) and trained in full under LoRA."""
    hidden = model.config.hidden_size
    with torch.device("meta" if meta else "cpu"):
        module = STDense(hidden, size, bias=True, activation_function=IDENTITY)
    if not meta:
        bound, gen = 1.0 / hidden ** 0.5, torch.Generator().manual_seed(seed)
        with torch.no_grad():
            module.linear.weight.uniform_(-bound, bound, generator=gen)
            module.linear.bias.uniform_(-bound, bound, generator=gen)
    model.st_dense = module.to(next(model.parameters()).dtype)
    model.fresh_keys = [*getattr(model, "fresh_keys", []), *(PREFIX + k for k in module.state_dict())]
    model.st_dense_fresh = True
    return model


def lora_trained(model):
    """A fresh Dense (--dense-dim) is trained in full beside LoRA's adapters; a dir's own is not."""
    return list(model.st_dense.parameters()) if getattr(model, "st_dense_fresh", False) else []


def dir_flags(spec):
    """A dir's own Dense fixes --dense-dim at its size (cli.head_flags refuses another)."""
    dense = spec.own.get("dense")
    return {"dense_dim": dense["out_features"]} if dense is not None else {}


def dense_weights(folder):
    """A Dense module's weights from its folder (model.safetensors, else pytorch_model.bin)."""
    weights = os.path.join(folder, "model.safetensors")
    if os.path.isfile(weights):
        from safetensors.torch import load_file

        return load_file(weights)
    return torch.load(os.path.join(folder, "pytorch_model.bin"), weights_only=True, map_location="cpu")


def embedding_size(model):
    """The size of the embeddings: the Dense module's output, else the hidden size."""
    dense = getattr(model, "st_dense", None)
    return dense.linear.out_features if dense is not None else model.config.hidden_size


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
        self.train(encoder.training)  # a wrapper takes its model's mode (from_pretrained: eval)

    def embed(self, batch):
        """(rows, H) embeddings of a tokenized dict or a Chunked batch."""
        def fn(b):
            return encode(self.encoder, b, self.pooling, self.normalize)
        return run_chunked(fn, batch) if isinstance(batch, Chunked) else fn(batch)

    def forward(self, **batches):
        return {name: self.embed(b) for name, b in batches.items()}


def serving(settings):
    """The lengths inference reads, where training's differ: sentence-transformers has one max length (the
    passages', written as max_seq_length) and reads queries up to it; so do the kit's tools (evaluate, mine,
    score, --eval-beir and the dev split), so that the export embeds a long query alike in both. The
    training query length is kept as train_query_max_length (a further run on the export trains at it)."""
    return {"query_max_length": settings["passage_max_length"],
            "train_query_max_length": settings.get("train_query_max_length", settings["query_max_length"])}


def embedder(model, settings, multiple=None):
    return BiEncoder(model, settings["pooling"], settings["normalize"])


# ----- scores, corpus, search --------------------------------------------------------------------

scores = contrastive_scores  # the inner product in fp32 ((B, P) in-batch, else (B, n))


def pair_scores(q, p):
    return (q.float() * p.float()).sum(-1)


def store(reps, width=None, dtype=None):
    return reps.float().cpu()


def search(q, p, k):
    from ..search import exact_topk

    return exact_topk(q, p, k)


# ----- export ------------------------------------------------------------------------------------

def split_export(weights):
    return {k[len(PREFIX):]: weights.pop(k) for k in list(weights) if k.startswith(PREFIX)}


def write_export(stage, model, settings, head_weights, out_dir):
    """SentenceTransformer's files (write_files), with the Dense module's weights in 2_Dense."""
    from safetensors.torch import save_file

    dense = getattr(model, "st_dense", None)
    warnings = write_files(stage, settings, model.config.hidden_size, dense.config() if dense is not None else None)
    if dense is not None:
        save_file(head_weights, os.path.join(stage, "2_Dense", "model.safetensors"))
    for w in warnings:
        print(f"warning: {out_dir}: {w}", flush=True)
    return {"files": True, "warnings": warnings}


# ----- its dir: a sentence-transformers SentenceTransformer ----------------------------------------

def read_dir(model_dir):
    """Its part of a dir's spec (heads.read_spec asks it last: any sentence-transformers dir the other kinds
    did not claim): None without modules.json, else (the dir's settings in the kit's keys, its own part: a
    Dense after the pooling, checked against the model)."""
    if read_modules(model_dir) is None:
        return None
    st = read_st_settings(model_dir, carried=("Dense",))
    dense = read_dense(model_dir)
    return st, {"dense": dense, "linear": [(dense, "Dense")] if dense is not None else [],
                "what": "a sentence-transformers dir" + (" with a Dense projection after its pooling" if dense else "")}


DENSE_ACTIVATIONS = ("torch.nn.modules.activation.Tanh", "torch.nn.modules.linear.Identity",
                     "torch.nn.modules.activation.ReLU", "torch.nn.modules.activation.GELU",
                     "torch.nn.modules.activation.Sigmoid")



def read_dense(model_dir):
    """The Dense projection a sentence-transformers dir applies after pooling (before Normalize):
    {"path", "in_features", "out_features", "bias", "activation_function"}, or None. One Dense, after
    the Pooling, with one of DENSE_ACTIVATIONS and no residual; anything else is one sentence."""
    modules_path = os.path.join(model_dir, "modules.json")
    modules = read_modules(model_dir)
    if modules is None:
        return None
    kinds = list(module_kinds(modules))
    if "Dense" not in kinds:  # (a token projection is the multi-vector head's: asked first)
        return None
    i = kinds.index("Dense")
    config_path = os.path.join(model_dir, modules[i].get("path", ""), "config.json")
    config = read_json(config_path)
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
        bad_field(config_path, "bias", config.get("bias"), "true or false")
    return {"path": os.path.join(model_dir, modules[i].get("path", "")), "config": config_path,
            "in_features": check_length(config_path, "in_features", config.get("in_features"), optional=False),
            "out_features": check_length(config_path, "out_features", config.get("out_features"), optional=False),
            "bias": config.get("bias", True), "key": "linear.weight",
            "activation_function": config.get("activation_function", DENSE_ACTIVATIONS[0])}


def write_files(out_dir, settings, hidden_size, dense=None):
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

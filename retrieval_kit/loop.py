"""What a training loop needs besides the model: the same in both scripts, as plain functions of
explicit values (no Trainer, no `args`). A script's loop reads, top to bottom:

    batches = step_batches(dataset, ...)               # built ahead, in DataLoader workers
    fwd_bwd = grad_cache_step if grad_cache else plain_step   # decided once, before the loop
    while True:
        validate when `eval_due`; checkpoint when `ckpt_due`; stop at the end or on a signal
        for each micro-batch: loss, acc = fwd_bwd(model, to_device(next(batches)), loss_fn, ...)
        scalars = finish_step(...)                      # clip -> step or skip -> reduce -> stop flag
        logger.log_step(step, scalars)                  # every --log-every steps

`loss_fn({name: outputs}, **targets) -> (loss, per-query top-1 accuracy)` is where a model kind's
loss plugs in (InfoNCE with gathered negatives, listwise CE, a distillation term, ...); the
forward/backward functions do not know which, so a new loss needs no new branch in the loop. A
micro-batch's Chunked entries go to the model; the rest (teacher scores) to loss_fn as `targets`.
"""

import math
import time
from dataclasses import dataclass, field

import torch

from . import ckpt, data, dist, optim, precision, rundir
from .chunking import Chunked
from .gradcache import grad_cache
from .losses import contrastive_loss, contrastive_scores, duplicate_mask, listwise_loss
from .metrics import WindowedAverage, group_metric_sums


# ----- batches -----------------------------------------------------------------------------------

def _ignore_signals(worker_id):
    """A worker leaves SIGTERM / SIGINT to the training process, which finishes its step and saves
    a checkpoint (ckpt.StopSignal); the DataLoader then shuts its workers down."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _as_is(batch):
    return batch


def step_batches(dataset, start_step, max_steps, accum, num_workers, device):
    """Iterator over the micro-batches of steps start_step..max_steps-1 of a data.StepBatches
    dataset, collated in `num_workers` processes (0 = here) and prefetched; pinned on CUDA, for
    non-blocking copies."""
    if num_workers > 0:
        import os

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no tokenizer threads across a fork
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, sampler=range(start_step * accum, max_steps * accum),
                                         num_workers=num_workers, pin_memory=device.type == "cuda", collate_fn=_as_is,
                                         worker_init_fn=_ignore_signals if num_workers else None,
                                         generator=torch.Generator())  # its seed draw leaves the global RNG alone
    return iter(loader)


def to_device(inputs, device):
    """{name: Chunked or tensor} to the device, asynchronously from pinned memory."""
    return {k: v.to(device, non_blocking=True) for k, v in inputs.items()}


def split_batch(batch):
    """(model inputs: the Chunked entries, targets: the rest, e.g. "teacher" scores, for loss_fn)."""
    inputs = {k: v for k, v in batch.items() if isinstance(v, Chunked)}
    return inputs, {k: v for k, v in batch.items() if k not in inputs}


def with_guide(inputs, guide, teacher=None):
    """--guide-model, --teacher-model: `inputs` with each frozen model's {"q", "p"} embeddings of the same
    batch (computed without a graph, length chunk by chunk) as the loss's targets "guide" and
    "teacher_embeddings" (losses.biencoder_loss); `inputs` as they are without either (None). A teacher
    file (--teacher-embeddings: embed.TeacherFile) looks the batch's texts up by their keys instead."""
    frozen = {k: m for k, m in (("guide", guide), ("teacher_embeddings", teacher)) if m is not None}

    def run(m):
        if getattr(m, "by_keys", False):
            return m(q_keys=inputs["q_keys"], p_keys=inputs["p_keys"])
        return m(q=inputs["q"], p=inputs["p"])
    with torch.no_grad():
        return {**inputs, **{k: run(m) for k, m in frozen.items()}}


# ----- forward + backward of one micro-batch (chosen once, before the loop) -------------------

def step_fn(grad_cache, loss_fn, accum, autocast=(None, None)):
    """The forward/backward of every micro-batch, chosen once: `fn(model, batch, sync=...)` ->
    (loss, accuracy, ...): grad_cache_step with --grad-cache, else plain_step."""
    import functools

    return functools.partial(grad_cache_step if grad_cache else plain_step, loss_fn=loss_fn, accum=accum,
                             autocast=autocast)


def plain_step(model, batch, loss_fn, accum, sync, autocast=(None, None)):
    """One forward of all inputs (`model(**inputs)`, a single DDP forward per backward), the loss
    outside autocast (`loss_fn(outputs, **targets)`: split_batch), backward of loss / accum.
    Returns (loss, accuracy), detached, on the device."""
    inputs, targets = split_batch(batch)
    with dist.grad_sync(model, sync):
        with precision.autocast(*autocast):
            out = model(**inputs)
        loss, *rest = loss_fn(out, **targets)  # (accuracy[, {name: count to sum}])
        (loss / accum).backward()
    return (loss.detach(), *rest)


def grad_cache_step(model, batch, loss_fn, accum, sync, autocast=(None, None)):
    """plain_step's loss and gradients with GradCache: memory flat in the batch size."""
    def run(m, name, sub):
        with precision.autocast(*autocast):
            return m(**{name: sub})[name]
    inputs, targets = split_batch(batch)
    return grad_cache(model, inputs, run, lambda out: loss_fn(out, **targets), accum, sync)


# ----- the step tail -----------------------------------------------------------------------------

@dataclass
class LoopState:
    """What a checkpoint keeps of the loop besides model, optimizer and scheduler."""
    step: int = 0
    skipped: int = 0
    bad_in_a_row: int = 0
    stopping: bool = False
    loss_avg: WindowedAverage = field(default_factory=WindowedAverage)
    best: dict = None  # --select-best: {"metric", "value", "step"} of the best validation so far
    candidates: list = field(default_factory=list)  # --select-best on a retrieval metric: every validated step's
    # {"step", "value", "each": its per-query values, "guard": its guard sets' per-query values or None}

    def state_dict(self, steps_per_epoch, accum):
        epoch, pos = divmod(self.step * accum, steps_per_epoch)
        return {"loss_avg": self.loss_avg.state_dict(), "skipped_steps": self.skipped, "epoch": epoch,
                "position_in_epoch": pos, "best": self.best, "candidates": self.candidates}

    def load(self, meta):
        self.step = meta["step"]
        self.loss_avg.load_state_dict(meta["loop"]["loss_avg"])
        self.skipped = meta["loop"].get("skipped_steps", 0)
        self.best = meta["loop"].get("best")
        self.candidates = meta["loop"].get("candidates") or []
        return meta

    def observe(self, metric, logged, step):
        """--select-best: is the validation just logged at `step` (`logged`: Logger.last, {split: {"step",
        name: value}}) the best so far on `metric` ("split/name"; a loss is better lower)? Then it is
        kept as `best`, and its step must be checkpointed."""
        split, _, name = (metric or "").partition("/")
        row = logged.get(split) or {}
        if not metric:
            return False
        evals = {s: r for s, r in logged.items() if s != "train" and r.get("step") == step}
        if evals and (row.get("step") != step or name not in row):  # a validation ran, and never logs it
            raise SystemExit(f"--select-best {metric}: no validation of this run logs it; it logs " + ", ".join(
                f"{s}/{k}" for s, r in evals.items() for k in r if k != "step"))
        if row.get("step") != step:
            return False
        if f"{name}_each" in row:  # per-query values: every validated step is a candidate (choose_step, at the end)
            guard = [v for s in sorted(logged) if s.startswith("guard_") and logged[s].get("step") == step
                     for v in logged[s].get(f"{name}_each", [])]  # (a guard set's own row: its _fused/_best carry none)
            self.candidates = [c for c in self.candidates if c["step"] != step] + [
                {"step": step, "value": row[name], "each": row[f"{name}_each"], "guard": guard or None}]
            if self.best is None or row[name] > self.best["value"]:
                self.best = {"metric": metric, "value": row[name], "step": step}
            return True
        value, lower = row[name], name.endswith("loss")
        better = self.best is None or (value < self.best["value"] if lower else value > self.best["value"])
        if dist.world_size() > 1:  # every rank checkpoints on the same decision (the metrics are reduced anyway)
            better = dist.all_reduce_sum([better])[0] > 0
        if better:
            self.best = {"metric": metric, "value": value, "step": step}
        return better


class StepSums:
    """Per-step sums over the micro-batches of the loss and the mean top-1 accuracy, kept on the
    device (float64, so the sums equal those of the values read one by one); token and query
    counts come from collation and shapes, with no device read."""

    def __init__(self, device):
        self.t0 = time.perf_counter()  # the step's clock starts here
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.acc = torch.zeros((), dtype=torch.float64, device=device)
        self.micro_batches, self.queries, self.tokens = 0, 0, 0
        self.counts = {}

    def add(self, inputs, loss, acc, counts=None):
        """One micro-batch: its inputs ({name: Chunked}), mean loss, per-query accuracy (Q,), and any
        counts the loss reports ({name: 0-d tensor}, summed over micro-batches and ranks)."""
        self.loss += loss.double()
        self.acc += acc.mean().double()
        for k, v in (counts or {}).items():
            self.counts[k] = self.counts.get(k, 0.0) + v.detach().double()
        self.micro_batches += 1
        self.queries += acc.numel()
        self.tokens += sum(c.n_tokens for c in inputs.values() if isinstance(c, Chunked))


def finish_step(model, optimizer, scheduler, state, sums, stop_requested, max_grad_norm, max_bad_steps, ema=None):
    """Clip -> reduce the step's sums and the stop flag over ranks -> one host read -> optimizer and
    scheduler step (or skip, on every rank, when the global grad norm is not finite) -> scalars.

    The read of one small vector (grad norm, mean loss, accuracy, tokens, stop flag) is the step's
    only device-to-host sync: the skip decision needs the norm, and every rank must see a stop
    signal within the step. `ema` (--ema-decay): updated after a step that was taken."""
    norm = dist.clip_grad_norm(model, max_grad_norm if max_grad_norm > 0 else float("inf"),
                               use_buckets=getattr(model, "gradient_as_bucket_view", False))  # DDP's flag
    device, accum = sums.loss.device, sums.micro_batches
    host = torch.tensor([float(sums.tokens), float(stop_requested)], dtype=torch.float64)
    names = sorted(sums.counts)  # the same on every rank: the same loss_fn
    vec = dist.reduce_mean_tensor(torch.cat([torch.stack([sums.loss / accum, sums.acc / accum]),
                                             host.to(device, non_blocking=True)]
                                            + [sums.counts[k].view(1).to(device) for k in names]))
    grad_norm, loss, acc, tokens, stop, *counts = torch.cat([norm.detach().double().view(1).to(device), vec]).tolist()
    lr = scheduler.get_last_lr()[0]
    state.bad_in_a_row = optim.step_if_finite(optimizer, scheduler, grad_norm, state.bad_in_a_row, max_bad_steps,
                                              state.step + 1)
    state.skipped += state.bad_in_a_row > 0  # a non-finite step on any rank is skipped on all of them
    if ema is not None and state.bad_in_a_row == 0:
        ema.update()
    state.step += 1
    state.stopping = stop > 0  # any rank signalled: all stop after this step
    if math.isfinite(loss):
        state.loss_avg.update(loss)  # a skipped step stays out of the window
    dt = time.perf_counter() - sums.t0
    scalars = {"loss": loss, "loss_avg_window": state.loss_avg.value, "acc": acc, "lr": lr, "grad_norm": grad_norm,
               "skipped_steps": state.skipped, "samples_per_s": sums.queries * dist.world_size() / dt,
               "tokens_per_s": tokens * dist.world_size() / dt}
    scalars.update({k: c * dist.world_size() for k, c in zip(names, counts)})  # totals over ranks
    if device.type == "cuda":  # this rank's high-water mark so far (a host-side counter: no sync)
        scalars["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    return scalars


def eval_due(step, start_step, every, last_step):
    return step == start_step or step % every == 0 or last_step


def ckpt_due(step, start_step, every, last_step, stopping):
    return step > start_step and (step % every == 0 or last_step or stopping)


# ----- validation on fixed groups ----------------------------------------------------------------

@torch.no_grad()
def validate_groups(model, records, n_passages, batch_size, ctx, score):
    """Loss, acc@1 and MRR of each query's own fixed group (data.fixed_group: 1 positive + n-1
    negatives), so they depend on neither batch size nor world size; ties count against the
    positive. score(model, queries, groups) -> ((b, n) scores, mean loss); reduced over ranks."""
    from tqdm import tqdm

    model.eval()
    loss_sum, acc_sum, rr_sum, count = 0.0, 0.0, 0.0, 0.0
    batches = data.eval_batches(records, batch_size, ctx.rank, ctx.world_size)
    per_rank = -(-len(records) // ctx.world_size)
    total = -(-per_rank // batch_size)  # batches on every rank (eval_batches)
    for recs, counted in tqdm(batches, total=total, desc="val", unit="batch", leave=False, disable=not ctx.is_main):
        dist.stop_point()  # a SIGTERM: every rank leaves here at the same batch (until_stopped)
        scores, loss = score(model, [r.query for r in recs], [data.fixed_group(r, n_passages) for r in recs])
        if not counted:
            continue
        loss_sum += loss.item() * len(recs)
        a, r, c = group_metric_sums(scores)
        acc_sum, rr_sum, count = acc_sum + a, rr_sum + r, count + c
    loss_sum, acc_sum, rr_sum, count = dist.all_reduce_sum([loss_sum, acc_sum, rr_sum, count])
    model.train()
    return {"loss": loss_sum / count, "acc@1": acc_sum / count, "mrr": rr_sum / count}


def biencoder_group_scores(model, queries, groups, *, collate, temperature, device, autocast_dtype=None,
                           mask_duplicates=True, scores=contrastive_scores):
    """validate_groups' `score` for a bi-encoder: each query against its own group only -> ((b, n)
    similarity scores by the head's `scores`, mean InfoNCE); with `mask_duplicates`, a copy of the
    positive among its group's negatives scores -inf (as in training: out of the softmax, no tie
    against the positive)."""
    n = len(groups[0])
    inputs, targets = split_batch(to_device(collate(queries, groups), device))  # model inputs | p_keys
    with precision.autocast(device.type, autocast_dtype):
        out = model(**inputs)
    mask = duplicate_mask(targets["p_keys"], n, in_batch=False) if mask_duplicates else None
    logits = scores(out["q"].float(), out["p"].float(), n, in_batch=False)
    if mask is not None:
        logits = logits.masked_fill(mask, float("-inf"))
    return logits, contrastive_loss(out["q"], out["p"], n, temperature, in_batch=False, mask=mask, scores=scores)


def reranker_group_scores(model, queries, groups, *, collate, device, autocast_dtype=None):
    """validate_groups' `score` for a reranker: each query's own group -> ((b, n) logits, mean
    listwise loss)."""
    inputs = to_device(collate(queries, groups), device)
    with precision.autocast(device.type, autocast_dtype):
        logits = model(**inputs)["pairs"]  # (b * n,)
    return logits.float().view(len(queries), -1), listwise_loss(logits, len(groups[0]))


def choose_step(state, guard_margin=None):
    """--select-best on a retrieval metric (per-query values logged): among the validated steps, ordered from the
    earliest (the closest to the base), the rule of choice.py - the earliest step that the dev queries show within
    choice.MARGIN of the best, else the best; with --guard-beir none whose guard falls more than `guard_margin`
    below the first validation's (the base's at step 0). Sets `state.best` to it, with every candidate's numbers
    and why; said in one line. Returns it."""
    from .choice import choose

    steps = sorted(state.candidates, key=lambda c: c["step"])
    if not steps:
        return state.best
    chosen, rows = choose([{"name": c["step"], "dev": c["each"], "guard": c["guard"]} for c in steps],
                          guard_base=steps[0]["guard"], guard_margin=guard_margin)
    state.best = {"metric": state.best["metric"], "value": steps[chosen]["value"], "step": steps[chosen]["step"],
                  "why": rows[chosen]["chosen"], "candidates": rows}
    dist.print0(f"--select-best {state.best['metric']}: step {state.best['step']} ({state.best['why']})")
    return state.best


def final_weights(model, run_dir, state, wrapped=None, ema=None, guard_margin=None):
    """Before the export: a run that trained nothing - every one of its steps skipped as non-finite - ends
    with one sentence and a non-zero exit, not an untrained export; with --select-best, the chosen validated
    step's weights into `model` (choose_step on a retrieval metric, else the best; ckpt.load_best); with `ema`
    (--export-ema), the average's. Returns what the export holds ({"ema": decay}, the --select-best
    selection, or None)."""
    if state.step and state.skipped >= state.step:
        raise SystemExit(f"every one of the run's {state.step} steps was skipped: its loss or gradients were not "
                         f"finite; nothing was trained, so nothing is exported (lower --lr, check the data)")
    if ema:
        ema.copy_to_model()
        dist.print0(f"--export-ema: the export holds the average of the trained weights (decay {ema.decay:g})")
        return {"ema": ema.decay}
    return ckpt.load_best(model, run_dir, choose_step(state, guard_margin), state.step, wrapped)


def end_run(logger, message):
    logger.close()
    dist.print0(message)
    rundir.release_lock()  # the run folder is free for the next run
    dist.cleanup()


def until_stopped(state, evaluate, *args, **kwargs):
    """evaluate(*args, **kwargs) (a validation, the dev choice of a fusion or merge weight), or {} with
    `state.stopping` set when a stop signal arrives during it: every rank leaves it at the same batch
    (dist.stop_point), the run saves the step it is at and exits; what was left undone runs again on resume
    (a resumed run validates at its first step, and ends by exporting and choosing again)."""
    try:
        return evaluate(*args, **kwargs)
    except dist.Interrupted:
        state.stopping = True
        dist.print0(f"a stop signal during {getattr(evaluate, '__name__', 'an evaluation')} at step {state.step}: "
                    "left at its next batch; it runs again on resume")
        return {}


def stop_early(logger, stop, step, output_dir):
    """The end of a run stopped by a signal: its checkpoint is saved; say how to continue."""
    logger.close()
    where = (f"checkpoint saved in {output_dir}" if step else
             f"no step was trained, nothing to save in {output_dir}")
    dist.print0(f"stopped by {stop.name or 'a signal on another rank'} after step {step}: {where}; continue with "
                "--resume auto")
    rundir.release_lock()
    dist.cleanup()

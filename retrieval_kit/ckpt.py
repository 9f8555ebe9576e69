"""Checkpoints: save, find and load them in the explicit resume order; stop on a signal.

A checkpoint is one folder per step, `step_000100/`:
    model.safetensors   weights of the unwrapped model (no `module.` / `_orig_mod.` prefixes)
    optimizer.pt        optimizer state_dict (DDP / one process; loaded with weights_only=True)
    optimizer_dcp/      sharded optimizer state under FSDP2 (torch.distributed.checkpoint)
    model_dcp/          FSDP2 with --sharded-checkpoints: each rank's model shards, instead of model.safetensors
    scheduler.pt        LR scheduler state_dict
    rng_rank{r}.pt      per-rank RNG states
    meta.json           step, loop state, args, versions, each other file's size and sha256; written last
It is written into `.tmp_step_000100/` and renamed when complete; `latest` names the newest
complete one. A folder is resumed from only if it verifies (verify): a damaged newest checkpoint
falls back to the one before (find_latest). The run folder itself - one run per folder, its lock, the
resume decision - is rundir.py's.

Resume order (see precision.py for why): load_model_weights -> cast model to the storage dtype
-> build optimizer, load_optimizer -> load_scheduler -> loop state from meta.json.
"""

import json
import os
import pickle
import random
import shutil
import signal
import warnings

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from . import flags
from .dist import barrier, is_fsdp, rank, unwrap, world_size
from .lora import has_lora, trained_state_dict


def rng_state():
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
             "torch": torch.get_rng_state()}  # tensors and plain types only: loads with weights_only=True
    if torch.cuda.is_available():  # this rank's device only: another layout at resume still fits
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())


def _fsync_dir(path):
    """fsync every file under path, so the rename that publishes the checkpoint comes after its data."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())


def safe_load(path):
    """torch.load restricted to tensors and plain containers (weights_only): a pickle that would run
    code is refused with the file named, never executed."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")  # not every rank onto cuda:0
    except pickle.UnpicklingError as e:
        raise SystemExit(f"{path}: refusing to load: not a plain tensor file, it may be tampered with "
                         f"(torch.load weights_only=True said: {str(e).splitlines()[0]})") from None


def full_state_dict(module, all_ranks=False):
    """The module's state dict with plain full CPU tensors; collective under FSDP2 (DTensors gathered).

    Pass the raw HF module (not a wrapper): its keys are the Hugging Face ones, whatever wraps it.
    Only rank 0, the one that writes them, gets the tensors (sharded ones gathered into its host
    memory); other ranks get None unless `all_ranks` (then every rank gathers everything).
    """
    sharded = any(hasattr(p, "full_tensor") for p in unwrap(module).parameters())
    if not sharded and not all_ranks and rank() != 0:
        return None
    if sharded and not all_ranks:
        # each shard gathered and offloaded to rank 0's host memory one tensor at a time: the other
        # ranks never hold the full model (full_tensor() on every rank would, ~28 GB each at 7B fp32)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(unwrap(module), options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank() != 0:
            return None
    else:
        state = unwrap(module).state_dict()
    out, seen = {}, set()
    for k, v in state.items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        v = v.detach().cpu()
        if v.untyped_storage().data_ptr() in seen:
            v = v.clone()  # tied weights: safetensors stores each tensor once
        seen.add(v.untyped_storage().data_ptr())
        out[k] = v.contiguous()
    return out


def _sharded(wrapped):
    return wrapped is not None and is_fsdp(wrapped)


def save_checkpoint(run_dir, step, model, optimizer, scheduler, loop_state, args=None, wrapped=None, keep_last=0,
                    sharded_model=False, ema=None):
    """Write `run_dir/step_{step:06d}/` atomically from all ranks (collective), then keep the newest
    `keep_last` complete ones (0 = all). Returns the path. A write that fails (a full disk, a
    quota) ends the run with one sentence; the checkpoints before it are untouched.

    `model` is the raw HF module whose weights are saved; `wrapped` the DDP / FSDP2 module the
    optimizer was built under (needed to gather sharded optimizer state). `sharded_model`
    (--sharded-checkpoints, FSDP2 only): every rank writes its own model shards with DCP
    (`model_dcp/`) instead of rank 0 gathering and writing one `model.safetensors`. `ema` (--ema-decay):
    its average too, `ema.safetensors` (gathered by rank 0).
    """
    with flags.writing(f"the step {step} checkpoint in {run_dir}", then=lambda: after_failed_write(run_dir)):
        return _save_checkpoint(run_dir, step, model, optimizer, scheduler, loop_state, args, wrapped, keep_last,
                                sharded_model and _sharded(wrapped), ema)


def after_failed_write(run_dir):
    """What the sentence of a failed write in a run folder says next: the newest intact checkpoint."""
    return (f"the newest intact checkpoint is {find_latest(run_dir) or 'none'}: free space, then continue with "
            "--resume auto")


def _save_checkpoint(run_dir, step, model, optimizer, scheduler, loop_state, args, wrapped, keep_last, dcp_model,
                     ema=None):
    name = f"step_{step:06d}"
    final, tmp = os.path.join(run_dir, name), os.path.join(run_dir, f".tmp_{name}")
    me = rank()
    if me == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank{me}.pt"))
    lora = has_lora(unwrap(model))  # LoRA: only what is trained (adapters, a fresh head), not the frozen base
    dcp_model = dcp_model and not lora
    weights = trained_state_dict(unwrap(model)) if lora else None if dcp_model else full_state_dict(model)  # collective
    average = ema.state_dict() if ema is not None else None  # (collective under FSDP2)

    if _sharded(wrapped):  # every rank writes its own shards; DCP reshards on load, for any rank count
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        dcp.save({"optim": get_optimizer_state_dict(wrapped, optimizer)},
                 checkpoint_id=os.path.join(tmp, "optimizer_dcp"))
        if dcp_model:  # the wrapped module's keys, which load_model_dcp asks for
            dcp.save({"model": get_model_state_dict(wrapped)}, checkpoint_id=os.path.join(tmp, "model_dcp"))
    if me == 0:
        if weights is not None:
            save_file(weights, os.path.join(tmp, "model.safetensors"))
        if average is not None:
            save_file(average, os.path.join(tmp, "ema.safetensors"))
        if not _sharded(wrapped):
            torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        torch.save(scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
    barrier()
    if me == 0:
        import transformers

        meta = {"step": step, "loop": loop_state, "args": args, "world_size": world_size(), "torch": torch.__version__,
                "optimizer_format": "dcp" if _sharded(wrapped) else "torch",
                "model_format": "dcp" if dcp_model else "safetensors", "model_subset": "trained" if lora else "all",
                "transformers": transformers.__version__, "complete": True, "files": file_sums(tmp)}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2, default=str)
        _fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(run_dir, "latest.tmp"), "w") as f:
            f.write(name + "\n")
        os.replace(os.path.join(run_dir, "latest.tmp"), os.path.join(run_dir, "latest"))
        prune(run_dir, keep_last, keep={((loop_state or {}).get("best") or {}).get("step"),  # --select-best's steps
                                        *[c["step"] for c in (loop_state or {}).get("candidates") or []]})
    barrier()
    return final


def is_complete(path):
    return os.path.isfile(os.path.join(path, "meta.json"))


def file_sums(folder):
    """{relative path: {"bytes", "sha256"}} of every file under folder (but meta.json)."""
    import hashlib

    sums = {}
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel == "meta.json":
                continue
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
            sums[rel] = {"bytes": os.path.getsize(path), "sha256": h.hexdigest()}
    return sums


def verify(path):
    """Why the checkpoint folder `path` cannot be resumed from (a sentence naming the file), or None.
    Checks meta.json (readable, its step the folder's) and every file's size and sha256 against the
    sums meta.json recorded when the checkpoint was written."""
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        return f"{meta_path}: missing (the checkpoint was not finished)"
    try:
        meta = load_meta(path)
        step = meta["step"]
        for key in ("loop", "args"):  # what a resume reads besides the files
            if not isinstance(meta[key], dict):
                raise TypeError(f"its {key!r} entry is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{meta_path}: unreadable ({type(e).__name__}: {e})"
    name = os.path.basename(os.path.normpath(path))
    if name.startswith("step_") and name[5:].isdigit() and int(name[5:]) != step:
        return f"{meta_path}: says step {step}, but the folder is {name}"
    sums = meta.get("files")
    if not isinstance(sums, dict):  # written before checksums were kept: the files must at least be there
        need = ["model.safetensors", "scheduler.pt",
                "optimizer_dcp" if meta.get("optimizer_format") == "dcp" else "optimizer.pt"]
        missing = [n for n in need if not os.path.exists(os.path.join(path, n))]
        return f"{os.path.join(path, missing[0])}: missing" if missing else None
    now = file_sums(path)
    for rel, want in sums.items():
        got = now.get(rel)
        if got is None:
            return f"{os.path.join(path, rel)}: missing"
        if got != want:
            what = f"{got['bytes']} bytes, {want['bytes']} written" if got["bytes"] != want["bytes"] else \
                "its sha256 differs from the one recorded when it was written"
            return f"{os.path.join(path, rel)}: damaged ({what})"
    return None


def find_latest(run_dir):
    """Newest `step_*` folder in run_dir that verifies (verify), or None; each newer one skipped is
    a warning naming what is wrong with it (so a damaged newest checkpoint falls back to the one
    before, and a launcher's restart recovers)."""
    if not os.path.isdir(run_dir):
        return None
    steps = sorted(d for d in os.listdir(run_dir) if d.startswith("step_"))
    for d in reversed(steps):
        problem = verify(os.path.join(run_dir, d))
        if problem is None:
            return os.path.join(run_dir, d)
        if rank() == 0:
            print(f"warning: skipping checkpoint {os.path.join(run_dir, d)}: {problem}", flush=True)
    return None


def load_model_weights(model, ckpt_dir):
    """Step 1 of resume: weights into the (unwrapped) model, cast to the model's current dtypes."""
    # (load_state_dict, not safetensors' load_model: a model with tied weights - an MLM head's decoder and
    # its embeddings - has both keys in the file, which load_model would call unexpected)
    missing, unexpected = unwrap(model).load_state_dict(load_file(os.path.join(ckpt_dir, "model.safetensors")),
                                                        strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{ckpt_dir}/model.safetensors does not fit the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    return missing, unexpected


def restore_model(model, ckpt_dir, storage_dtype):
    """Resume, part 1 (before wrapping): weights into the raw HF model, then cast it to the storage
    dtype. A checkpoint with DCP model shards (--sharded-checkpoints) loads them after wrapping
    instead, into the shards (load_training_state): nothing to do here."""
    if model is None or ckpt_dir is None:  # no resume, or a rank that did not load (FSDP2): nothing to do
        return
    meta = load_meta(ckpt_dir)
    if meta.get("model_format") == "dcp":
        return
    if meta.get("model_subset") == "trained":  # LoRA: the adapters and head into a base loaded as at the start
        return load_trained_weights(model, ckpt_dir)
    if has_lora(unwrap(model)):
        raise SystemExit(f"{ckpt_dir}: a full fine-tuning checkpoint (it holds every weight): resume it without "
                         "--lora-rank")
    load_model_weights(model, ckpt_dir)
    model.to(storage_dtype)


def load_trained_weights(model, ckpt_dir):
    """A LoRA checkpoint's params (what is trained) into `model`, each keeping its dtype; every trained
    param must be there, and nothing else."""
    from safetensors.torch import load_file

    state = load_file(os.path.join(ckpt_dir, "model.safetensors"))
    trained = {n: p for n, p in unwrap(model).named_parameters() if p.requires_grad}
    shapes = [k for k in state if k in trained and tuple(state[k].shape) != tuple(trained[k].shape)]
    if set(state) != set(trained) or shapes:
        raise SystemExit(f"{ckpt_dir}: its weights are not this run's trained params (missing "
                         f"{sorted(set(trained) - set(state))[:3]}, unexpected {sorted(set(state) - set(trained))[:3]}, "
                         f"other shapes {shapes[:3]}): resume it with the same --lora-* flags and --model")
    unwrap(model).load_state_dict(state, strict=False)


def _load_into_shards(model, wrapped, path, meta):
    """A checkpoint's weights into an FSDP2-sharded model: DCP shards as they are; a safetensors file
    read by rank 0 and broadcast into every rank's shards (only what is trained, for LoRA)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if meta.get("model_format") == "dcp":
        return load_model_dcp(wrapped, path)
    full = load_file(os.path.join(path, "model.safetensors")) if rank() == 0 else {}
    set_model_state_dict(unwrap(model), full, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=meta.get("model_subset") != "trained"))


def load_model_dcp(wrapped, ckpt_dir):
    """DCP model shards into the FSDP2-wrapped model, each rank reading what its shards need (for
    any rank count). The params keep their dtype (the storage dtype they were built in)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if not _sharded(wrapped):
        raise SystemExit(f"{ckpt_dir}: its weights are FSDP2 shards (--sharded-checkpoints); resume it with "
                         "--parallel fsdp2")
    state = {"model": get_model_state_dict(wrapped)}
    dcp.load(state, checkpoint_id=os.path.join(ckpt_dir, "model_dcp"))
    set_model_state_dict(wrapped, state["model"])


def load_training_state(ckpt_dir, optimizer, scheduler, rank, wrapped=None, ema=None):
    """Resume, part 2 (after the optimizer is built on the wrapped, cast model): DCP model shards
    if the checkpoint has them -> optimizer -> scheduler -> the EMA (`ema`: --ema-decay) -> this rank's
    RNG; checks the optimizer state kept fp32. Returns meta.json (step, loop state, args)."""
    from .precision import check_optimizer_state_dtype

    if load_meta(ckpt_dir).get("model_format") == "dcp":
        load_model_dcp(wrapped, ckpt_dir)
    load_optimizer(optimizer, ckpt_dir, wrapped)
    load_scheduler(scheduler, ckpt_dir)
    if ema is not None:
        path = os.path.join(ckpt_dir, "ema.safetensors")
        if os.path.isfile(path):
            ema.load_state_dict(load_file(path), path)
        elif rank == 0:  # (a run resumed with --ema-decay newly given: --allow-changed-args)
            print(f"warning: {ckpt_dir} holds no EMA: it starts at the resumed weights", flush=True)
    meta = load_meta(ckpt_dir)
    load_rng(ckpt_dir, rank)
    check_optimizer_state_dtype(optimizer)
    if rank == 0:
        print(f"resumed from {ckpt_dir} at step {meta['step']}", flush=True)
    return meta


def load_optimizer(optimizer, ckpt_dir, wrapped=None):
    """Step 3 of resume (after casting the model): state is cast to each param's dtype by torch.
    Under FSDP2 the state comes from the DCP shards (any rank count); else from optimizer.pt."""
    saved = load_meta(ckpt_dir).get("optimizer_format", "torch")
    now = "dcp" if _sharded(wrapped) else "torch"
    if saved != now:
        raise SystemExit(f"{ckpt_dir}: optimizer state was saved under {'FSDP2' if saved == 'dcp' else 'DDP'}; "
                         "resume it with the same --parallel")
    if now == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = {"optim": get_optimizer_state_dict(wrapped, optimizer)}  # the template DCP fills in place
        dcp.load(state, checkpoint_id=os.path.join(ckpt_dir, "optimizer_dcp"))
        set_optimizer_state_dict(wrapped, optimizer, state["optim"])
    else:
        optimizer.load_state_dict(safe_load(os.path.join(ckpt_dir, "optimizer.pt")))


def load_scheduler(scheduler, ckpt_dir):
    """The checkpoint's schedule position (last_epoch), on the schedule the flags built now: its peak
    LRs (base_lrs, which load_state_dict would take from the checkpoint) stay this run's, and each
    group's LR is set for the next step - so a resume with --allow-changed-args --lr (or a new warmup,
    schedule or --max-steps) trains at what it says; unchanged flags give the saved LRs bit for bit."""
    fresh = list(scheduler.base_lrs)
    scheduler.load_state_dict(safe_load(os.path.join(ckpt_dir, "scheduler.pt")))
    scheduler.base_lrs = fresh
    groups = scheduler.optimizer.param_groups
    for g, base, fn in zip(groups, fresh, scheduler.lr_lambdas):
        g["initial_lr"], g["lr"] = base, base * fn(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in groups]


def load_meta(ckpt_dir):
    with open(os.path.join(ckpt_dir, "meta.json")) as f:
        return json.load(f)


def load_rng(ckpt_dir, rank):
    path = os.path.join(ckpt_dir, f"rng_rank{rank}.pt")
    if os.path.isfile(path):
        set_rng_state(safe_load(path))
    elif rank == 0 or os.path.isfile(os.path.join(ckpt_dir, "rng_rank0.pt")):
        warnings.warn(f"{ckpt_dir}: no RNG state for rank {rank} (saved by fewer ranks); it keeps its fresh seed")


class StopSignal:
    """Records SIGTERM / SIGINT instead of dying mid-step: the loop finishes the step, every rank
    agrees (the flag rides on the step's reduction), a checkpoint is saved and the run exits 0.
    An evaluation under way (validation, dev scoring, the merge candidates) stops at its next batch
    (dist.stop_point raises dist.Interrupted on every rank; loop.until_stopped) and is run again on resume."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        from .dist import watch_stop

        self.name = None
        for s in signals:
            signal.signal(s, self._handle)
        watch_stop(lambda: self.requested)

    def _handle(self, signum, frame):
        self.name = self.name or signal.Signals(signum).name

    @property
    def requested(self):
        return self.name is not None


def prune(run_dir, keep_last, keep=None):
    """Delete all but the newest `keep_last` complete checkpoints (rank 0; 0 keeps all), and the steps in
    `keep` (--select-best's candidates: one step or a set of them)."""
    if keep_last <= 0 or rank() != 0:
        return
    keep = {f"step_{k:06d}" for k in (keep if isinstance(keep, (set, list, tuple)) else [keep]) if k is not None}
    done = sorted(d for d in os.listdir(run_dir) if d.startswith("step_") and is_complete(os.path.join(run_dir, d)))
    for d in done[:-keep_last]:
        if d not in keep:
            shutil.rmtree(os.path.join(run_dir, d), ignore_errors=True)


def load_best(model, run_dir, best, step, wrapped=None):
    """--select-best, before the export: the best validated step's weights into `model` (the raw HF
    model; under FSDP2 its shards: `wrapped` is the FSDP2 module) when it is not the last step; says
    which step the export holds. Returns `best` (None without --select-best)."""
    if best is None:
        return None
    if best["step"] != step:
        path = os.path.join(run_dir, f"step_{best['step']:06d}")
        meta = load_meta(path)
        if _sharded(wrapped):
            _load_into_shards(model, wrapped, path, meta)
        elif meta.get("model_subset") == "trained":
            load_trained_weights(model, path)
        else:
            load_model_weights(model, path)
    if rank() == 0:
        print(f"--select-best {best['metric']}: the export holds step {best['step']} ({best['metric']} "
              f"{best['value']:.4f}, {best.get('why', 'the best validated')})"
              f"{'' if best['step'] != step else ', the last step'}", flush=True)
    return best

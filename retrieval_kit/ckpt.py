"""Checkpoints: save, find and load them in the explicit resume order; stop on a signal.

A checkpoint is one folder per step, `step_000100/`:
    model.safetensors   weights of the unwrapped model (no `module.` / `_orig_mod.` prefixes)
    optimizer.pt        optimizer state_dict (DDP / one process; loaded with weights_only=True)
    optimizer_dcp/      sharded optimizer state under FSDP2 (torch.distributed.checkpoint)
    scheduler.pt        LR scheduler state_dict
    rng_rank{r}.pt      per-rank RNG states
    meta.json           step, loop state, args, versions; written last inside the folder
It is written into `.tmp_step_000100/` and renamed when complete; `latest` names the newest
complete one. A folder without `meta.json` is never loaded.

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
import torch.distributed as dist
from safetensors.torch import load_model, save_file

from .dist import is_fsdp, unwrap

def _barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def rng_state():
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
             "torch": torch.get_rng_state()}  # tensors and plain types only: loads with weights_only=True
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise SystemExit(f"{path}: refusing to load: not a plain tensor file, it may be tampered with "
                         f"(torch.load weights_only=True said: {str(e).splitlines()[0]})") from None


def full_state_dict(module, all_ranks=False):
    """The module's state dict with plain full CPU tensors; collective under FSDP2 (DTensors gathered).

    Pass the raw HF module (not a wrapper): its keys are the Hugging Face ones, whatever wraps it.
    Replicated (non-sharded) weights are only copied on rank 0, the one that writes them; other
    ranks get None unless `all_ranks`.
    """
    sharded = any(hasattr(p, "full_tensor") for p in unwrap(module).parameters())
    if not sharded and not all_ranks and _rank() != 0:
        return None
    out, seen = {}, set()
    for k, v in unwrap(module).state_dict().items():
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


def save_checkpoint(run_dir, step, model, optimizer, scheduler, loop_state, args=None, wrapped=None, keep_last=0):
    """Write `run_dir/step_{step:06d}/` atomically from all ranks (collective), then keep the newest
    `keep_last` complete ones (0 = all). Returns the path.

    `model` is the raw HF module whose weights are saved; `wrapped` the DDP / FSDP2 module the
    optimizer was built under (needed to gather sharded optimizer state).
    """
    name = f"step_{step:06d}"
    final, tmp = os.path.join(run_dir, name), os.path.join(run_dir, f".tmp_{name}")
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    weights = full_state_dict(model)  # collective under FSDP2
    if _sharded(wrapped):  # every rank writes its own shards; DCP reshards on load, for any rank count
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        dcp.save({"optim": get_optimizer_state_dict(wrapped, optimizer)},
                 checkpoint_id=os.path.join(tmp, "optimizer_dcp"))
    if rank == 0:
        save_file(weights, os.path.join(tmp, "model.safetensors"))
        if not _sharded(wrapped):
            torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        torch.save(scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
    _barrier()
    if rank == 0:
        import transformers

        meta = {"step": step, "loop": loop_state, "args": args, "world_size": dist.get_world_size()
                if dist.is_initialized() else 1, "torch": torch.__version__,
                "optimizer_format": "dcp" if _sharded(wrapped) else "torch",
                "transformers": transformers.__version__, "complete": True}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2, default=str)
        _fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(run_dir, "latest.tmp"), "w") as f:
            f.write(name + "\n")
        os.replace(os.path.join(run_dir, "latest.tmp"), os.path.join(run_dir, "latest"))
        prune(run_dir, keep_last)
    _barrier()
    return final


def is_complete(path):
    return os.path.isfile(os.path.join(path, "meta.json"))


def find_latest(run_dir):
    """Newest complete `step_*` folder in run_dir, or None."""
    if not os.path.isdir(run_dir):
        return None
    steps = sorted(d for d in os.listdir(run_dir) if d.startswith("step_"))
    for d in reversed(steps):
        if is_complete(os.path.join(run_dir, d)):
            return os.path.join(run_dir, d)
        if _rank() == 0:
            warnings.warn(f"{os.path.join(run_dir, d)}: incomplete checkpoint (no meta.json), skipped")
    return None


def resolve_resume(resume, run_dir):
    """--resume none|auto|PATH -> a checkpoint folder or None."""
    if resume in (None, "", "none"):
        return None
    if resume == "auto":
        return find_latest(run_dir)
    if not is_complete(resume):
        raise SystemExit(f"--resume {resume}: not a complete checkpoint folder (no meta.json)")
    return resume


def load_model_weights(model, ckpt_dir):
    """Step 1 of resume: weights into the (unwrapped) model, cast to the model's current dtypes."""
    missing, unexpected = load_model(unwrap(model), os.path.join(ckpt_dir, "model.safetensors"), strict=True)
    return missing, unexpected


def restore_model(model, ckpt_dir, storage_dtype):
    """Resume, part 1 (before wrapping): weights into the raw HF model, then cast it to the storage dtype."""
    load_model_weights(model, ckpt_dir)
    model.to(storage_dtype)


def load_training_state(ckpt_dir, optimizer, scheduler, rank, wrapped=None):
    """Resume, part 2 (after the optimizer is built on the wrapped, cast model): optimizer ->
    scheduler -> this rank's RNG; checks the optimizer state kept fp32. Returns meta.json (step,
    loop state, args)."""
    from .precision import check_optimizer_state_dtype

    load_optimizer(optimizer, ckpt_dir, wrapped)
    load_scheduler(scheduler, ckpt_dir)
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
    scheduler.load_state_dict(safe_load(os.path.join(ckpt_dir, "scheduler.pt")))


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
    A second signal exits at once (any checkpoint being written stays a `.tmp_` folder)."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.name = None
        for s in signals:
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        self.name = self.name or signal.Signals(signum).name

    @property
    def requested(self):
        return self.name is not None


def add_ckpt_args(parser, output_dir):
    """Checkpoint and resume flags (both scripts)."""
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--output-dir", default=output_dir, help=f"run folder: logs, checkpoints, final model (default {output_dir})")
    g.add_argument("--ckpt-every", type=int, default=100, help="checkpoint every N steps, and at the end (default 100)")
    g.add_argument("--keep-last", type=int, default=3, help="keep the newest K complete checkpoints (0 = all; default 3)")
    g.add_argument("--resume", default="none",
                   help="none | auto (latest complete checkpoint in --output-dir, or start fresh) | PATH to a step_* folder")
    return g


def prune(run_dir, keep_last):
    """Delete all but the newest `keep_last` complete checkpoints (rank 0; 0 keeps all)."""
    if keep_last <= 0 or _rank() != 0:
        return
    done = sorted(d for d in os.listdir(run_dir) if d.startswith("step_") and is_complete(os.path.join(run_dir, d)))
    for d in done[:-keep_last]:
        shutil.rmtree(os.path.join(run_dir, d), ignore_errors=True)

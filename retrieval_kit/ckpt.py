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
falls back to the one before. start_run keeps one run per folder and checks a resume's args.

Resume order (see precision.py for why): load_model_weights -> cast model to the storage dtype
-> build optimizer, load_optimizer -> load_scheduler -> loop state from meta.json.
"""

import json
import os
import pickle
import random
import shutil
import signal
import sys
import time
import warnings

import numpy as np
import torch
import torch.distributed as tdist
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


def resolve_resume(resume, run_dir):
    """--resume none|auto|PATH -> a checkpoint folder or None (this process's view; start_run
    decides once on rank 0 for all ranks)."""
    if resume in (None, "", "none"):
        return None
    if resume == "auto":
        return find_latest(run_dir)
    problem = verify(resume)
    if problem:
        raise SystemExit(f"--resume {resume}: {problem}")
    return resume


# args a script sets from what it read, not flags: how a changed one is named
DERIVED = {"train_mixture": "the training files (name, path, records, weight, batches per round, prompts, content "
                            "digest)"}
# what a resume cannot change even with --allow-changed-args: the weights it continues come from it
FIXED = {"model": "a resume continues the checkpoint's weights, trained from that model: start a new run (another "
                  "--output-dir) to train another one",
         "head": "a checkpoint holds the weights of its head (a projection, a vocabulary or classifier head): start "
                 "a new run (another --output-dir) to train another kind of model",
         "multi_vector_dim": "its token projection has that many rows: start a new run (another --output-dir) to "
                             "train another size"}


def _comparable(saved, now):
    """`now` without the keys a checkpoint from an older kit did not record (a training file's digest)."""
    if isinstance(saved, list) and isinstance(now, list) and len(saved) == len(now):
        return [{k: v for k, v in n.items() if k in s} if isinstance(s, dict) and isinstance(n, dict) else n
                for s, n in zip(saved, now)]
    return now


def changed_args(saved, now, saved_world, world, neutral=frozenset()):
    """["--flag: saved -> now", ...] for what defines the run: every arg but the `neutral` ones
    (cli.run_neutral: the flags marked neutral where they are declared), with the batch counted
    over all ranks (`--batch-size` x ranks: the in-batch negatives; 1 rank x 8 is 2 ranks x 4) and
    `--max-steps` only where the LR schedule decays to it."""
    skip = set(neutral) | {"batch_size"}
    if saved.get("lr_schedule") == now.get("lr_schedule") == "constant":
        skip.add("max_steps")
    if isinstance(saved.get("train_file"), str):  # one path, as checkpoints before repeatable --train-file
        saved = {**saved, "train_file": [saved["train_file"]]}
    now = {**now, "train_mixture": _comparable(saved.get("train_mixture"), now.get("train_mixture"))}
    out = [f"{DERIVED.get(k) or '--' + k.replace('_', '-')}: {saved[k]!r} in the checkpoint, {now[k]!r} now"
           for k in sorted(set(saved) & set(now)) if k not in skip and saved[k] != now[k]]
    before, after = saved.get("batch_size", 0) * saved_world, now.get("batch_size", 0) * world
    if before != after:
        out.append(f"--batch-size x ranks: {saved.get('batch_size')} x {saved_world} in the checkpoint, "
                   f"{now.get('batch_size')} x {world} now")
    return out


def _used(run_dir):
    """What in run_dir says a run already lives there."""
    if not os.path.isdir(run_dir):
        return []
    return sorted(d for d in os.listdir(run_dir) if d.startswith(("step_", ".tmp_step_"))
                  or d in ("final", "latest", "metrics.jsonl"))


# ----- one writer per run folder ----------------------------------------------------------------

LOCK_FILE = "run.lock"
LOCK_STALE_S = 600  # a lock written on another host and not refreshed for this long is taken over
LOCK_REFRESH_S = 60
_held = {}  # realpath of a run folder -> (open lock file, stop event) of the lock this process holds


def _process_start(pid):
    """When process `pid` started (clock ticks since boot; /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _lock_holder(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def acquire_lock(run_dir):
    """Hold `run_dir/run.lock` for the life of this process: an exclusive flock (the OS lets go when
    the process dies, however it dies) over a file naming the holder (host, pid, start time),
    refreshed every LOCK_REFRESH_S. Returns None, or the sentence that refuses a second writer:
    - the flock is held: a live run on this host (or on a shared filesystem whose locks work);
    - another host wrote the file, did not release it and refreshed it less than LOCK_STALE_S ago
      (a filesystem whose locks do not reach across nodes); an older one is taken over with a warning.
    """
    import fcntl
    import socket
    import threading

    key = os.path.realpath(run_dir)
    if key in _held:
        return None
    path = os.path.join(run_dir, LOCK_FILE)
    if os.path.lexists(path) and not os.path.isfile(path):  # a directory, a dangling link, a socket...
        return (f"--output-dir {run_dir}: {path} is not a file (the run-folder lock is one): remove it, or use another "
                "--output-dir")
    try:
        f = open(path, "a+")
    except OSError as e:
        return f"--output-dir {run_dir}: cannot open its lock {path}: {e.strerror}"
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        h = _lock_holder(path)
        return (f"--output-dir {run_dir}: another run is writing there (host {h.get('host', '?')}, pid "
                f"{h.get('pid', '?')}, started {h.get('started', '?')}); two runs on one folder overwrite each "
                "other's checkpoints: wait for it to end, or use another --output-dir")
    me = socket.gethostname()
    h = _lock_holder(path)
    if h and not h.get("released") and h.get("host") != me:
        age = time.time() - os.path.getmtime(path)
        if age < LOCK_STALE_S:
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()
            return (f"--output-dir {run_dir}: a run on host {h.get('host')} (pid {h.get('pid')}) holds it, last seen "
                    f"{age:.0f} s ago; if that run is gone, wait until {LOCK_STALE_S} s have passed since, or delete "
                    f"{path}")
        print(f"warning: {path}: taking over the lock of host {h.get('host')} (pid {h.get('pid')}), not refreshed "
              f"for {age:.0f} s", flush=True)
    f.seek(0)
    f.truncate()
    json.dump({"host": me, "pid": os.getpid(), "process_start": _process_start(os.getpid()),
               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}, f)
    f.flush()
    stop = threading.Event()

    def refresh():
        while not stop.wait(LOCK_REFRESH_S):
            try:
                os.utime(path)
            except OSError:
                pass
    threading.Thread(target=refresh, daemon=True, name="run.lock refresh").start()
    _held[key] = (f, stop)
    return None


def release_lock(run_dir=None):
    """Let go of the lock this process holds on `run_dir` (None: every one), marking it released."""
    import fcntl

    for key in [k for k in _held if run_dir is None or k == os.path.realpath(run_dir)]:
        f, stop = _held.pop(key)
        stop.set()
        try:
            holder = _lock_holder(os.path.join(key, LOCK_FILE))  # read before the file is emptied
            f.seek(0)
            f.truncate()
            json.dump({**holder, "released": True}, f)
            f.flush()
        except (OSError, ValueError):
            pass
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def _decide(run_dir, resume, overwrite, allow_changed, run_args, neutral, world, inputs=()):
    """Rank 0's decision for start_run: (resume dir or None, error message or None); holds the run
    folder's lock from here on (released when the decision is a refusal)."""
    from .outputs import check_inputs

    try:  # the run folder is never an input, nor inside an input folder (a model dir)
        check_inputs("--output-dir", run_dir, inputs)
    except SystemExit as e:
        return None, str(e)
    try:
        os.makedirs(run_dir, exist_ok=True)
        probe = os.path.join(run_dir, ".write_test")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        return None, f"--output-dir {run_dir}: cannot write there ({flags.os_reason(e)})"
    refused = acquire_lock(run_dir)
    if refused:
        return None, refused
    resume_dir, error = _decide_resume(run_dir, resume, overwrite, allow_changed, run_args, neutral, world, inputs)
    if error:
        release_lock(run_dir)
    return resume_dir, error


def _decide_resume(run_dir, resume, overwrite, allow_changed, run_args, neutral, world, inputs=()):
    from .outputs import check_inputs, is_own
    from .st_format import SETTINGS_FILE

    used = _used(run_dir)
    if resume in (None, "", "none"):
        if not used:
            return None, None
        if not overwrite:
            shown = ", ".join(used[:4]) + (", ..." if len(used) > 4 else "")
            return None, (f"--output-dir {run_dir} already holds a run ({shown}): continue it with --resume auto, "
                          "or start over with --overwrite-output-dir (deletes it)")
        for d in used:  # what would be deleted: never an input of this run, never a folder the kit did not write
            try:
                check_inputs("--overwrite-output-dir", os.path.join(run_dir, d), inputs, is_dir=True)
            except SystemExit as e:
                return None, f"{e}; it would be deleted"
        final = os.path.join(run_dir, "final")
        if os.path.isdir(final) and not is_own(final, SETTINGS_FILE):
            return None, (f"--overwrite-output-dir: {final} holds files the kit did not write (no {SETTINGS_FILE}): "
                          "not deleted; move it away")
        for d in used + ["run_header.json", "tb"]:
            p = os.path.join(run_dir, d)
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.remove(p)
        print(f"--overwrite-output-dir: cleared {run_dir}", flush=True)
        return None, None
    try:
        resume_dir = resolve_resume(resume, run_dir)
    except SystemExit as e:
        return None, str(e)
    if resume_dir is None:
        return None, None
    meta = load_meta(resume_dir)
    saved_args = meta.get("args") or {}
    diffs = changed_args(saved_args, run_args, meta.get("world_size", 1), world, neutral)
    for k, why in FIXED.items():
        if k in saved_args and k in run_args and saved_args[k] != run_args[k]:
            return None, (f"--resume: {resume_dir} was trained from --{k.replace('_', '-')} {saved_args[k]}, this run names "
                          f"{run_args[k]}; {why}")
    if diffs and not allow_changed:
        return None, (f"--resume: {resume_dir} was trained with other settings; what would change:\n  " +
                      "\n  ".join(diffs) + "\nrun with the checkpoint's values, or pass --allow-changed-args to "
                      "continue with today's")
    for d in diffs:
        print(f"warning: --allow-changed-args: {d}", flush=True)
    return resume_dir, None


_run = {"dir": None}  # the run folder start_run decided on (for resume_note)


def resume_note():
    """What a run that cannot go on says last: its newest intact checkpoint and how to continue."""
    newest = find_latest(_run["dir"]) if _run["dir"] and os.path.isdir(_run["dir"]) else None
    return (f"the newest intact checkpoint is {newest}: when every rank can run again, continue with --resume auto"
            if newest else "no checkpoint was written yet: start the run again")


def start_run(run_dir, resume, run_args, neutral=frozenset(), overwrite=False, allow_changed=False, inputs=()):
    """Before anything is loaded: decide, once on rank 0 and shared with every rank, where this run
    starts. A folder that already holds a run is refused without `resume` (or cleared with
    `overwrite`, --overwrite-output-dir); resume "auto" takes the newest checkpoint that verifies,
    and a resume whose run-defining args (`run_args`, a dict; all but the `neutral` names) differ
    from the checkpoint's stops with the list (or goes on with `allow_changed`,
    --allow-changed-args). The run folder is never one of the run's `inputs` ([(flag, path)]: its model
    dir, data files) nor inside an input folder, and --overwrite-output-dir deletes no input (outputs.check_inputs).
    Returns the checkpoint folder or None; a refusal exits with its message."""
    decision = [_decide(run_dir, resume, overwrite, allow_changed, run_args, neutral, world_size(), inputs)
                if rank() == 0 else None]
    if world_size() > 1:
        tdist.broadcast_object_list(decision, src=0)
    resume_dir, error = decision[0]
    if error:
        raise SystemExit(error if rank() == 0 else 1)
    _run["dir"] = run_dir
    return resume_dir


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

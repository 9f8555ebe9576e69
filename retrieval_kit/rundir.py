"""A run's folder, from its start to its end: one run per folder (start_run), one writer at a time (its
lock, run.lock), the resume decision (which checkpoint, and whether today's args may continue it), and how
an entry point ends (exit_on_data_error: a user's bad file, a lost peer, a stop signal after the loop).
The checkpoints themselves are ckpt.py's.

    resume_dir = rundir.start_run(**cli.resume_request(args), run_args=vars(args), neutral=cli.run_neutral())
"""

import json
import os
import shutil
import sys
import time

import torch.distributed as tdist

from . import flags, formats
from .ckpt import find_latest, load_meta, verify
from .dist import Interrupted, is_main, peer_failure, rank, world_size
from .outputs import check_inputs, is_own
from .st_format import SETTINGS_FILE


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
# what a resume cannot change even with --allow-changed-args: the weights it continues come from it (and each
# head's own such flags: its RESUME_FIXED, heads.RESUME_FIXED, passed in by start_run's caller)
FIXED = {"model": "a resume continues the checkpoint's weights, trained from that model: start a new run (another "
                  "--output-dir) to train another one",
         "head": "a checkpoint holds the weights of its head (its own modules beside the backbone): start a new run "
                 "(another --output-dir) to train another kind of model"}


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


def _decide(run_dir, resume, overwrite, allow_changed, run_args, neutral, world, inputs=(), fixed=None):
    """Rank 0's decision for start_run: (resume dir or None, error message or None); holds the run
    folder's lock from here on (released when the decision is a refusal)."""

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
    resume_dir, error = _decide_resume(run_dir, resume, overwrite, allow_changed, run_args, neutral, world, inputs,
                                       fixed)
    if error:
        release_lock(run_dir)
    return resume_dir, error


def _decide_resume(run_dir, resume, overwrite, allow_changed, run_args, neutral, world, inputs=(), fixed=None):

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
    for k, why in {**FIXED, **(fixed or {})}.items():
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


def start_run(run_dir, resume, run_args, neutral=frozenset(), overwrite=False, allow_changed=False, inputs=(),
              fixed=None):
    """Before anything is loaded: decide, once on rank 0 and shared with every rank, where this run
    starts. A folder that already holds a run is refused without `resume` (or cleared with
    `overwrite`, --overwrite-output-dir); resume "auto" takes the newest checkpoint that verifies,
    and a resume whose run-defining args (`run_args`, a dict; all but the `neutral` names) differ
    from the checkpoint's stops with the list (or goes on with `allow_changed`,
    --allow-changed-args). The run folder is never one of the run's `inputs` ([(flag, path)]: its model
    dir, data files) nor inside an input folder, and --overwrite-output-dir deletes no input
    (outputs.check_inputs). `fixed`: {arg: why} a resume cannot change even with --allow-changed-args,
    beyond FIXED. Returns the checkpoint folder or None; a refusal exits with its message."""
    decision = [_decide(run_dir, resume, overwrite, allow_changed, run_args, neutral, world_size(), inputs, fixed)
                if rank() == 0 else None]
    if world_size() > 1:
        tdist.broadcast_object_list(decision, src=0)
    resume_dir, error = decision[0]
    if error:
        raise SystemExit(error if rank() == 0 else 1)
    _run["dir"] = run_dir
    return resume_dir


def exit_on_data_error(main):
    """Run an entry point's main(): a DataError (a user's bad or missing file) ends the run with its
    message (printed once, by rank 0 under torchrun) and exit status 1, not a traceback. A rank that
    lost a peer (dead, or hung past --dist-timeout: dist.peer_failure) says so in one line with the
    newest intact checkpoint and exits at once: the process group's teardown would wait on the lost
    peer forever. A stop signal that reaches an evaluation after the training loop (the reranker's fusion
    choice, --merge-alphas' candidates: dist.Interrupted, on every rank at once) exits 0 at once: the last
    step is checkpointed, and --resume auto exports and chooses again."""
    try:
        return main()
    except formats.DataError as e:
        raise SystemExit(str(e) if is_main() else 1) from None
    except Interrupted:
        release_lock()
        if is_main():
            print(f"stopped by a signal during the run's final dev scoring (fusion or merge weight), before the export "
                  f"was finished; {resume_note()}", flush=True)
        raise SystemExit(0) from None
    except Exception as e:  # noqa: BLE001 - only a lost peer is handled here
        what = peer_failure(e) if world_size() > 1 else None
        if what is None:
            raise
        print(f"rank {rank()}: {what}; {resume_note()}", file=sys.stderr, flush=True)
        os._exit(1)

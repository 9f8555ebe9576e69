"""Where a command may write: one rule for every writer of the kit (evaluate --output, score / mine
--out, the scripts' exports and run folders, scripts/build_smollm2.py --out, merge --out).

  - an output is never one of the command's inputs, nor inside an input folder (a model dir, a BEIR
    folder), nor a folder that holds an input; symlinks are followed, so a link to an input is that input;
  - an existing file is replaced only with --overwrite (or when it is the tool's own output, `own`);
  - an existing folder is replaced only when it is the tool's own (it holds the tool's `marker` file)
    or empty; a folder that holds anything else is refused, whatever the flags;
  - a folder is written into OUT.partial (which carries STAGE_MARK from its first moment) and renamed
    to OUT when complete: a kill never leaves a folder that looks complete, and a leftover OUT.partial
    is cleared only when it is the kit's own.
Each refusal is one sentence naming the flag, before any work.
"""

import os
import shutil

STAGE_MARK = ".retrieval_kit.partial"  # in a staging folder from its first moment: the kit's to clear


def _real(path):
    return os.path.realpath(os.path.expanduser(path))


def _inside(path, folder):
    """Is `path` `folder` itself or below it (real paths)?"""
    try:
        return os.path.commonpath([path, folder]) == folder
    except ValueError:  # (different drives)
        return False


def check_inputs(flag, path, inputs, is_dir=False):
    """One sentence when the output `path` is an input, lies inside an input folder, or (a folder)
    holds an input. `inputs`: [(flag, path or None)]."""
    real = _real(path)
    for in_flag, given in inputs:
        if not given or not os.path.exists(given):
            continue
        ri = _real(given)
        what = f"{in_flag} {given}"
        if real == ri:
            raise SystemExit(f"{flag} {path} is the command's input ({what}): write to another path")
        if os.path.isdir(ri) and _inside(real, ri):
            raise SystemExit(f"{flag} {path} lies inside the input folder {what}: write outside it")
        if is_dir and _inside(ri, real):
            raise SystemExit(f"{flag} {path} holds the command's input {what}: write to another folder")


def json_holds(path, keys):
    """Is `path` a JSON object holding every one of `keys` (how a tool knows the file is its own output)?"""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            got = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(got, dict) and all(k in got for k in keys)


def check_file(flag, path, inputs=(), overwrite=False, own=None):
    """Before any work: the file `path` may be written - not an input (check_inputs), not a folder,
    replaced only with `overwrite` or when `own(path)` says the tool wrote it - and it can be written
    (its folder is made; a probe file is opened and removed). One sentence naming `flag` otherwise."""
    from .flags import check_writable_file

    check_inputs(flag, path, inputs)
    if os.path.isdir(path):
        raise SystemExit(f"{flag} {path} is a folder: give a file path")
    if os.path.exists(path) and not overwrite and not (own and own(path)):
        raise SystemExit(f"{flag} {path} exists: pass --overwrite to replace it" if own is None else
                         f"{flag} {path} exists and is not this tool's output: write to another path")
    check_writable_file(flag, path)


def is_own(path, marker):
    """Is the folder `path` the tool's own output (it holds `marker`) or empty?"""
    return os.path.isdir(path) and (not os.listdir(path) or os.path.exists(os.path.join(path, marker)))


def check_dir(flag, path, marker, inputs=()):
    """Before any work: the folder `path` may be written as a whole (replaced when complete) - not an
    input, not a file, and either absent, empty or the tool's own (holding `marker`) - and so may its
    staging folder (stage); its parent can be written. One sentence naming `flag` otherwise."""
    from .flags import os_reason

    check_inputs(flag, path, inputs, is_dir=True)
    if os.path.exists(path) and not os.path.isdir(path):
        raise SystemExit(f"{flag} {path} is a file: give a folder path")
    if os.path.isdir(path) and not is_own(path, marker):
        shown = ", ".join(sorted(os.listdir(path))[:3])
        raise SystemExit(f"{flag} {path} holds files this tool did not write ({shown}, ...; no {marker}): the kit "
                         "replaces only a folder it wrote; give an empty or new folder")
    _check_stage(flag, staging(path))
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
        probe = os.path.join(parent, f".{os.path.basename(os.path.abspath(path))}.write_test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise SystemExit(f"{flag} {path}: cannot write there ({os_reason(e)})") from None


def staging(path):
    """The folder `path` is written into before it is published: PATH.partial."""
    return os.path.normpath(path) + ".partial"


def _check_stage(flag, stage):
    if os.path.lexists(stage) and not os.path.isdir(stage):
        raise SystemExit(f"{flag}: {stage} is a file, where the kit stages the folder it writes: move it away")
    if os.path.isdir(stage) and os.listdir(stage) and not os.path.exists(os.path.join(stage, STAGE_MARK)):
        raise SystemExit(f"{flag}: {stage} holds files the kit did not write (no {STAGE_MARK}), where it stages the "
                         "folder it writes: move it away")


def stage(path, flag="the output"):
    """A fresh, empty staging folder for `path` (a leftover of the kit's own is cleared), marked as the
    kit's; returns its path."""
    where = staging(path)
    _check_stage(flag, where)
    shutil.rmtree(where, ignore_errors=True)
    os.makedirs(where)
    with open(os.path.join(where, STAGE_MARK), "w"):
        pass
    return where


def publish(path, marker, flag="the output"):
    """Replace the folder `path` by its finished staging folder; `path`, if there, must be the tool's own
    (holding `marker`, or empty), else one sentence and nothing is removed."""
    where = staging(path)
    if os.path.lexists(path) and not is_own(path, marker):
        raise SystemExit(f"{flag} {path} holds files this tool did not write (no {marker}): not replaced; the finished "
                         f"folder is {where}")
    os.remove(os.path.join(where, STAGE_MARK))
    if os.path.islink(path):
        os.remove(path)
    else:
        shutil.rmtree(path, ignore_errors=True)
    os.replace(where, path)


def check_parts(flag, parts, manifest):
    """A resumable tool's OUT.parts folder (its blocks, kept until OUT is written, then removed): absent,
    empty, or the tool's own (holding its `manifest` file); else one sentence, before any work."""
    if os.path.lexists(parts) and not os.path.isdir(parts):
        raise SystemExit(f"{flag}: {parts} is a file, where the tool keeps its blocks until the output is written: "
                         "move it away")
    if os.path.isdir(parts) and not is_own(parts, manifest):
        raise SystemExit(f"{flag}: {parts} holds files this tool did not write (no {manifest}); the tool keeps its "
                         "blocks there and removes the folder at the end: move it away")

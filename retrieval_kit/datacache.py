"""A parsed data file kept on disk and mapped: the first read of a training file or corpus writes its
arrays (texts as one UTF-8 buffer, offsets, ids, scores) to a cache entry; later reads map them, so a
resume or a second run starts in seconds and every rank and DataLoader worker on a node shares one
copy of the pages.

An entry is a folder of raw arrays and a meta.json that says what each is (dtype, length, a digest of
sampled blocks) and what it was built from: the source file's size and a hash of all its bytes, plus
what else the parse depended on (the corpus a training file's ids refer to). An entry that
no longer matches its source is stale; one whose meta or arrays do not match what meta says is
damaged; either is rebuilt with a warning, never used. An entry is written under a temporary name and
renamed into place when complete, so a kill during the build leaves nothing that looks complete.
Builders take a file lock: of the ranks that read the same file at once, one builds, the others wait
and map what it wrote.

Where (`--data-cache`): "auto" (the default) beside the source, as `.<name>.rkcache`, for sources of
at least AUTO_MIN_BYTES (smaller ones parse in about a second); "off"; or a folder, for any size.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys

import numpy as np

VERSION = 1
AUTO_MIN_BYTES = 16 << 20
SAMPLE = 4096  # bytes per sampled block of an array's digest


def warn(message):
    print(f"warning: {message}", file=sys.stderr, flush=True)


_digests = {}  # (path, inode, size, ctime) -> content digest: a file is hashed once per process (any write, and
# a restored mtime too, moves the ctime, which no user call sets back)


def file_digest(path, block=1 << 22):
    """blake2b-128 of all the bytes of the file at `path` (hex)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(path):
    """What a cache entry is keyed by: the source's size and a blake2b of all its bytes (file_digest),
    so any edit - mid-file, same size, mtime restored - makes the entry stale, and touching a file
    does not. Hashing is the price of a warm load: 0.87 s for 580 MB here (docs/benchmarks.md)."""
    st = os.stat(path)
    memo = (os.path.abspath(path), st.st_ino, st.st_size, st.st_ctime_ns)
    if memo not in _digests:
        _digests[memo] = file_digest(path)
    return {"size": st.st_size, "content": _digests[memo]}


def entry_path(path, where):
    """The cache entry of `path` under `where` ("auto", "off"/None, or a folder), or None for no cache."""
    if not where or where == "off":
        return None
    if where == "auto":
        if os.path.getsize(path) < AUTO_MIN_BYTES:
            return None
        return os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.rkcache")
    key = hashlib.blake2b(os.path.abspath(path).encode(), digest_size=6).hexdigest()
    return os.path.join(where, f"{os.path.basename(path)}-{key}.rkcache")


def _sample_digest(mapped):
    """blake2b of an array's head, tail and 16 evenly spaced blocks (a truncated or overwritten file
    is caught without reading it all)."""
    raw = mapped.view(np.uint8).reshape(-1) if mapped.size else np.zeros(0, np.uint8)
    n, h = raw.size, hashlib.blake2b(digest_size=16)
    starts = sorted({0, max(0, n - SAMPLE)} | {k * n // 16 for k in range(16)})
    for s in starts:
        h.update(raw[s:s + SAMPLE].tobytes())
    return h.hexdigest()


def _map(entry, name, dtype, length):
    path = os.path.join(entry, name)
    if length == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(length,))


def write(entry, arrays, info, key):
    """Write an entry: `arrays` {name: 1-d numpy array}, `info` (JSON) and `key` (what it was built
    from), under a temporary name renamed into place when complete."""
    tmp = f"{entry}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    meta = {"version": VERSION, "key": key, "info": info, "arrays": {}}
    try:
        for name, a in arrays.items():
            a = np.ascontiguousarray(a).reshape(-1)
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(memoryview(a.view(np.uint8)))
                f.flush()
                os.fsync(f.fileno())
            meta["arrays"][name] = {"dtype": a.dtype.str, "length": int(a.size), "digest": _sample_digest(a)}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk keeps no half entry
        raise
    old = f"{entry}.old{os.getpid()}"
    if os.path.exists(entry):
        os.rename(entry, old)  # a run still mapping the old entry keeps its pages
    os.rename(tmp, entry)
    shutil.rmtree(old, ignore_errors=True)


def read(entry, key):
    """(arrays {name: read-only mapped array}, info), or (None, why) when the entry is missing (why
    None), stale or damaged."""
    meta_path = os.path.join(entry, "meta.json")
    if not os.path.exists(meta_path):
        return None, None
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("version") != VERSION:
            return None, f"written by another version of the kit ({meta.get('version')})"
        if meta["key"] != key:
            return None, "stale: its source changed since it was written"
        arrays = {}
        for name, a in meta["arrays"].items():
            dtype, length = np.dtype(a["dtype"]), a["length"]
            size = os.path.getsize(os.path.join(entry, name))
            if size != length * dtype.itemsize:
                return None, f"damaged: {name} holds {size} bytes, meta.json says {length * dtype.itemsize}"
            arrays[name] = _map(entry, name, dtype, length)
            if _sample_digest(arrays[name]) != a["digest"]:
                return None, f"damaged: {name} does not match its digest"
        return arrays, meta["info"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"damaged: {type(e).__name__}: {e}"


@contextlib.contextmanager
def _lock(entry):
    os.makedirs(os.path.dirname(entry), exist_ok=True)
    with open(f"{entry}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _clear_leftovers(entry):
    """Temporary folders of builds that were killed (safe under the lock: no build is running)."""
    folder, base = os.path.dirname(entry), os.path.basename(entry)
    for name in os.listdir(folder):
        if name.startswith(base + ".tmp") or name.startswith(base + ".old"):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def cached(path, where, key, build, what):
    """Map the cache entry of `path` (entry_path) if it matches `key` (plus the source's fingerprint),
    else build it: `build()` -> (arrays, info), written and then mapped. Returns (arrays, info,
    state): state is "hit", "built" or None (no cache: `where` is off, the source is small for
    "auto", or the entry cannot be written - said in a warning; the built arrays are returned).
    `what` names the source in warnings."""
    entry = entry_path(path, where) if os.path.isfile(path) else None  # (a missing file: the parser says so)
    if entry is None:
        return (*build(), None)
    key, built = {"source": fingerprint(path), **key}, None
    try:
        with _lock(entry):
            arrays, info = read(entry, key)
            if arrays is not None:
                return arrays, info, "hit"
            why = info
            if why:
                warn(f"the data cache {entry} of {what} is {why}; rebuilding it")
            _clear_leftovers(entry)
            built = build()
            write(entry, *built, key)
            arrays, info = read(entry, key)
            if arrays is None:
                raise OSError(f"the entry just written does not read back ({info})")
            return arrays, info, "built"
    except OSError as e:
        warn(f"cannot use the data cache {entry} for {what} ({e}); reading it without a cache "
             "(--data-cache DIR puts the cache elsewhere, --data-cache off turns it off)")
        return (*(built or build()), None)

"""A parsed data file kept on disk and mapped: the first read of a training file or corpus writes its
arrays (texts as one UTF-8 buffer, offsets, ids, scores) to a cache entry; later reads map them, so a
resume or a second run starts in seconds and every rank and DataLoader worker on a node shares one
copy of the pages.

An entry is a folder of raw arrays and a meta.json that says what each is (dtype, length, a digest of
sampled blocks) and what it was built from: the source file's size and a hash of all its bytes, plus
what else the parse depended on (the corpus a training file's ids refer to). Beside that hash it keeps
the source's device, inode, size, mtime and ctime when hashed (stat_key): while they are unchanged a
load trusts the recorded hash and reads no byte of the source (O(1) in its size); any change (a
write, a touch, a restored mtime - which moves the ctime -, a copy, a move) hashes it again. An entry that
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


_digests = {}  # stat_key -> content digest: a file is hashed at most once per process while it is unchanged


def stat_key(path):
    """What says a file is unchanged since it was hashed: its device, inode, size, mtime and ctime (ns).
    Any write moves the mtime and the ctime; a user can set the mtime back (touch -d, os.utime), not the
    ctime, which every change of the inode (a write, a utime, a rename) sets to now; a copy is another inode."""
    st = os.stat(path)
    return {"path": os.path.abspath(path), "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _memo(stat):
    return tuple(stat[k] for k in ("path", "dev", "ino", "size", "mtime_ns", "ctime_ns"))


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
    does not. The bytes are hashed only when the file's stat_key is one this process has not seen
    hashed, nor an entry recorded beside its digest (cached, remember): a warm load reads no byte of
    the source (docs/benchmarks.md)."""
    before = stat_key(path)
    memo = _memo(before)
    if memo not in _digests:
        content = file_digest(path)
        if _memo(stat_key(path)) == memo:  # (a file written while it was hashed: not remembered)
            _digests[memo] = content
        return {"size": before["size"], "content": content}
    return {"size": before["size"], "content": _digests[memo]}


def remember(stat, source):
    """Take an entry's record that the file with `stat` (stat_key) hashed to `source` (fingerprint) as
    this process's own hashing of it, when the file's stat is still that."""
    if isinstance(stat, dict) and isinstance(source, dict) and "content" in source:
        try:
            if stat == stat_key(stat["path"]) and source.get("size") == stat["size"]:
                _digests[_memo(stat)] = source["content"]
        except (OSError, KeyError, TypeError):
            pass


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


def write(entry, arrays, info, key, stat=None):
    """Write an entry: `arrays` {name: 1-d numpy array}, `info` (JSON) and `key` (what it was built
    from; `stat`: the source's stat_key when key["source"] was taken), under a temporary name renamed
    into place when complete."""
    tmp = f"{entry}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    meta = {"version": VERSION, "key": key, "stat": stat, "info": info, "arrays": {}}
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


def peek(entry):
    """An entry's meta.json, or None (missing or unreadable)."""
    try:
        with open(os.path.join(entry, "meta.json")) as f:
            meta = json.load(f)
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


def restamp(entry, stat):
    """Record `stat` as the source's in the entry (its content was hashed again and still matches: a
    touch, a restored mtime), so the next warm load need not hash it; written whole or not at all."""
    meta = peek(entry)
    if meta is None:
        return
    meta["stat"] = stat
    tmp = os.path.join(entry, f"meta.json.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, os.path.join(entry, "meta.json"))
    except OSError:  # (a read-only cache still serves; it hashes again next time)
        with contextlib.suppress(OSError):
            os.remove(tmp)


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
    built = None
    try:
        with _lock(entry):
            meta = peek(entry) or {}
            remember(meta.get("stat"), (meta.get("key") or {}).get("source"))  # unchanged since: not hashed again
            stat = stat_key(path)
            key = {"source": fingerprint(path), **key}
            arrays, info = read(entry, key)
            if arrays is not None:
                if meta.get("stat") != stat and _memo(stat) in _digests:  # hashed again, and it matched
                    restamp(entry, stat)
                return arrays, info, "hit"
            why = info
            if why:
                warn(f"the data cache {entry} of {what} is {why}; rebuilding it")
            _clear_leftovers(entry)
            built = build()
            write(entry, *built, key, stat if _memo(stat) in _digests else None)
            arrays, info = read(entry, key)
            if arrays is None:
                raise OSError(f"the entry just written does not read back ({info})")
            return arrays, info, "built"
    except OSError as e:
        warn(f"cannot use the data cache {entry} for {what} ({e}); reading it without a cache "
             "(--data-cache DIR puts the cache elsewhere, --data-cache off turns it off)")
        return (*(built or build()), None)

"""argparse types that refuse nonsense values up front: `--batch-size 0` is one line from argparse
("argument --batch-size: must be a positive integer, got 0") and exit status 2, never a
ZeroDivisionError many steps later or a run that trains on NaN."""

import argparse
import math
import os


def _number(kind, text):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _checked(kind, ok, says):
    def parse(text):
        value = _number(kind, text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{says}, got {text}")
        return value
    return parse


positive_int = _checked(int, lambda v: v > 0, "must be a positive integer")
nonneg_int = _checked(int, lambda v: v >= 0, "must be 0 or more")
positive_float = _checked(float, lambda v: v > 0, "must be a positive number")
nonneg_float = _checked(float, lambda v: v >= 0, "must be 0 or more")
fraction = _checked(float, lambda v: 0 <= v <= 1, "must be between 0 and 1")
beta = _checked(float, lambda v: 0 <= v < 1, "must be at least 0 and below 1")  # an Adam beta
open_fraction = _checked(float, lambda v: 0 < v < 1, "must be above 0 and below 1")  # an EMA decay
any_float = _checked(float, lambda v: True, "")  # any finite number (a bias)


def metric_name(text):
    """A logged metric, "split/name" (val/loss, beir/ndcg@10): lower is better for a loss, else higher."""
    split, _, name = text.partition("/")
    if not split or not name:
        raise argparse.ArgumentTypeError(f"must be split/name as logged, e.g. val/loss or beir/ndcg@10, got {text!r}")
    return text


def choice(names):
    """One of `names` (an item of a listed flag; argparse's choices cannot check the items of a list)."""
    def parse(text):
        if text not in names:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(names)}, got {text!r}")
        return text
    return parse


def listed(item):
    """A comma-separated list of `item` values ("384,256,128"), each checked by `item`."""
    def parse(text):
        parts = [t.strip() for t in text.split(",") if t.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"must be a comma-separated list, got {text!r}")
        return [item(t) for t in parts]
    return parse


class Repeatable(argparse.Action):
    """A flag that may be given several times: the values, in order, in place of the default (a
    list; argparse's own "append" would add them to it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, (list(current) if current is not self.default else []) + [values])


def os_reason(e):
    """A failed write or read in a few words, or None for any other exception (a bug): an OSError,
    safetensors' I/O error, torch.save's (a RuntimeError from its zip writer when a write comes up
    short: a full disk or a file-size limit), or a Rust library's "(os error N)" (tokenizers)."""
    import re

    if isinstance(e, (FileExistsError, NotADirectoryError)):
        return "a part of the path is a file, not a folder"
    if isinstance(e, OSError):
        return (e.strerror or str(e)) + (f" ({e.filename})" if e.filename else "")
    text = str(e)
    if type(e).__name__ == "SafetensorError" and "I/O error: " in text:
        return text.split("I/O error: ")[-1]
    if isinstance(e, RuntimeError) and ("inline_container.cc" in text or "PytorchStreamWriter" in text):
        return "the file could not be written whole (a full disk or a file-size limit)"
    found = re.search(r"\(os error (\d+)\)", text)
    if found:
        return os.strerror(int(found.group(1)))
    return None


class writing:
    """`with writing("the export to DIR", then="..."):` - a failed write inside (os_reason) ends the run
    with one sentence: what could not be written, why, and `then` (what is intact, what to do; a
    callable is asked when the write failed)."""

    def __init__(self, what, then=""):
        self.what, self.then = what, then

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is not None and not isinstance(e, SystemExit) and os_reason(e) is not None:
            then = self.then() if callable(self.then) else self.then  # a callable: decided when it failed
            raise SystemExit(f"cannot write {self.what}: {os_reason(e)}" + (f"; {then}" if then else "")) from None
        return False


def check_writable_file(flag, path):
    """Before any work: the file `path` can be written (its folder is created); else one sentence
    naming the flag."""
    existed = os.path.exists(path)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as e:
        raise SystemExit(f"{flag} {path}: cannot write there ({os_reason(e)})") from None
    if not existed:
        os.remove(path)


def model_path(text):
    """A model dir, or a Hugging Face hub id ("org/name"): a value that is written as a path
    (absolute, ./, ../, ~) must be an existing directory."""
    if text.startswith(("/", "./", "../", "~")) or os.sep * 2 in text or text in (".", ".."):
        path = os.path.expanduser(text)
        if not os.path.isdir(path):
            raise argparse.ArgumentTypeError(f"no such directory: {text}" if not os.path.exists(path)
                                             else f"not a directory: {text}")
        if not any(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "router_config.json")):
            raise argparse.ArgumentTypeError(f"{text} holds no config.json: not a Hugging Face model dir (nor a "
                                             "sentence-transformers Router dir: router_config.json)")
        return path
    return text


class Flag:
    """A flag a head declares in its module (heads/<kind>.py FLAGS = {dest: Flag(...)}), which cli.py adds
    to the parser of the head's family and cli.head_flags checks: `default`, what it holds when the head
    runs and it was not given; `name` and argparse's keywords (type, choices, action, help), or no name
    for a flag every tool of the family declares (cli.py) that only this head takes; `group`, the parser's
    group ("model" or "loss"); `neutral`, a resume may change it; `setting`, (settings key, {flag value:
    setting value}) where it overrides a setting the model dir declares."""

    def __init__(self, default=None, name=None, *, group="model", neutral=False, setting=None, **argparse_kw):
        self.default, self.name, self.group, self.neutral, self.setting = default, name, group, neutral, setting
        self.argparse = argparse_kw

"""Run a script (or a `python -m` module) in a process of its own, forked from a server that has
already imported torch, transformers and the kit: the same program, argv, environment, working
folder and exit status as `python script.py ...`, without the ~4 s of imports each launch pays on
this CPU (most of a tiny model's test run). tests/conftest.run_script uses it for one-process runs;
torchrun launches, kills and runs that change import-time settings (ATEN_CPU_CAPABILITY, thread
counts) still start a fresh interpreter.

The server is multiprocessing's forkserver: it imports PRELOAD once, single-threaded, then forks a
child per run; a child starts with no thread of the parent's and no state of a previous run.
"""

import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback

PRELOAD = ["torch", "transformers", "transformers.models.bert.modeling_bert",
           "transformers.models.llama.modeling_llama", "safetensors.torch", "torch.utils.tensorboard", "tqdm",
           "retrieval_kit.cli", "retrieval_kit.ckpt", "retrieval_kit.collate", "retrieval_kit.data",
           "retrieval_kit.dist", "retrieval_kit.evaluate", "retrieval_kit.export", "retrieval_kit.formats",
           "retrieval_kit.log", "retrieval_kit.loop", "retrieval_kit.losses", "retrieval_kit.metrics",
           "retrieval_kit.models", "retrieval_kit.optim", "retrieval_kit.precision", "retrieval_kit.records",
           "retrieval_kit.st_format", "tests.warm"]
SERVER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # what every warm run gets
_context = None


def _server():
    global _context
    if _context is None:
        saved = {k: os.environ.get(k) for k in SERVER_ENV}
        os.environ.update(SERVER_ENV)  # the server (and so every child) starts with these
        try:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            proc = ctx.Process(target=_noop)  # starts the server now, with this environment
            proc.start()
            proc.join()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _context = ctx
    return _context


def _noop():
    pass


def can_run(env):
    """A warm child inherits the server's import-time settings: only an environment that agrees
    with them (same thread counts, no kernel override) may run warm."""
    import_time = ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
                   "PYTORCH_", "TORCH_", "TRANSFORMERS_")
    for k, v in env.items():
        if k.startswith(import_time) and os.environ.get(k) != v and SERVER_ENV.get(k) != v:
            return False
    return True


def _child(kind, target, argv, env, cwd, out_path, err_path):
    multiprocessing.set_start_method(None, force=True)  # a fresh interpreter's default (fork on Linux), not ours
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.path.insert(0, os.path.dirname(target) if kind == "file" else cwd)
    sys.argv = [target] + list(argv)
    code = 0
    try:
        if kind == "file":
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # as the interpreter treats it: a message goes to stderr with status 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def run(kind, target, argv, env, cwd, timeout):
    """`python target argv...` (kind "file") or `python -m target argv...` (kind "module") in a warm
    child -> subprocess.CompletedProcess with its status, stdout and stderr."""
    ctx = _server()
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        proc = ctx.Process(target=_child, args=(kind, target, [str(a) for a in argv], dict(env), cwd, out_path,
                                                err_path))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired([target, *argv], timeout)
        with open(out_path, errors="replace") as f, open(err_path, errors="replace") as g:
            out, err = f.read(), g.read()
    return subprocess.CompletedProcess([target, *argv], proc.exitcode, out, err)

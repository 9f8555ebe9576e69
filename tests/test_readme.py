"""The README and docs/ say what the code does: docs/flags.md is what the parsers generate, every
command in a code block names a program that exists and only flags it accepts, every linked page
exists, the README stays short and its layout lists every module."""

import functools
import os
import re
import shlex

import pytest

from retrieval_kit import cli
from tests.conftest import python_run, ROOT

DOCS = [os.path.join(ROOT, "README.md")] + sorted(
    os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_flags_md_is_what_the_parsers_generate():
    assert read(os.path.join(ROOT, "docs", "flags.md")) == cli.flags_markdown(), \
        "docs/flags.md is stale: python -m retrieval_kit.cli > docs/flags.md"


def test_every_flag_of_both_scripts_is_in_flags_md():
    text = read(os.path.join(ROOT, "docs", "flags.md"))
    for parser in (cli.biencoder_parser(), cli.reranker_parser()):
        flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
        assert len(flags) > 30
        assert not sorted(f for f in flags if f"`{f}`" not in text)


def commands(text):
    """The shell commands in a page's ```bash blocks: continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                out += [c.strip() for c in re.split(r"&&|;|\|", line) if c.strip()]
    return out


def program(cmd):
    """(how to ask for --help, the tokens after the program) of a kit command, or None."""
    try:
        tokens = shlex.split(cmd)
    except ValueError:
        return None
    for i, t in enumerate(tokens):
        if t == "-m" and i + 1 < len(tokens) and tokens[i + 1].startswith("retrieval_kit."):
            return ("-m", tokens[i + 1]), tokens[i + 2:]
        if t.endswith(".py") and (t.startswith(("bench/", "scripts/")) or t in ("train_biencoder.py",
                                                                               "train_reranker.py")):
            return ("file", t), tokens[i + 1:]
    return None


@functools.lru_cache(maxsize=None)
def accepted_flags(kind, name):
    if name == "train_biencoder.py":
        parser = cli.biencoder_parser()
    elif name == "train_reranker.py":
        parser = cli.reranker_parser()
    else:
        cmd = (["-m", name] if kind == "-m" else [os.path.join(ROOT, name)]) + ["--help"]
        out = python_run(cmd, env=dict(os.environ, PYTHONPATH=ROOT, COLUMNS="10000"), timeout=120)
        assert out.returncode == 0, (name, out.stderr[-2000:])
        return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.stdout))
    return frozenset(o for a in parser._actions for o in a.option_strings)


@pytest.mark.slow
def test_every_command_in_the_docs_runs_a_program_that_exists_with_flags_it_accepts():
    checked, bad = 0, []
    for path in DOCS:
        for cmd in commands(read(path)):
            found = program(cmd)
            if found is None:
                continue
            (kind, name), rest = found
            where = f"{os.path.relpath(path, ROOT)}: {cmd[:80]}"
            if kind == "file" and not os.path.isfile(os.path.join(ROOT, name)):
                bad.append(f"{where}: no file {name}")
                continue
            if kind == "-m" and not os.path.isfile(os.path.join(ROOT, *name.split(".")) + ".py"):
                bad.append(f"{where}: no module {name}")
                continue
            flags = {t.split("=")[0] for t in rest if t.startswith("--")}
            unknown = sorted(flags - accepted_flags(kind, name))
            if unknown:
                bad.append(f"{where}: {name} has no {unknown}")
            for t in rest:  # the repo's own files a command reads
                if re.match(r"(data|bench|scripts|tests)/[\w./-]+$", t) and not os.path.exists(os.path.join(ROOT, t)):
                    bad.append(f"{where}: no such path {t}")
            checked += 1
    assert checked >= 20 and not bad, "\n".join(bad)


def test_ci_runs_the_readmes_two_commands_as_written():
    """CI can be green only where the README's two commands are: .ci/run holds each command line of the
    README's "Two commands" block, in order (and nothing installs an extra the README's line does not)."""
    block = re.search(r"## Two commands\n.*?```bash\n(.*?)```", read(os.path.join(ROOT, "README.md")), re.S).group(1)
    readme = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    ci = [line for line in read(os.path.join(ROOT, ".ci", "run")).splitlines()
          if line.strip() and not line.startswith("#")]
    assert len(readme) == 2 and "pip install" in readme[0] and readme[1].startswith("python -m pytest")
    run = [line for line in ci if line in readme]
    assert run == readme, (readme, ci)
    assert not [line for line in ci if "pip install" in line and line not in readme], ci


def test_links_point_at_files_that_exist():
    bad = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", read(path)):
            if not os.path.exists(os.path.join(os.path.dirname(path), target)):
                bad.append(f"{os.path.relpath(path, ROOT)}: {target}")
    assert not bad, bad


def test_the_readme_is_short_and_its_layout_lists_every_module():
    text = read(os.path.join(ROOT, "README.md"))
    assert len(text.splitlines()) <= 210  # (about 200: a user's page; history goes to docs/benchmarks.md)
    layout = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    modules = sorted(f for f in os.listdir(os.path.join(ROOT, "retrieval_kit")) if f.endswith(".py") and f != "__init__.py")
    assert not [m for m in modules if f"  {m}" not in layout]
    assert all(f"docs/{os.path.basename(p)}" in text for p in DOCS[1:] if not p.endswith("README.md"))


OTHER_TOOLS = {"--nproc_per_node", "--nnodes", "--node-rank", "--node_rank", "--standalone", "--max-restarts",
               "--rdzv-endpoint", "--rdzv-backend", "--rdzv-id", "--master-addr", "--master-port",  # torchrun
               "--no-deps", "--durations", "--logdir", "--record", "--check", "--extra", "--configs"}  # pip, pytest, tb, goldens


@pytest.mark.slow
def test_every_flag_the_docs_name_exists_somewhere():
    """A flag named in backticks in the README or docs is one of the scripts', the tools' or a bench
    script's (a renamed or removed flag does not linger in a table)."""
    known = set(OTHER_TOOLS)
    for kind, name in [("file", "train_biencoder.py"), ("file", "train_reranker.py"), ("-m", "retrieval_kit.evaluate"),
                       ("-m", "retrieval_kit.mine"), ("-m", "retrieval_kit.score"), ("-m", "retrieval_kit.plan"),
                       ("-m", "retrieval_kit.merge")] + [
            ("file", f"bench/{f}") for f in sorted(os.listdir(os.path.join(ROOT, "bench"))) if f.endswith(".py")
            and f != "__init__.py"]:
        known |= accepted_flags(kind, name)
    known |= {f"--no-{f[2:]}" for f in known}
    named = {(os.path.basename(p), f) for p in DOCS for span in re.findall(r"`([^`\n]+)`", read(p))
             for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", span)}
    bad = sorted(f"{page}: {f}" for page, f in named if f not in known)
    assert not bad, bad


def test_the_start_up_line_the_docs_show_is_what_a_run_prints(monkeypatch):
    from retrieval_kit.records import read_records

    monkeypatch.chdir(ROOT)
    shown = [line for line in read(os.path.join(ROOT, "docs", "data.md")).splitlines()
             if line.startswith("train: data/train.jsonl")]
    assert shown == ["train: " + read_records("data/train.jsonl", 2)[0].summary]

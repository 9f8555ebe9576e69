"""The house rules the layout promises (README, Layout), checked on the source itself: the library
takes values (only cli.py and the `main()` of the `python -m` tools read an argparse Namespace), no
test or bench imports a training script, no import cycle among the kit's modules (imports inside
functions counted), no private name imported across modules, one set of rank helpers (dist), each
script's main() short enough to read top to bottom; the layering (models and heads never import export,
models never st_format, losses never dist, encode never export), and the kind of model chosen once:
outside heads/ and cli.py no code compares against a kind's name or dispatches on a tensor's shape or
sparsity."""

import ast
import os

import pytest

from tests.conftest import ROOT

KIT = os.path.join(ROOT, "retrieval_kit")
HEADS = sorted(f"heads/{f[:-3]}" for f in os.listdir(os.path.join(KIT, "heads")) if f.endswith(".py")
               and f != "__init__.py")
MODULES = sorted(f[:-3] for f in os.listdir(KIT) if f.endswith(".py")) + ["heads"] + HEADS  # heads: its __init__


def tree(path):
    with open(path) as f:
        return ast.parse(f.read(), path)


def path_of(module):
    return os.path.join(KIT, "heads", "__init__.py") if module == "heads" else os.path.join(KIT, module + ".py")


def kit_imports(module):
    """(imported kit module, imported names) for every import in `module`, at any depth; a module of
    heads/ is named "heads/x", the package itself "heads"."""
    package = "heads" if module.startswith("heads") else ""  # what `from . import` names, from this module

    def name(dotted):  # "heads.sparse" -> "heads/sparse"; "models.X" -> "models"
        parts = dotted.split(".")
        return f"heads/{parts[1]}" if parts[0] == "heads" and len(parts) > 1 else parts[0]

    out = []
    for node in ast.walk(tree(path_of(module))):
        if isinstance(node, ast.ImportFrom):
            base = package if node.level == 1 else "" if node.level == 2 or (node.level == 1 and not package) else None
            if node.level and base is not None:
                dotted = ".".join(p for p in (base, node.module) if p)
                if node.module:  # from .x import a, b
                    out.append((name(dotted), [a.name for a in node.names]))
                else:  # from . import x, y
                    out += [(name(f"{dotted}.{a.name}" if dotted else a.name), []) for a in node.names]
            elif node.module and node.module.startswith("retrieval_kit."):
                out.append((name(node.module.split(".", 1)[1]), [a.name for a in node.names]))
            elif node.module == "retrieval_kit":
                out += [(name(a.name), []) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(name(a.name.split(".", 1)[1]), []) for a in node.names if a.name.startswith("retrieval_kit.")]
    return out


def find_cycle(graph):
    """One import cycle of `graph` ({module: {modules}}) as a list, or None."""
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n, path + [n])
                if found:
                    return found
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_no_import_cycle_among_the_kits_modules():
    graph = {m: {n for n, _ in kit_imports(m) if n in MODULES and n != m} for m in MODULES}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check can fail


def dynamic_imports(path):
    """Lines of `path` that load a module by name (importlib.import_module, __import__): an import edge the
    cycle check could not see."""
    return [f"{n.lineno}: {ast.unparse(n)[:60]}" for n in ast.walk(tree(path)) if isinstance(n, ast.Call)
            and ast.unparse(n.func) in ("importlib.import_module", "import_module", "__import__")]


def test_every_import_is_one_the_cycle_check_sees():
    """No module of the kit loads another by name: every edge is an import statement (at the top or in a
    function), so the cycle check above sees the whole graph; the registry imports its heads plain."""
    bad = {m: dynamic_imports(path_of(m)) for m in MODULES}
    assert not {m: lines for m, lines in bad.items() if lines}, bad
    probe = os.path.join(ROOT, "tests", "data", "dynamic_import_probe.txt")  # the check can fail
    assert dynamic_imports(probe) == ["1: importlib.import_module(f'retrieval_kit.heads.{name}')"]


def test_each_kind_owns_its_dir_st_format_imports_no_head_and_no_head_module_is_imported_outside_heads():
    """st_format holds what every kind shares and imports nothing of heads/ (each head reads and writes its
    own dir: read_dir, write_export); outside heads/ the kit reaches a head through the registry (heads.get,
    heads.default), never by importing its module."""
    imports = {m: {n for n, _ in kit_imports(m)} for m in MODULES}
    assert not {n for n in imports["st_format"] if n.startswith("heads")}, imports["st_format"]
    outside = {m: sorted(n for n in names if n.startswith("heads/")) for m, names in imports.items()
               if not m.startswith("heads")}
    assert not {m: names for m, names in outside.items() if names}, outside
    graph = {**imports, "st_format": imports["st_format"] | {"heads"}}  # the check can fail: the old edge back
    assert find_cycle({m: {n for n in names if n in MODULES and n != m} for m, names in graph.items()})


def test_no_private_name_is_imported_across_modules():
    bad = [(m, n, name) for m in MODULES for n, names in kit_imports(m) for name in names if name.startswith("_")]
    assert not bad, bad


def namespace_reads(path):
    """Lines where `args.X` or `vars(args)` is read outside a function named main."""
    out = []

    def walk(node, in_main):
        for child in ast.iter_child_nodes(node):
            inside = in_main or (isinstance(child, ast.FunctionDef) and child.name == "main")
            if isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name) and child.value.id == "args" \
                    and not inside:
                out.append(child.lineno)
            if isinstance(child, ast.Call) and getattr(child.func, "id", None) == "vars" and not inside:
                out.append(child.lineno)
            walk(child, inside)

    walk(tree(path), False)
    return out


def test_only_cli_and_the_entry_points_main_read_the_namespace():
    bad = {m: namespace_reads(path_of(m)) for m in MODULES if m != "cli"}
    assert not {m: lines for m, lines in bad.items() if lines}, bad


def test_no_test_or_bench_imports_a_training_script():
    """Tests run the scripts as programs (a subprocess, torchrun, or tests/warm.py's runpy as
    __main__), so their internals stay free to change."""
    bad = []
    for folder in ("tests", "bench"):
        for name in os.listdir(os.path.join(ROOT, folder)):
            if name.endswith(".py"):
                for node in ast.walk(tree(os.path.join(ROOT, folder, name))):
                    mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                        [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                    bad += [f"{folder}/{name}:{node.lineno}" for m in mods if m.startswith(("train_biencoder",
                                                                                           "train_reranker"))]
                    # importlib / runpy may load a module by name, but only run it as a program (__main__)
                    if isinstance(node, ast.Call) and ast.unparse(node.func) in (
                            "importlib.import_module", "import_module", "runpy.run_path", "runpy.run_module") and not any(
                            k.arg == "run_name" and getattr(k.value, "value", None) == "__main__" for k in node.keywords):
                        bad.append(f"{folder}/{name}:{node.lineno}: {ast.unparse(node)[:60]}")
    assert not bad, bad


def test_rank_and_world_size_are_read_in_dist_only():
    """One set of rank helpers: dist.rank / world_size / is_main / barrier; no other module asks
    torch.distributed for its rank, world size or a barrier itself."""
    bad = []
    for m in MODULES:
        if m == "dist":
            continue
        nodes = list(ast.walk(tree(path_of(m))))
        aliases = {"torch.distributed"} | {a.asname or a.name for n in nodes if isinstance(n, ast.Import)
                                           for a in n.names if a.name == "torch.distributed"}
        aliases |= {a.asname or a.name for n in nodes if isinstance(n, ast.ImportFrom) and n.module == "torch"
                    for a in n.names if a.name == "distributed"}
        for node in nodes:
            if isinstance(node, ast.Attribute) and node.attr in ("get_rank", "get_world_size", "barrier") \
                    and ast.unparse(node.value) in aliases:
                bad.append(f"{m}:{node.lineno} {ast.unparse(node)}")
    assert not bad, bad


@pytest.mark.parametrize("script", ["train_biencoder.py", "train_reranker.py"])
def test_each_scripts_main_reads_top_to_bottom_at_100_characters_a_line(script):
    """The recipe reads without scrolling sideways: main()'s lines at most 100 characters (its length is
    what the recipe needs, about 150 lines; named callbacks and a header dict keep each line one thought)."""
    path = os.path.join(ROOT, script)
    main = next(n for n in tree(path).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    lines = open(path).read().splitlines()[main.lineno - 1:main.end_lineno]
    assert not [f"{main.lineno + i}: {len(line)}" for i, line in enumerate(lines) if len(line) > 100]
    assert len(lines) <= 170


LAYERING = {  # module (or prefix) -> the kit modules it must not import, and why
    "models": ({"export", "st_format"}, "what a dir holds is read by st_format and passed in"),
    "heads": ({"export"}, "a head writes its own files; export writes the dir"),
    "losses": ({"dist"}, "losses are pure maths: the caller passes dist's gathers"),
    "encode": ({"export"}, "the reranker's layout lives in collate"),
}


def layering_violations(imports):
    """[(module, imported, why)] of `imports` ({module: {kit modules it imports}}) against LAYERING."""
    return [(m, n, why) for m, names in sorted(imports.items()) for rule, (banned, why) in LAYERING.items()
            if m == rule or m.startswith(rule + "/") for n in sorted(names & banned)]


def test_the_layering_rules_hold():
    imports = {m: {n for n, _ in kit_imports(m)} for m in MODULES}
    assert not layering_violations(imports)
    # the check fails on each broken direction (a reintroduced import, as the code read at 3df666c)
    for m, n in (("models", "st_format"), ("models", "export"), ("heads/sparse", "export"), ("losses", "dist"),
                 ("encode", "export")):
        assert layering_violations({**imports, m: imports[m] | {n}}) == [(m, n, LAYERING[m.split("/")[0]][1])]


def kind_comparisons(path):
    """Lines of `path` that name a kind: a string equal to a kind's name (heads.MODULES) anywhere in an
    expression (a comparison, a default, a dict key; docstrings aside), a head's module by its name
    (`single_vector`, `heads.multi_vector`), or that dispatch on a tensor's shape (`.dim() == k`) or sparsity
    (`.is_sparse`)."""
    from retrieval_kit.heads import MODULES as names

    modules = {m.__name__.rsplit(".", 1)[-1] for m in names.values()}
    root = tree(path)
    docs = {id(n.body[0].value) for n in ast.walk(root) if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = set()
    for node in ast.walk(root):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names \
                and id(node) not in docs:
            out.add((node.lineno, repr(node.value)))
        if isinstance(node, ast.Name) and node.id in modules or isinstance(node, ast.Attribute) and node.attr in modules:
            out.add((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            consts = [c for p in parts for c in ast.walk(p) if isinstance(c, ast.Constant)]
            if any(isinstance(p, ast.Call) and getattr(p.func, "attr", None) == "dim" for p in parts) and any(
                    c.value == 3 for c in consts):  # (token vectors: the multi-vector head's shape)
                out.add((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Attribute) and node.attr == "is_sparse":
            out.add((node.lineno, ast.unparse(node)))
    return [f"{line}: {what}" for line, what in sorted(out)]


def test_outside_heads_and_cli_nothing_branches_on_the_kind():
    files = [path_of(m) for m in MODULES if not m.startswith("heads") and m != "cli"]
    files += [os.path.join(ROOT, s) for s in ("train_biencoder.py", "train_reranker.py")]
    bad = {os.path.relpath(f, ROOT): kind_comparisons(f) for f in files}
    assert not {f: lines for f, lines in bad.items() if lines}, bad
    probe = os.path.join(ROOT, "tests", "data", "kind_branch_probe.txt")  # the check can fail
    assert kind_comparisons(probe) == ["1: 'sparse'", "1: sparse", "2: q.dim() == 3", "3: p.is_sparse", "4: 'multi-vector'",
                                       "5: single_vector", "6: heads.lm"]


def test_each_kinds_flags_are_declared_by_its_head_and_the_parsers_take_them_from_there():
    """A flag whose help says it is for one head ("--head sparse: ...") is that head's: declared in its
    module's FLAGS (heads/<kind>.py), not in cli.py, and in the parser exactly as the head declares it."""
    from retrieval_kit import cli, heads

    seen = 0
    for parser in (cli.biencoder_parser(), cli.reranker_parser()):
        for action in parser._actions:
            said = (action.help or "").split(":")[0].split(",")[0]
            if not said.startswith("--head "):
                continue
            names = said[len("--head "):].split(" or ")
            owned = [n for n in names if action.dest in heads.get(n).FLAGS]
            assert owned == names, f"{action.option_strings}: its help names {said!r}; FLAGS of {owned}"
            declared = heads.get(names[0]).FLAGS[action.dest]
            assert action.option_strings == [declared.name] and action.help == declared.argparse["help"]
            seen += 1
    assert seen >= 9  # (multi-vector 3, sparse 3, classifier 2, lm 2: none lost on the way)
    with open(os.path.join(KIT, "cli.py")) as f:
        assert '"--head ' not in f.read()  # (no head's flag help spelled in cli.py)

"""The dir fuzz (issue 49): every model dir the kit reads is validated as a whole. Each field of each
JSON file the kit reads in each layout - a sentence-transformers dir with a Dense, a MultiVectorEncoder,
a PyLate and a Stanford-NLP ColBERT dir, a SparseEncoder, the kit's own bi-encoder and reranker exports -
is mutated (a wrong type, a wrong value, missing), and whole files are broken, emptied, made a list or
removed, and the heads' weight files removed, cut short or replaced by another shape. Each mutated dir
is loaded as the tools load it (evaluate.load_biencoder / export.load_exported_reranker) and two texts
are encoded or scored: the outcome is a correct load or one sentence naming the dir (SystemExit, no
traceback). The suite runs every 8th mutation (quick tier); `python tests/errors/test_dir_fuzz.py` runs all."""

import copy
import json
import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a script
from tests.conftest import ROOT  # noqa: E402

VALUES = [None, "abc", -1, 0, [], {"a": 1}, True, 1e9, [None, 3]]  # each field gets these, and is removed
SMALL_JSON = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "config.json",
              "retrieval_kit.json", "artifact.metadata", "tokenizer_config.json")
KIT_READS_OF = {"config.json": ("hidden_size", "model_type", "architectures"),  # what the kit reads of HF files
                "tokenizer_config.json": ("model_max_length",)}


def build_dirs(root, tiny):
    """{name: (path, loader)} of every layout the kit reads, each from the tiny BERT."""
    from sentence_transformers import SentenceTransformer, models

    from retrieval_kit.export import export_model, export_reranker
    from retrieval_kit.heads import classifier, multi_vector, sparse
    from retrieval_kit.models import load_tokenizer
    from tests.heads.test_multi_vector_dirs import pylate_dir, stanford_dir

    out = {}
    torch.manual_seed(1)
    path = os.path.join(root, "st_dense")
    SentenceTransformer(modules=[models.Transformer(tiny), models.Pooling(32, "mean"), models.Dense(32, 16),
                                 models.Normalize()], device="cpu", prompts={"query": "query: "}).save(path)
    out["st_dense"] = path
    tok = load_tokenizer(tiny)
    base = {"kind": "biencoder", "pooling": "avg", "normalize": True, "query_prefix": "", "passage_prefix": "",
            "query_max_length": 16, "passage_max_length": 32, "include_prompt": True}
    mv = {**base, "head": "multi-vector", "query_expansion": {"attend": False, "token": None},
          "skiplist_words": [".", ","], "multi_vector_dim": 8}
    mv_model = multi_vector.load(tiny, multi_vector_dim=8, seed=0)
    out["kit_multi_vector"] = export_model(os.path.join(root, "kit_mv"), mv_model, tok,
                                           mv)
    out["multi_vector_encoder"] = os.path.join(root, "mve")  # the same files, no retrieval_kit.json
    shutil.copytree(out["kit_multi_vector"], out["multi_vector_encoder"])
    os.remove(os.path.join(out["multi_vector_encoder"], "retrieval_kit.json"))
    out["pylate"] = pylate_dir(tiny, os.path.join(root, "pylate"))
    out["stanford"] = stanford_dir(tiny, os.path.join(root, "stanford"))
    torch.manual_seed(2)
    out["kit_sparse"] = export_model(os.path.join(root, "kit_sparse"), sparse.load(tiny), tok, {**base, "head": "sparse"})
    out["sparse_encoder"] = os.path.join(root, "sparse")
    shutil.copytree(out["kit_sparse"], out["sparse_encoder"])
    os.remove(os.path.join(out["sparse_encoder"], "retrieval_kit.json"))
    torch.manual_seed(3)
    out["kit_reranker"] = os.path.join(root, "kit_rr")
    export_reranker(out["kit_reranker"], classifier.load(tiny), tok,
                    {"kind": "reranker", "head": "classifier", "pooling": "native", "prompt_template": "pair",
                     "rerank_max_length": 32, "append_eos": False, "padding_side": "right", "pad_to_multiple_of": 8})
    return out


def json_files(path):
    return sorted(os.path.relpath(os.path.join(r, f), path) for r, _, fs in os.walk(path) for f in fs
                  if f in SMALL_JSON or f == "config.json")


def mutations(path):
    """[(label, fn(dir))] for the dir at `path`: each field of each JSON file the kit reads, then whole files,
    then the heads' weight files."""
    out = []
    for rel in json_files(path):
        with open(os.path.join(path, rel)) as f:
            obj = json.load(f)
        name = os.path.basename(rel)
        if isinstance(obj, dict):
            keys = [k for k in obj if k in KIT_READS_OF.get(name, obj) and rel not in ("config.json",)] + [
                k for k in KIT_READS_OF.get("config.json") if rel == "config.json" and k in obj]
        else:  # modules.json: each entry's type and path
            keys = [(i, k) for i in range(len(obj)) for k in ("type", "path")]
        for key in keys:
            for value in VALUES + ["<removed>"]:
                out.append((f"{rel}:{key}={value!r}", _set(rel, key, value)))
        for label, text in (("broken", "{"), ("a list", "[]"), ("empty", "")):
            out.append((f"{rel}:{label}", _write(rel, text)))
        out.append((f"{rel}:removed", _remove(rel)))
    for rel in sorted(os.path.relpath(os.path.join(r, f), path) for r, _, fs in os.walk(path) for f in fs
                      if f == "model.safetensors" and r != path):  # a head's own weights (Dense, projection)
        out += [(f"{rel}:removed", _remove(rel)), (f"{rel}:cut short", _truncate(rel)),
                (f"{rel}:another shape", _reshape(rel))]
    return out


def _set(rel, key, value):
    def fn(d):
        p = os.path.join(d, rel)
        obj = json.load(open(p))
        target, k = (obj[key[0]], key[1]) if isinstance(key, tuple) else (obj, key)
        if value == "<removed>":
            target.pop(k, None)
        else:
            target[k] = copy.deepcopy(value)
        json.dump(obj, open(p, "w"))
    return fn


def _write(rel, text):
    def fn(d):
        open(os.path.join(d, rel), "w").write(text)
    return fn


def _remove(rel):
    def fn(d):
        os.remove(os.path.join(d, rel))
    return fn


def _truncate(rel):
    def fn(d):
        p = os.path.join(d, rel)
        data = open(p, "rb").read()
        open(p, "wb").write(data[:len(data) // 2])
    return fn


def _reshape(rel):
    def fn(d):
        from safetensors.torch import load_file, save_file

        p = os.path.join(d, rel)
        state = load_file(p)
        save_file({k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) for k, v in state.items()}, p)
    return fn


def copy_dir(src, dst):
    """The dir's small files copied, its big weight files linked (mutations copy what they change)."""
    for r, _, fs in os.walk(src):
        for f in fs:
            s, t = os.path.join(r, f), os.path.join(dst, os.path.relpath(os.path.join(r, f), src))
            os.makedirs(os.path.dirname(t), exist_ok=True)
            if os.path.getsize(s) > 1 << 20 and not (f == "model.safetensors" and r != src):
                os.symlink(s, t)
            else:
                shutil.copy(s, t)


def outcome(path):
    """"loaded" (two texts encoded or a pair scored) or "refused" (one sentence naming the dir); anything
    else raises (the traceback a user would see)."""
    from retrieval_kit.encode import encode_texts, score_pairs
    from retrieval_kit.evaluate import load_biencoder
    from retrieval_kit.export import load_exported_reranker
    from retrieval_kit.st_format import load_settings

    try:
        if load_settings(path).get("kind") == "reranker":
            model, tok, settings = load_exported_reranker(path)
            score_pairs(model, tok, ["a query"], ["a passage"], settings)
        else:
            model, tok, settings, head = load_biencoder(path)
            sides = head.sides(tok, settings)
            with torch.no_grad():
                encode_texts(model, tok, ["a query", "another, longer query."], settings["query_max_length"],
                             settings["query_prefix"], side=sides["q"], head=head, name="q")
                encode_texts(model, tok, ["a passage."], settings["passage_max_length"], settings["passage_prefix"],
                             side=sides["p"], head=head)
        return "loaded"
    except SystemExit as e:
        message = str(e.code)
        assert e.code not in (0, None) and message.strip(), message
        assert path in message or os.path.basename(path) in message, message  # it names the dir (or a file in it)
        return "refused"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_model_dir):
    return build_dirs(str(tmp_path_factory.mktemp("dirs")), tiny_model_dir)


LAYOUTS = ("st_dense", "multi_vector_encoder", "kit_multi_vector", "pylate", "stanford", "sparse_encoder",
           "kit_sparse", "kit_reranker")


def run_fuzz(dirs, layout, tmp_path, every):
    base = dirs[layout]
    assert outcome(base) == "loaded"
    seen = {"loaded": 0, "refused": 0}
    todo = mutations(base)
    for i, (label, mutate) in enumerate(todo):
        if i % every:
            continue
        d = str(tmp_path / f"m{i}")
        copy_dir(base, d)
        mutate(d)
        try:
            seen[outcome(d)] += 1
        except Exception as e:  # noqa: BLE001 - the finding: a traceback
            raise AssertionError(f"{layout}: {label}: {type(e).__name__}: {e}") from e
        shutil.rmtree(d)
    return len(todo), seen


SAMPLE = 8  # the suite runs every 8th mutation (244 of 1,952, ~15 s); `python tests/errors/test_dir_fuzz.py` runs them all


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mutated_dirs_load_or_are_one_sentence(dirs, layout, tmp_path):
    total, seen = run_fuzz(dirs, layout, tmp_path, every=SAMPLE)
    assert seen["refused"] > 0 and seen["loaded"] > 0 and sum(seen.values()) == -(-total // SAMPLE)


def test_the_fuzz_runs_at_least_200_mutated_dirs(dirs):
    assert sum(-(-len(mutations(dirs[k])) // SAMPLE) for k in LAYOUTS) >= 200


if __name__ == "__main__":  # every mutation, each layout's counts (the note of issue 49 quotes them)
    import contextlib
    import io
    import sys
    import tempfile
    from pathlib import Path

    from transformers import AutoTokenizer, BertModel

    from tests.conftest import minilm_dir, tiny_bert_config

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    tmp = tempfile.mkdtemp()
    tok = AutoTokenizer.from_pretrained(minilm_dir())
    tiny = os.path.join(tmp, "tiny")
    torch.manual_seed(0)
    BertModel(tiny_bert_config(len(tok))).save_pretrained(tiny)
    tok.save_pretrained(tiny)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        built = build_dirs(os.path.join(tmp, "dirs"), tiny)
        counts = {k: run_fuzz(built, k, Path(tmp) / k, every=1) for k in LAYOUTS}
    for k, (total, seen) in counts.items():
        print(f"{k}: {total} mutations, {seen['loaded']} loaded, {seen['refused']} refused in one sentence")
    print(f"all: {sum(t for t, _ in counts.values())} mutations, no traceback")

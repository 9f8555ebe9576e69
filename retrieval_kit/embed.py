"""Teacher embeddings written once: an embedding model's vector of every distinct query and passage of a
training file, which `train_biencoder.py --teacher-embeddings FILE` reads instead of running a teacher
beside the student at every step - for a teacher too large for that, or of another tokenizer.

    python -m retrieval_kit.embed --model TEACHER --input data/train.jsonl --out teacher.safetensors

The file (safetensors) holds "query_keys" / "passage_keys" (collate.text_keys of each text, the keys the
training batches carry) and "query" / "passage" (fp32, one vector a text, in the teacher's own prefixes and
lengths unless the flags say otherwise), with the teacher's dir, head and size in its metadata. It is
written as OUT.partial and renamed: a killed run leaves no file that looks complete.
"""

import os

import torch

from .collate import text_keys


def main(argv=None):
    import argparse

    from . import cli, flags, outputs, precision
    from .encode import encode_texts
    from .evaluate import load_biencoder
    from .formats import read_corpus
    from .models import default_model_dir
    from .records import read_records

    ap = cli.KitParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="training JSONL (any format the scripts read)")
    ap.add_argument("--corpus", default=None, help="BEIR corpus.jsonl where doc ids in --input resolve, as in training")
    ap.add_argument("--out", required=True, help="the safetensors file to write")
    ap.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    ap.add_argument("--model", type=flags.model_path, default=None,
                    help="the teacher: a bi-encoder dir of one vector a text (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--batch-size", type=flags.positive_int, default=64, help="texts per encoding batch")
    precision.add_inference_dtype(ap)
    cli.add_biencoder_setting_args(ap)
    args = ap.parse_args(argv)
    outputs.check_file("--out", args.out, [("--input", args.input), ("--corpus", args.corpus), ("--model", args.model)],
                       args.overwrite)
    corpus = read_corpus(args.corpus) if args.corpus else None
    records, _ = read_records(args.input, corpus=corpus)
    print(records.summary, flush=True)
    queries = list(dict.fromkeys(r.query for r in records))
    store = records.passages
    passages = list(dict.fromkeys(store[j] for j in range(len(store))))
    model_dir = args.model or default_model_dir()
    enc, tok, s, head = load_biencoder(model_dir, vars(args), compute_dtype=precision.parse_dtype(args.compute_dtype))
    cli.head_flags(args, head.NAME, f"{model_dir} (the model's)")
    vectors = {}
    for side, texts, length, prefix in (("query", queries, s["query_max_length"], s["query_prefix"]),
                                        ("passage", passages, s["passage_max_length"], s["passage_prefix"])):
        out = encode_texts(enc, tok, texts, length, prefix, args.batch_size, progress=True, desc=side, head=head,
                           name=side[0])
        if out.layout != torch.strided or out.dim() != 2:
            raise SystemExit(f"--model {model_dir}: a {head.NAME} model, whose texts are not one dense vector each; "
                             "embedding distillation regresses one vector a text: give a model of one vector")
        vectors[side], vectors[f"{side}_keys"] = out.float().contiguous(), text_keys(texts)
    meta = {"model": os.path.abspath(model_dir), "head": head.NAME, "size": str(vectors["query"].shape[1])}
    from safetensors.torch import save_file

    with flags.writing(f"the teacher embeddings to {args.out}"):
        save_file(vectors, args.out + ".partial", metadata=meta)
        os.replace(args.out + ".partial", args.out)
    print(f"wrote {len(queries)} queries and {len(passages)} passages x {meta['size']} ({head.NAME}, {model_dir}) to "
          f"{args.out}", flush=True)


class TeacherFile:
    """--teacher-embeddings: a file `main` wrote, as loop.with_guide's frozen teacher - `teacher(q_keys=...,
    p_keys=...)` -> {"q", "p"}: each text's vector, looked up by its key (on the keys' device)."""

    by_keys = True  # (loop.with_guide passes the batch's text keys, not its tokens)

    def __init__(self, path):
        from safetensors import safe_open
        from safetensors.torch import load_file

        if not os.path.isfile(path):
            raise SystemExit(f"--teacher-embeddings {path}: no such file (python -m retrieval_kit.embed writes one)")
        try:
            with safe_open(path, "pt") as f:
                self.meta = f.metadata() or {}
            tensors = load_file(path)
        except Exception as e:  # (a truncated or foreign file: safetensors' own error types)
            raise SystemExit(f"--teacher-embeddings {path}: cannot read it ({e}); write it again with python -m "
                             "retrieval_kit.embed") from None
        if not {"query", "query_keys", "passage", "passage_keys"} <= set(tensors) or "head" not in self.meta:
            raise SystemExit(f"--teacher-embeddings {path}: not a file python -m retrieval_kit.embed wrote")
        self.path, self.sides = path, {}
        for side in ("query", "passage"):
            keys, order = tensors[f"{side}_keys"].sort()
            self.sides[side] = (keys, tensors[side][order])

    def check(self, like, texts):
        """The trained model's (head, size) against the file's, and every training text in it: one sentence
        naming the file otherwise. `texts`: {"query": [...], "passage": [...]}."""
        head, size = self.meta["head"], int(self.sides["query"][1].shape[1])
        if head != like[0].NAME or size != like[1]:
            project = head == like[0].NAME and "dense_dim" in like[0].FLAGS
            raise SystemExit(f"--teacher-embeddings {self.path}: a {head} teacher's vectors of {size} dimensions, the "
                             f"trained model a {like[0].NAME} of {like[1]}; " +
                             (f"pass --dense-dim {size} (a Dense projection to its size, trained with the model)"
                              if project else "give a teacher of the same kind and size"))
        for side, items in texts.items():
            keys = text_keys(items)
            missing = ~self.found(side, keys)
            if missing.any():
                first = items[int(missing.nonzero()[0])]
                raise SystemExit(f"--teacher-embeddings {self.path}: {int(missing.sum())} of the training data's "
                                 f"{len(items)} {side} texts have no vector there (the first: {first[:80]!r}); write it "
                                 "from the same training files with python -m retrieval_kit.embed")
        return self

    def rows(self, side, keys):
        """The file's row of each key (its nearest where absent: check the keys with found)."""
        table = self.sides[side][0]
        return torch.searchsorted(table, keys.cpu()).clamp(max=len(table) - 1)

    def found(self, side, keys):
        return self.sides[side][0][self.rows(side, keys)] == keys

    def __call__(self, q_keys, p_keys, **_):
        return {name: self.sides[side][1][self.rows(side, keys)].to(keys.device)
                for name, side, keys in (("q", "query", q_keys), ("p", "passage", p_keys))}


def teacher_file(path, like, files):
    """--teacher-embeddings: (TeacherFile, None) checked against the trained model (`like`: (head, size)) and the
    training files' queries and passages, as evaluate.load_guide's (model, head) pair is used; None without."""
    if path is None:
        return None
    from .records import passage_pool

    queries = list(dict.fromkeys(r.query for f in files for r in f.records))
    return TeacherFile(path).check(like, {"query": queries, "passage": passage_pool(files)}), None


if __name__ == "__main__":
    from .rundir import exit_on_data_error

    exit_on_data_error(main)

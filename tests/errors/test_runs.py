"""No run is lost and every user error is a sentence: bad flags, used run folders, changed args on
resume, damaged checkpoints (fall back to the previous intact one), and random SIGKILLs until done
- each resumed run ends bitwise equal to an uninterrupted one."""

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from retrieval_kit import cli, datacache
from tests.conftest import python_run, ROOT

BAD_FLAGS = [  # (flag, value, what argparse must say)
    ("--batch-size", "0", "must be a positive integer, got 0"),
    ("--grad-accum-steps", "0", "must be a positive integer"),
    ("--grad-accum-steps", "-1", "must be a positive integer"),
    ("--log-every", "0", "must be a positive integer"),
    ("--val-every", "0", "must be a positive integer"),
    ("--val-batch-size", "0", "must be a positive integer"),
    ("--ckpt-every", "0", "must be a positive integer"),
    ("--max-steps", "0", "must be a positive integer"),
    ("--n-passages", "0", "must be a positive integer"),
    ("--num-workers", "-1", "must be 0 or more"),
    ("--keep-last", "-2", "must be 0 or more"),
    ("--lr", "0", "must be a positive number"),
    ("--lr", "nan", "must be a finite number"),
    ("--adam-eps", "0", "must be a positive number"),
    ("--adam-beta2", "1.0", "must be at least 0 and below 1"),
    ("--weight-decay", "-0.1", "must be 0 or more"),
    ("--warmup-steps", "-5", "must be 0 or more"),
    ("--seed", "-1", "must be 0 or more"),
    ("--batch-size", "two", "must be an integer, got 'two'"),
    ("--model", "/nonexistent/model", "no such directory: /nonexistent/model"),
]
SCRIPT_FLAGS = {"train_biencoder": [("--temperature", "0", "must be a positive number"),
                                    ("--temperature", "-1", "must be a positive number"),
                                    ("--query-max-length", "0", "must be a positive integer")],
                "train_reranker": [("--head-lr-mult", "0", "must be a positive number"),
                                   ("--rerank-max-length", "-3", "must be a positive integer")]}


@pytest.mark.parametrize("script", ["train_biencoder", "train_reranker"])
def test_every_nonsense_flag_is_one_argparse_line(script):
    parser = {"train_biencoder": cli.biencoder_parser, "train_reranker": cli.reranker_parser}[script]()
    for flag, value, said in BAD_FLAGS + SCRIPT_FLAGS[script]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
            cli.parse(parser, [flag, value])
        assert e.value.code == 2, (flag, value)
        assert f"argument {flag}: {said}" in err.getvalue(), (flag, value, err.getvalue())
        assert "Traceback" not in err.getvalue()


def run(script, args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    return python_run([os.path.join(ROOT, script)] + list(args), env=env, timeout=timeout)


def base_args(model_dir, train_file, out):
    return ["--model", model_dir, "--train-file", train_file, "--val-file", "", "--batch-size", "4",
            "--passage-max-length", "32", "--max-steps", "6", "--ckpt-every", "2", "--keep-last", "0",
            "--output-dir", str(out)]


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def one_sentence(out, *needles):
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    for n in needles:
        assert n in text, (n, text[-3000:])


RUN_SECONDS = []


@pytest.fixture(scope="module")
def finished(tiny_model_dir, small_train_file, tmp_path_factory):
    """An uninterrupted 6-step run, checkpoints at 2, 4, 6 kept: the reference."""
    out = tmp_path_factory.mktemp("runs") / "ref"
    t0 = time.perf_counter()
    # a fresh interpreter, as the chaos test's runs are (a warm one would skip the imports): its clock
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train_biencoder.py")] +
                          base_args(tiny_model_dir, small_train_file, out), cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    RUN_SECONDS.append(time.perf_counter() - t0)  # how long a whole run takes here: the chaos test's clock
    return out


@pytest.mark.slow
def test_a_used_folder_is_refused_changed_args_listed_and_overwrite_starts_over(finished, tiny_model_dir,
                                                                                small_train_file, tmp_path):
    folder = tmp_path / "used"
    shutil.copytree(finished, folder)
    args = base_args(tiny_model_dir, small_train_file, folder)
    one_sentence(run("train_biencoder.py", args), f"--output-dir {folder} already holds a run",
                 "continue it with --resume auto", "--overwrite-output-dir")
    one_sentence(run("train_biencoder.py", args + ["--resume", "auto", "--lr", "1e-4", "--seed", "3"]),
                 "was trained with other settings", "--lr: 5e-05 in the checkpoint, 0.0001 now",
                 "--seed: 42 in the checkpoint, 3 now", "--allow-changed-args")
    again = run("train_biencoder.py", args + ["--overwrite-output-dir", "--max-steps", "2"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(d for d in os.listdir(folder) if d.startswith("step_")) == ["step_000002"]
    rows = [json.loads(l) for l in open(folder / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]  # the old run's lines are gone


@pytest.mark.slow
def test_an_unwritable_output_dir_is_one_sentence(tiny_model_dir, small_train_file, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    one_sentence(run("train_biencoder.py", base_args(tiny_model_dir, small_train_file, blocker / "run")),
                 f"--output-dir {blocker / 'run'}: cannot write there")


def damage(ckpt_dir, how):
    p = lambda name: os.path.join(ckpt_dir, name)  # noqa: E731
    if how == "truncated weights":
        with open(p("model.safetensors"), "r+b") as f:
            f.truncate(os.path.getsize(p("model.safetensors")) // 2)
    elif how == "flipped bit in the weights":
        blob = bytearray(open(p("model.safetensors"), "rb").read())
        blob[-100] ^= 0x01
        open(p("model.safetensors"), "wb").write(bytes(blob))
    elif how == "no optimizer.pt":
        os.remove(p("optimizer.pt"))
    elif how == "truncated scheduler.pt":
        open(p("scheduler.pt"), "wb").write(open(p("scheduler.pt"), "rb").read()[:10])
    elif how == "no rng_rank0.pt":
        os.remove(p("rng_rank0.pt"))
    elif how == "garbage meta.json":
        open(p("meta.json"), "w").write("{not json")
    elif how == "empty meta.json":
        open(p("meta.json"), "w").write("")
    elif how == "meta.json says step 99":
        meta = json.load(open(p("meta.json")))
        json.dump(dict(meta, step=99), open(p("meta.json"), "w"))
    elif how == "meta.json without its loop state":
        meta = json.load(open(p("meta.json")))
        meta.pop("loop")
        json.dump(meta, open(p("meta.json"), "w"))
    return {"truncated weights": "model.safetensors: damaged", "flipped bit in the weights": "model.safetensors: damaged",
            "no optimizer.pt": "optimizer.pt: missing", "truncated scheduler.pt": "scheduler.pt: damaged",
            "no rng_rank0.pt": "rng_rank0.pt: missing", "garbage meta.json": "meta.json: unreadable",
            "empty meta.json": "meta.json: unreadable", "meta.json says step 99": "says step 99",
            "meta.json without its loop state": "meta.json: unreadable (KeyError: 'loop')"}[how]


DAMAGES = ["truncated weights", "flipped bit in the weights", "no optimizer.pt", "truncated scheduler.pt",
           "no rng_rank0.pt", "garbage meta.json", "empty meta.json", "meta.json says step 99",
           "meta.json without its loop state"]


@pytest.mark.slow
@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before(finished, tmp_path, how, capsys):
    from retrieval_kit import ckpt

    folder = tmp_path / "run"
    shutil.copytree(finished, folder)
    said = damage(str(folder / "step_000006"), how)
    assert ckpt.find_latest(str(folder)) == str(folder / "step_000004")
    out = capsys.readouterr().out
    assert f"warning: skipping checkpoint {folder / 'step_000006'}: " in out and said in out, out


@pytest.mark.slow
def test_resuming_past_a_damaged_checkpoint_ends_bitwise_equal(finished, tiny_model_dir, small_train_file, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(finished, folder)
    shutil.rmtree(folder / "final")
    damage(str(folder / "step_000006"), "truncated weights")
    damage(str(folder / "step_000004"), "no rng_rank0.pt")
    done = run("train_biencoder.py", base_args(tiny_model_dir, small_train_file, folder) + ["--resume", "auto"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {folder / 'step_000002'} at step 2" in done.stdout
    assert sha(folder / "final" / "model.safetensors") == sha(finished / "final" / "model.safetensors")
    rows = [json.loads(l) for l in open(folder / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # one line per step, the resumed ones once
    assert [r["loss"] for r in rows] == [json.loads(l)["loss"] for l in open(finished / "metrics.jsonl")]


@pytest.mark.slow
def test_chaos_random_sigkills_then_resume_until_done_is_bitwise_equal(finished, tiny_model_dir, small_train_file,
                                                                       tmp_path):
    """SIGKILL at random moments (model loading, steps, checkpoint writes, export), --resume auto
    each time, until a run exits 0: the final weights are the uninterrupted run's, bit for bit."""
    folder = tmp_path / "chaos"
    args = base_args(tiny_model_dir, small_train_file, folder)
    args[args.index("--ckpt-every") + 1] = "1"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    rng, kills, clock = random.Random(11), 0, RUN_SECONDS[0]
    for attempt in range(16):
        cmd = [sys.executable, os.path.join(ROOT, "train_biencoder.py")] + [str(a) for a in args] + \
            (["--resume", "auto"] if attempt else [])
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        t0 = time.perf_counter()
        try:
            out, err = proc.communicate(timeout=rng.uniform(0.3, 1.0) * clock if kills < 4 else 300)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
            kills += 1
            time.sleep(0.1)
            continue
        assert proc.returncode == 0, err[-3000:]
        if kills < 2:  # it ran faster than the reference run did (that one shared the CPU): start over on
            clock = min(clock, time.perf_counter() - t0)  # this run's own clock
            shutil.rmtree(folder)
            kills = 0
            continue
        break
    else:
        pytest.fail("the run never finished after 2 kills")
    assert kills >= 2, kills  # most draws land before the run's end
    assert not any(d.endswith(".partial") for d in os.listdir(folder))
    assert sha(folder / "final" / "model.safetensors") == sha(finished / "final" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE stands in for a full disk")
def small_disk(limit):
    """A preexec_fn: writes past `limit` bytes per file fail with EFBIG, as a full disk fails with ENOSPC."""
    import resource

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.parametrize("limit,extra,says", [
    (3_000_000, [], "cannot write the step 2 checkpoint in {r}: File too large"),  # model.safetensors (4 MB)
    (6_000_000, [], "cannot write the step 2 checkpoint in {r}: the file could not be written whole"),  # torch.save
    (1_000_000, ["--lora-rank", "4"], "cannot write the model to {r}/final: File too large"),  # the export
])
def test_a_full_disk_is_one_sentence_and_keeps_the_checkpoints(limit, extra, says, tiny_model_dir, small_train_file,
                                                               tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    args = base_args(tiny_model_dir, small_train_file, tmp_path / "r") + extra
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train_biencoder.py")] + args, cwd=ROOT, env=env,
                         preexec_fn=small_disk(limit), capture_output=True, text=True, timeout=300)
    one_sentence(out, says.format(r=tmp_path / "r"), "--resume auto")
    if extra:  # the export failed after the last checkpoint: a resume writes it, and nothing else
        again = run("train_biencoder.py", args + ["--resume", "auto"])
        assert again.returncode == 0 and (tmp_path / "r" / "final" / "model.safetensors").exists(), again.stderr[-2000:]
    else:
        assert "the newest intact checkpoint is none" in out.stderr


@pytest.mark.slow
def test_a_model_dir_that_does_not_load_is_one_sentence(tmp_path):
    from retrieval_kit.heads.classifier import load as load_reranker
    from retrieval_kit.models import load_encoder, load_tokenizer

    (tmp_path / "config.json").write_text('{"model_type": "bert"}')  # a config, no weights, no tokenizer
    for load, what in ((load_encoder, "model"), (load_reranker, "model"), (load_tokenizer, "tokenizer")):
        with pytest.raises(SystemExit, match=rf"{tmp_path}: cannot load the {what} \(.+\)"):
            load(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(SystemExit, match="cannot load the model .*does not recognize this architecture"):
        load_encoder(str(tmp_path))


@pytest.mark.parametrize("typed,says", [
    ("--learning_rate", "the kit's flag is --lr"), ("--per_device_train_batch_size", "the kit's flag is --batch-size"),
    ("--num_train_epochs", "the kit's flag is --max-steps"), ("--gradient_accumulation_steps", "--grad-accum-steps"),
    ("--warmup_steps", "the kit's flag is --warmup-steps"), ("--output_dir", "the kit's flag is --output-dir"),
    ("--bf16", "--compute-dtype bf16"), ("--tempreature", "did you mean --temperature?"),
])
def test_an_unknown_flag_names_the_kits_own(typed, says, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse(cli.biencoder_parser(), [typed, "1"] if typed != "--bf16" else [typed])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"  {typed}: " in err and says in err and "unrecognized arguments" in err, err
    assert len(err.splitlines()) <= 4  # the message and its hint, not the usage block


def test_every_flag_shows_its_default_in_help():
    """A flag with a default states it in its help ('default ...'); a switch that is off by default
    needs no word."""
    for parser in (cli.biencoder_parser(), cli.reranker_parser()):
        silent = [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"
                  and not (a.default is None or a.default is False) and "default" not in (a.help or "")]
        assert not silent, silent


@pytest.mark.slow
def test_a_resume_refuses_changed_data_or_model_and_applies_a_changed_lr(tiny_model_dir, no_dropout_dir,
                                                                         small_train_file, tmp_path):
    data = tmp_path / "train.jsonl"
    shutil.copy(small_train_file, data)
    ref, cache = tmp_path / "ref", tmp_path / "cache"
    args = base_args(tiny_model_dir, data, ref)[:-2] + ["--data-cache", cache]  # without --output-dir
    done = run("train_biencoder.py", args + ["--max-steps", "4", "--warmup-steps", "1", "--output-dir", ref])
    assert done.returncode == 0, done.stderr[-3000:]
    entry = os.path.basename(datacache.entry_path(str(data), str(cache)))
    assert sorted(os.listdir(cache)) == [entry, entry + ".lock"]
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(reversed(lines)))  # regenerated: the same path, size and record count, other content
    changed = run("train_biencoder.py", args + ["--max-steps", "6", "--warmup-steps", "1", "--resume", "auto",
                                                "--output-dir", ref])
    one_sentence(changed, "was trained with other settings", "the training files", "'digest'")
    assert "is stale: its source changed" in changed.stderr  # the cache was not trusted: its digest is new
    data.write_text("".join(lines))
    other = base_args(no_dropout_dir, data, ref)[:-2]
    one_sentence(run("train_biencoder.py", other + ["--max-steps", "6", "--warmup-steps", "1", "--resume", "auto",
                                                    "--allow-changed-args", "--output-dir", ref]),
                 f"was trained from --model {tiny_model_dir}", "start a new run")
    # --allow-changed-args --lr: the resumed steps train at the new peak LR, on the same schedule
    again = run("train_biencoder.py", args + ["--max-steps", "4", "--warmup-steps", "1", "--lr", "1e-3",
                                              "--resume", str(ref / "step_000002"), "--allow-changed-args",
                                              "--output-dir", tmp_path / "again"])
    assert again.returncode == 0 and "warning: --allow-changed-args: --lr" in again.stdout, again.stderr[-3000:]
    old = {r["step"]: r["lr"] for r in map(json.loads, open(ref / "metrics.jsonl")) if r["split"] == "train"}
    new = {r["step"]: r["lr"] for r in map(json.loads, open(tmp_path / "again" / "metrics.jsonl"))
           if r["split"] == "train"}
    assert sorted(new) == [3, 4] and all(abs(new[s] / old[s] - 1e-3 / 5e-5) < 1e-9 for s in (3, 4)), (old, new)


@pytest.mark.slow
def test_select_best_exports_the_best_validated_step_keeps_its_checkpoint_and_resumes(tiny_model_dir,
                                                                                      small_train_file, tmp_path):
    import torch
    from safetensors.torch import load_file

    def args(out, steps, *extra):  # a high constant LR: validation gets worse after the base model's
        return ["--model", tiny_model_dir, "--train-file", small_train_file, "--val-file",
                os.path.join(ROOT, "data", "val.jsonl"), "--val-max-groups", "32", "--batch-size", "4",
                "--passage-max-length", "32", "--max-steps", str(steps), "--val-every", "2", "--ckpt-every", "4",
                "--keep-last", "1", "--lr", "0.05", "--lr-schedule", "constant", "--warmup-steps", "0",
                "--select-best", "val/loss", "--output-dir", str(out), *extra]
    whole = tmp_path / "whole"
    done = run("train_biencoder.py", args(whole, 8))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(l) for l in open(whole / "metrics.jsonl")]
    val = {r["step"]: r["loss"] for r in rows if r["split"] == "val"}
    best = min(val, key=val.get)
    selected = json.loads((whole / "final" / "retrieval_kit.json").read_text())["selected"]
    assert selected == {"metric": "val/loss", "value": val[best], "step": best}, (selected, val)
    assert f"--select-best val/loss: the export holds step {best}" in done.stdout
    kept = sorted(d for d in os.listdir(whole) if d.startswith("step_"))
    assert kept == sorted({f"step_{best:06d}", "step_000008"})  # the best kept whatever --keep-last 1 says
    final, at_best = load_file(whole / "final" / "model.safetensors"), load_file(whole / kept[0] / "model.safetensors")
    assert all(torch.equal(final[k], at_best[k]) for k in at_best)
    # the best so far is part of the loop state: a run stopped at step 4 and resumed selects the same
    split = tmp_path / "split"
    assert run("train_biencoder.py", args(split, 4)).returncode == 0
    again = run("train_biencoder.py", args(split, 8, "--resume", "auto"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((split / "final" / "retrieval_kit.json").read_text())["selected"] == selected
    other = load_file(split / "final" / "model.safetensors")
    assert all(torch.equal(final[k], other[k]) for k in final)


@pytest.mark.slow
def test_dev_queries_are_scored_at_each_validation_as_evaluate_scores_the_held_out_set(tiny_model_dir, tmp_path):
    from retrieval_kit.data import TrainFile
    from retrieval_kit.records import hold_out_dev, read_records

    out = tmp_path / "run"
    train = os.path.join(ROOT, "data", "train.jsonl")
    done = run("train_biencoder.py", ["--model", tiny_model_dir, "--train-file", train, "--val-file", "",
                                      "--batch-size", "8", "--passage-max-length", "32", "--max-steps", "4",
                                      "--warmup-steps", "1", "--val-every", "2", "--dev-queries", "40",
                                      "--dev-corpus-size", "400", "--select-best", "dev/ndcg@10", "--output-dir", out])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dev: 40 training records held out (seed 42): 40 queries over 400 passages" in done.stdout
    header = json.loads((out / "run_header.json").read_text())
    assert header["n_train"] == 2975 - 40
    rows = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert sorted(r["step"] for r in rows if r["split"] == "dev") == [0, 2, 4]
    # the same held-out set as a BEIR folder, scored by retrieval_kit.evaluate on the export (the best step's weights)
    records, _ = read_records(train, 2)
    ids, texts, queries, qrels = hold_out_dev([TrainFile(records)], 40, 400, seed=42)[1]
    added = json.loads((out / "dev_neighbours.json").read_text())["passages"]  # (--dev-neighbours, mined at the start)
    assert 0 < len(added) <= 40 * 10 and not set(added) & set(texts)
    dev = (ids + [f"d{len(ids) + i}" for i in range(len(added))], texts + added, queries, qrels)
    assert f"dev: {len(added):,} passages added to the 400 of its corpus" in done.stdout
    beir = write_beir(tmp_path / "dev", dev)
    res = python_run(["-m", "retrieval_kit.evaluate", "--model", out / "final", "--beir", beir, "--output",
                      tmp_path / "eval.json", "--batch-size", 32])  # batched as validation was: the same sums
    assert res.returncode == 0, res.stderr[-3000:]
    selected = json.loads((out / "final" / "retrieval_kit.json").read_text())["selected"]
    got = json.loads((tmp_path / "eval.json").read_text())["biencoder"]["ndcg@10"]
    assert abs(got - selected["value"]) < 1e-6, (got, selected)


def write_beir(folder, dev):
    """A hold_out_dev set as a BEIR folder (corpus.jsonl, queries.jsonl, qrels/test.tsv)."""
    ids, texts, queries, qrels = dev
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": i, "text": t}) + "\n" for i, t in zip(ids, texts)))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in queries.items()))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{q}\t{d}\t1\n" for q, rel in qrels.items() for d in rel))
    return folder


@pytest.mark.slow
def test_the_rerankers_dev_metric_is_the_pipelines_and_its_best_fusion_reaches_evaluate(tiny_model_dir, tmp_path):
    from retrieval_kit.data import TrainFile
    from retrieval_kit.export import export_model
    from retrieval_kit.models import load_encoder, load_tokenizer
    from retrieval_kit.records import hold_out_dev, read_records

    bi = export_model(str(tmp_path / "bi"), load_encoder(tiny_model_dir), load_tokenizer(tiny_model_dir),
                      {"kind": "biencoder", "pooling": "avg", "normalize": True, "query_prefix": "",
                       "passage_prefix": "", "query_max_length": 32, "passage_max_length": 32})
    out, train = tmp_path / "rr", os.path.join(ROOT, "data", "train.jsonl")
    done = run("train_reranker.py", ["--model", tiny_model_dir, "--train-file", train, "--val-file", "", "--batch-size",
                                     "4", "--n-passages", "2", "--rerank-max-length", "64", "--max-steps", "4",
                                     "--warmup-steps", "1", "--val-every", "2", "--dev-queries", "30",
                                     "--dev-corpus-size", "300", "--dev-biencoder", bi, "--dev-neighbours", "0",
                                     "--output-dir", out])
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(l) for l in open(out / "metrics.jsonl")]
    for split in ("dev", "dev_fused", "dev_best"):
        assert sorted(r["step"] for r in rows if r["split"] == split) == [0, 2, 4], split
    fusion = json.loads((out / "final" / "retrieval_kit.json").read_text())["fusion"]
    last = [r for r in rows if r["split"] == "dev_best"][-1]
    assert fusion["grid_best"] == {"weight": last["weight"], "top_k": last["top_k"], "ndcg@10": last["ndcg@10"]}
    chosen = [c for c in fusion["candidates"] if "chosen" in c]  # (issue 62: the paired test's choice, said)
    assert len(chosen) == 1 and chosen[0]["name"] == f"weight {fusion['weight']:g}, top {fusion['top_k']}"
    assert abs(chosen[0]["dev"] - fusion["ndcg@10"]) < 1e-9 and len(fusion["candidates"]) == 15
    assert f"dev: fusion weight {fusion['weight']:g}, top {fusion['top_k']}" in done.stdout
    # the same pipeline by retrieval_kit.evaluate on the dev set as a BEIR folder: the export's fusion, the same number
    records, _ = read_records(train, 2)
    beir = write_beir(tmp_path / "dev", hold_out_dev([TrainFile(records)], 30, 300, seed=42)[1])
    res = python_run(["-m", "retrieval_kit.evaluate", "--model", bi, "--reranker", out / "final", "--beir", beir,
                      "--k", "20", "--output", tmp_path / "eval.json", "--batch-size", 16])  # as validation batched
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"fusion weight {fusion['weight']:g}, top {fusion['top_k']}, as chosen on its dev set" in res.stdout
    got = json.loads((tmp_path / "eval.json").read_text())[f"biencoder+reranker@{fusion['top_k']}"]["ndcg@10"]
    assert abs(got - fusion["ndcg@10"]) < 1e-6, (got, fusion)


@pytest.mark.slow
def test_select_best_under_fsdp2_exports_the_best_steps_weights(tiny_model_dir, small_train_file, tmp_path):
    import torch
    from safetensors.torch import load_file

    from tests.conftest import run_script

    out = tmp_path / "run"
    run_script("train_biencoder.py", ["--model", tiny_model_dir, "--train-file", small_train_file, "--val-file",
                                      os.path.join(ROOT, "data", "val.jsonl"), "--val-max-groups", 32, "--batch-size", 4,
                                      "--passage-max-length", 32, "--max-steps", 6, "--val-every", 2, "--ckpt-every", 100,
                                      "--lr", 0.05, "--lr-schedule", "constant", "--warmup-steps", 0, "--select-best",
                                      "val/loss", "--parallel", "fsdp2", "--output-dir", out], nproc=2)
    best = json.loads((out / "final" / "retrieval_kit.json").read_text())["selected"]["step"]
    final, at_best = load_file(out / "final" / "model.safetensors"), load_file(out / f"step_{best:06d}" / "model.safetensors")
    assert all(torch.equal(final[k], at_best[k]) for k in at_best)
    if best != 6:  # the last step's weights were trained on: the export is not them
        last = load_file(out / "step_000006" / "model.safetensors")
        assert any(not torch.equal(final[k], last[k]) for k in last)

"""Issue 62: the numbers a choice rests on, against hand computations on fixed tables - the bootstrap
standard error against the plug-in formula, the paired randomization test's exact p-values (all sign
patterns) and its seeded Monte-Carlo estimate, the paired bootstrap's deficit bound against the binomial
law - and the rule (retrieval_kit/choice.py): the best kept when the dev set cannot tell candidates apart or
cannot show a closer one within the margin, the closest to the base shown within it otherwise, a candidate
that loses the guard never chosen while another holds it."""

import itertools
import math

import pytest

from retrieval_kit import choice
from retrieval_kit.choice import choose
from retrieval_kit.metrics import bootstrap_se, deficit_bound, paired_p, retrieval_metrics


def test_the_paired_test_is_the_share_of_sign_patterns_at_least_as_extreme():
    assert paired_p([1, 1, 1, 1], [0, 0, 0, 0]) == 1 / 16  # only all signs kept reach the mean of 1
    assert paired_p([1, 0], [0, 1]) == 3 / 4  # differences (1, -1): patterns ++ (0), +- (1), -- (0) reach 0
    assert paired_p([0.5, 0.2, 0.9], [0.5, 0.2, 0.9]) == 1.0  # no difference at all: nothing to see
    # differences 0.3, 0.1, -0.1: means of the 8 patterns, hand-listed; 0.1 is reached by ++-, +++, +-+
    d = [0.3, 0.1, -0.1]
    means = [sum(s * x for s, x in zip(signs, d)) / 3 for signs in itertools.product((1, -1), repeat=3)]
    assert paired_p([0.3, 0.1, 0.0], [0.0, 0.0, 0.1]) == sum(m >= 0.1 - 1e-12 for m in means) / 8 == 3 / 8


def test_the_monte_carlo_test_estimates_the_exact_one():
    better = [0.9, 0.8, 0.7, 0.6, 1.0, 0.5, 0.4, 0.9, 0.3, 0.8, 0.7, 0.2, 0.6, 0.9, 0.5, 0.8, 0.7, 0.6, 0.9, 0.4]
    worse = [0.8, 0.8, 0.5, 0.7, 0.9, 0.6, 0.2, 0.9, 0.3, 0.6, 0.8, 0.1, 0.6, 0.7, 0.5, 0.9, 0.5, 0.6, 0.8, 0.5]
    d = [a - b for a, b in zip(better, worse)]
    observed = sum(d) / len(d)
    exact = sum(sum(s * x for s, x in zip(signs, d)) / len(d) >= observed - 1e-12
                for signs in itertools.product((1, -1), repeat=len(d))) / 2 ** len(d)
    got = paired_p(better, worse)  # 20 queries: 10,000 seeded draws
    assert abs(got - exact) < 0.01, (got, exact)
    assert got == paired_p(better, worse)  # seeded: the same every time


def test_the_bootstrap_error_is_the_plug_in_standard_error():
    x = [((7 * i) % 11) / 10 for i in range(60)]
    m = sum(x) / len(x)
    plug_in = math.sqrt(sum((v - m) ** 2 for v in x) / len(x) / len(x))
    assert abs(bootstrap_se(x) - plug_in) / plug_in < 0.05
    assert bootstrap_se(x) == bootstrap_se(x) and bootstrap_se([0.5]) == 0.0


def test_the_deficit_bound_is_the_quantile_of_the_paired_bootstrap():
    # a constant difference: every resample's mean is it
    assert deficit_bound([0.9] * 10, [0.8] * 10) == pytest.approx(0.1)
    # one query of 30 differs by c: a resample's mean is c * k / 30, k ~ Binomial(30, 1/30) draws of that query;
    # P(k <= 2) = 0.923 < 0.95 < P(k <= 3) = 0.983 (by hand below), so the 95% bound is 3c / 30
    cdf = [sum(math.comb(30, j) * (1 / 30) ** j * (29 / 30) ** (30 - j) for j in range(k + 1)) for k in range(5)]
    assert cdf[2] < 0.94 and cdf[3] > 0.96
    assert deficit_bound([0.9] * 30, [0.9] * 29 + [0.8]) == pytest.approx(3 * 0.1 / 30)
    assert deficit_bound([0.9] * 30, [0.9] * 29 + [0.8], level=0.5) == pytest.approx(0.1 / 30)  # the median: k = 1
    assert deficit_bound([0.5], [0.5]) == 0.0 and deficit_bound([], []) == 0.0


def test_retrieval_metrics_give_each_querys_values():
    run = {"q1": {"a": 2.0, "b": 1.0}, "q2": {"a": 2.0, "b": 1.0}}
    qrels = {"q1": {"a": 1}, "q2": {"b": 1}}
    each = {}
    means = retrieval_metrics(run, qrels, per_query=each)
    assert each["q1"]["ndcg@10"] == 1.0 and each["q2"]["ndcg@10"] == pytest.approx(1 / math.log2(3))
    assert means["ndcg@10"] == pytest.approx((1 + 1 / math.log2(3)) / 2)


# 30 queries: the best candidate (index 2) is ahead of candidate 0 on every query; of NEAR on two, by 0.3 each
# (2 points on the mean: not significantly, p 1/4, but nothing shows it within 0.5 points); of CLOSE on one by 0.02
WORST = [0.5] * 30
NEAR = [0.9] * 28 + [0.6, 0.6]
CLOSE = [0.9] * 29 + [0.88]
BEST = [0.9] * 30


def test_the_closest_candidate_shown_within_the_margin_of_the_best_is_kept():
    chosen, rows = choose([{"name": 0.2, "dev": WORST}, {"name": 0.6, "dev": CLOSE}, {"name": 1.0, "dev": BEST}])
    assert chosen == 1 and rows[0]["p_worse_than_best"] < 0.05 <= rows[1]["p_worse_than_best"]
    assert rows[1]["deficit_bound"] == pytest.approx(3 * 0.02 / 30)  # (the bound's test above)
    assert "the closest to the base that the dev set shows within 0.005 of the best (1.0" in rows[1]["chosen"]
    assert rows[2]["dev"] == pytest.approx(0.9) and rows[2]["dev_se"] < 1e-12
    # a margin below its bound: the best is kept, and the words say why
    chosen, rows = choose([{"name": 0.2, "dev": WORST}, {"name": 0.6, "dev": CLOSE}, {"name": 1.0, "dev": BEST}],
                          margin=0.001)
    assert chosen == 2 and "no candidate closer to the base is shown within 0.001" in rows[2]["chosen"]


def test_not_significantly_worse_is_not_enough_to_give_up_dev():
    # NEAR is not significantly worse (p 1/4 on two queries) but may be 4 points worse: the best is kept
    chosen, rows = choose([{"name": 0.2, "dev": WORST}, {"name": 0.6, "dev": NEAR}, {"name": 1.0, "dev": BEST}])
    assert chosen == 2 and rows[1]["p_worse_than_best"] >= 0.05 and rows[1]["deficit_bound"] > 0.005
    assert "no candidate closer to the base is shown within 0.005" in rows[2]["chosen"]


def test_candidates_the_dev_set_cannot_tell_apart_keep_the_best_and_say_so():
    chosen, rows = choose([{"name": 0.2, "dev": NEAR}, {"name": 1.0, "dev": BEST}])
    assert chosen == 1 and "cannot tell these candidates apart" in rows[1]["chosen"]


def test_a_candidate_that_loses_the_guard_is_not_chosen_while_another_holds_it():
    guard_base = [0.7] * 20 + [0.6] * 20
    lost = [0.4] * 40  # far below the base on the other domain
    kept = [0.7] * 20 + [0.6] * 20
    chosen, rows = choose([{"name": 0.2, "dev": WORST, "guard": kept}, {"name": 0.6, "dev": NEAR, "guard": kept},
                           {"name": 1.0, "dev": BEST, "guard": lost}], guard_base=guard_base)
    assert chosen == 1 and not rows[2]["guard_ok"] and rows[1]["guard_ok"]
    assert "the guard keeps 2 of 3" in rows[1]["chosen"]
    # without the guard the same dev table keeps the best-scoring one
    assert choose([{"name": 0.6, "dev": NEAR}, {"name": 1.0, "dev": BEST}])[0] == 1
    # a guard that every candidate loses: the one that loses least
    chosen, rows = choose([{"name": 0.6, "dev": NEAR, "guard": [0.5] * 40}, {"name": 1.0, "dev": BEST, "guard": lost}],
                          guard_base=guard_base)
    assert chosen == 0 and "the only candidate the guard leaves" in rows[0]["chosen"]


# ----- the rule in the merge tool and in a run ------------------------------------------------------------------

def top1(model_dir, beir):
    """{qid: the doc the model ranks first} (the kit's retrieval)."""
    from retrieval_kit.evaluate import load_biencoder, retrieve
    from retrieval_kit.metrics import rank_docs

    model, tok, settings, _ = load_biencoder(model_dir)
    return {q: rank_docs(r)[0] for q, r in retrieve(model, tok, settings, beir).items()}


def beir_with_qrels(folder, beir, qrels):
    import json
    import os

    ids, texts, queries, _ = beir
    os.makedirs(os.path.join(folder, "qrels"))
    with open(os.path.join(folder, "corpus.jsonl"), "w") as f:
        f.writelines(json.dumps({"_id": i, "title": "", "text": t}) + "\n" for i, t in zip(ids, texts))
    with open(os.path.join(folder, "queries.jsonl"), "w") as f:
        f.writelines(json.dumps({"_id": q, "text": queries[q]}) + "\n" for q in qrels)
    with open(os.path.join(folder, "qrels", "test.tsv"), "w") as f:
        f.write("query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t1\n" for q, d in qrels.items()))
    return str(folder)


@pytest.mark.slow
def test_the_guard_changes_the_merge_tools_choice_and_the_record_says_why(tiny_model_dir, small_train_file,
                                                                           small_beir, tmp_path):
    """A set built to need the guard: dev judges each query's document the tuned model ranks first (and the base
    does not), the guard the one the base ranks first (and the tuned model does not). Without the guard alpha
    1 wins on dev; with it, alpha 1 loses the guard and is not chosen; the record says so."""
    import json

    from retrieval_kit.evaluate import load_beir
    from tests.conftest import run_module, run_script

    run_script("train_biencoder.py", ["--model", tiny_model_dir, "--train-file", small_train_file, "--val-file", "",
                                      "--batch-size", 4, "--max-steps", 3, "--lr", 5e-2, "--query-max-length", 8,
                                      "--passage-max-length", 32, "--output-dir", tmp_path / "run"])
    tuned, beir = str(tmp_path / "run" / "final"), load_beir(small_beir)
    base_top, tuned_top = top1(tiny_model_dir, beir), top1(tuned, beir)
    moved = [q for q in base_top if base_top[q] != tuned_top[q]]
    assert len(moved) >= 8, "the tuned model must rank differently from the base"
    dev = beir_with_qrels(tmp_path / "dev", beir, {q: tuned_top[q] for q in moved})
    guard = beir_with_qrels(tmp_path / "guard", beir, {q: base_top[q] for q in moved})
    common = ["-m", "retrieval_kit.merge", "--base", tiny_model_dir, "--tuned", tuned, "--alpha", "0.5,1",
              "--dev-beir", dev]
    run_module([*common, "--out", tmp_path / "plain"])
    run_module([*common, "--guard-beir", guard, "--out", tmp_path / "guarded"])
    plain = json.load(open(tmp_path / "plain" / "retrieval_kit.json"))["merge"]
    guarded = json.load(open(tmp_path / "guarded" / "retrieval_kit.json"))["merge"]
    assert plain["alpha"] == 1.0 and plain["candidates"][1]["dev"]["ndcg@10"] == 1.0
    assert guarded["alpha"] != 1.0
    last = guarded["candidates"][-1]
    assert last["alpha"] == 1.0 and last["choice"]["guard_ok"] is False and last["choice"]["guard"] < 0.5
    said = next(c["choice"]["chosen"] for c in guarded["candidates"] if c["alpha"] == guarded["alpha"])
    assert "guard" in said and guarded["guard"] == [guard]
    assert all("dev_se" in c["choice"] and "ndcg@10_se" in c["dev"] for c in guarded["candidates"])


@pytest.mark.slow
def test_a_run_logs_every_dev_and_guard_number_with_its_error_and_records_its_choice(tiny_model_dir, small_train_file,
                                                                                     small_beir, tmp_path):
    import json

    from tests.conftest import read_jsonl, run_script

    run = tmp_path / "run"
    run_script("train_biencoder.py", ["--model", tiny_model_dir, "--train-file", small_train_file, "--val-file", "",
                                      "--batch-size", 4, "--max-steps", 2, "--dev-queries", 8, "--dev-corpus-size", 60,
                                      "--guard-beir", small_beir, "--merge-alphas", "0.5,1", "--output-dir", run])
    name = "guard_" + small_beir.rstrip("/").split("/")[-1]
    rows = read_jsonl(run / "metrics.jsonl")
    for split in ("dev", name):
        got = [r for r in rows if r["split"] == split]
        assert [r["step"] for r in got] == [0, 2] and all(r["ndcg@10_se"] >= 0 for r in got), (split, got)
    record = json.load(open(run / "final" / "retrieval_kit.json"))["merge"]
    assert record["rule"] == choice.RULE and "paired randomization test" in record["rule"]
    assert all(name in c and "p_worse_than_best" in c["choice"] or not c["choice"]["guard_ok"]
               for c in record["candidates"])
    assert sum("chosen" in c["choice"] for c in record["candidates"]) == 1


def test_the_dev_corpus_holds_each_queries_hard_negatives_and_its_mined_neighbours(tiny_model_dir, small_train_file,
                                                                                  tmp_path):
    """--dev-neighbours (issue 62): the held-out queries' own groups and their 3 nearest passages of the training
    pool, against a naive search (every pool passage scored by a plain dot product of the kit's embeddings)."""
    import torch

    from retrieval_kit.data import TrainFile
    from retrieval_kit.encode import encode_texts
    from retrieval_kit.evaluate import DEV_NEIGHBOURS, add_neighbours, load_biencoder, retrieve
    from retrieval_kit.records import hold_out_dev, passage_pool, read_records

    records, _ = read_records(small_train_file, 2)
    files, dev, _ = hold_out_dev([TrainFile(records)], 6, 20, seed=7)
    held = [r for r in records if r.query in dev[2].values()]
    pool = passage_pool(files)
    model, tok, s, _ = load_biencoder(tiny_model_dir)
    got = add_neighbours(dev, pool, 3, lambda b, k: retrieve(model, tok, s, b, k), str(tmp_path), True)
    assert got[0][:len(dev[0])] == dev[0] and got[1][:len(dev[1])] == dev[1]  # the held-out set as it was, then more
    corpus = set(got[1])
    assert all(p in corpus for r in held for p in [*r.pos, *r.neg])  # each query's positives and hard negatives
    q = encode_texts(model, tok, list(dev[2].values()), s["query_max_length"], s["query_prefix"])
    p = encode_texts(model, tok, pool, s["passage_max_length"], s["passage_prefix"])
    for row in (q @ p.T):
        for j in torch.topk(row, 3).indices.tolist():  # (no ties among these random-model scores)
            assert pool[j] in corpus
    assert len(got[1]) > len(dev[1])
    # a resume reads the same passages back; other dev queries are refused
    again = add_neighbours(dev, pool, 3, None, str(tmp_path), False)
    assert again == got
    other = (dev[0], dev[1], {**dev[2], "q0": "another query"}, dev[3])
    with pytest.raises(SystemExit, match="of other dev queries"):
        add_neighbours(other, pool, 3, None, str(tmp_path), False)
    (tmp_path / DEV_NEIGHBOURS).unlink()
    with pytest.raises(SystemExit, match="is missing or unreadable"):
        add_neighbours(dev, pool, 3, None, str(tmp_path), False)


@pytest.mark.slow
def test_two_ranks_choose_what_one_process_chooses(tiny_model_dir, small_train_file, small_beir, tmp_path):
    """The merge tool's choice under torchrun (the candidates scored sharded over 2 ranks) is one process's:
    the same alpha, the same dev numbers and p-values."""
    import json

    from tests.conftest import run_module, run_script

    run_script("train_biencoder.py", ["--model", tiny_model_dir, "--train-file", small_train_file, "--val-file", "",
                                      "--batch-size", 4, "--max-steps", 2, "--lr", 5e-2, "--query-max-length", 8,
                                      "--passage-max-length", 32, "--output-dir", tmp_path / "run"])
    argv = ["-m", "retrieval_kit.merge", "--base", tiny_model_dir, "--tuned", tmp_path / "run" / "final", "--alpha",
            "0,0.5,1", "--dev-beir", small_beir, "--guard-beir", small_beir]
    run_module([*argv, "--out", tmp_path / "one"])
    run_module([*argv, "--out", tmp_path / "two"], nproc=2)
    one, two = (json.load(open(tmp_path / d / "retrieval_kit.json"))["merge"] for d in ("one", "two"))
    assert one["alpha"] == two["alpha"]
    for a, b in zip(one["candidates"], two["candidates"]):  # (within rounding: other kernels shard sums otherwise)
        assert abs(a["dev"]["ndcg@10"] - b["dev"]["ndcg@10"]) < 1e-6
        assert abs(a["choice"].get("p_worse_than_best", 1) - b["choice"].get("p_worse_than_best", 1)) < 0.01
        assert ("chosen" in a["choice"]) == ("chosen" in b["choice"])


@pytest.mark.slow
def test_select_best_on_dev_follows_the_rule_over_every_validated_step(tiny_model_dir, small_train_file, small_beir,
                                                                       tmp_path):
    """--select-best dev/ndcg@10 (issue 62): every validated step is a candidate (its checkpoint kept past
    --keep-last), the earliest one the paired test does not find worse than the best is exported (the best
    when dev cannot tell them apart), with --guard-beir's scores; the export records every step's numbers
    and why."""
    import json
    import os

    from tests.conftest import run_script

    run = tmp_path / "run"
    run_script("train_biencoder.py", ["--model", tiny_model_dir, "--train-file", small_train_file, "--val-file", "",
                                      "--batch-size", 4, "--max-steps", 3, "--val-every", 1, "--lr", 5e-2,
                                      "--dev-queries", 12, "--dev-corpus-size", 80, "--guard-beir", small_beir,
                                      "--select-best", "dev/ndcg@10", "--keep-last", 1, "--output-dir", run])
    selected = json.load(open(run / "final" / "retrieval_kit.json"))["selected"]
    rows = selected["candidates"]
    assert [r["name"] for r in rows] == [0, 1, 2, 3] and all("guard" in r for r in rows)
    assert sorted(d for d in os.listdir(run) if d.startswith("step_")) == [f"step_00000{i}" for i in range(4)]
    chosen = [r for r in rows if "chosen" in r]
    assert len(chosen) == 1 and chosen[0]["name"] == selected["step"] and selected["why"] == chosen[0]["chosen"]
    held = [r for r in rows if r["guard_ok"]]
    best = max(held, key=lambda r: (r["dev"], -r["name"]))
    if "cannot tell" in selected["why"]:
        assert selected["step"] == best["name"]
    else:
        assert selected["step"] == min(r["name"] for r in held if r["p_worse_than_best"] >= 0.05
                                       and r["deficit_bound"] <= 0.005)


@pytest.mark.slow
def test_a_run_with_the_mined_dev_set_killed_and_resumed_is_bitwise_an_uninterrupted_one(tiny_model_dir,
                                                                                         small_train_file, tmp_path):
    """--dev-queries with --dev-neighbours (issue 62): the neighbours are mined once, at the fresh start, and read
    back on resume, so a SIGKILL after step 2's checkpoint and --resume auto give the uninterrupted run's weights,
    losses and every dev number (nDCG@10 and its standard error) bitwise."""
    import signal

    from tests.conftest import read_jsonl, run_script
    from tests.test_ckpt import assert_same_run, bi_args, kill_after_checkpoint, launch

    extra = ("--dev-queries", 8, "--dev-corpus-size", 30, "--dev-neighbours", 3, "--val-every", 2)
    ref, run = tmp_path / "ref", tmp_path / "run"
    run_script("train_biencoder.py", bi_args(tiny_model_dir, small_train_file, ref, *extra, "--max-steps", 6))
    proc = launch("train_biencoder.py", bi_args(tiny_model_dir, small_train_file, run, *extra, "--max-steps",
                                                100000))  # (a constant LR: the same path as 6 steps)
    rc, _, _ = kill_after_checkpoint(proc, run / "step_000002", signal.SIGKILL)
    assert rc == -signal.SIGKILL and not (run / "final").exists()
    run_script("train_biencoder.py", bi_args(tiny_model_dir, small_train_file, run, *extra, "--max-steps", 6,
                                             "--resume", "auto"))
    assert_same_run(ref, run)
    assert (run / "dev_neighbours.json").read_bytes() == (ref / "dev_neighbours.json").read_bytes()

    def dev(folder):
        return {r["step"]: (r["ndcg@10"], r["ndcg@10_se"]) for r in read_jsonl(folder / "metrics.jsonl")
                if r["split"] == "dev"}
    want, got = dev(ref), dev(run)
    assert sorted(want) == [0, 2, 4, 6] and got == want

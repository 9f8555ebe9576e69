"""How the kit chooses for its user among candidates scored on the same dev queries (merge weights;
the rule every choice is to follow: docs/pipeline.md, "Choosing for the user").

    chosen, rows = choose([{"name": 0.2, "dev": [...]}, {"name": 0.4, "dev": [...]}, ...], guard_base=[...])

Candidates come ordered from the closest to the base to the farthest (a merge: the smallest alpha first),
each with its per-query dev values (nDCG@10 of each dev query, the same queries in the same order for
every candidate) and, with a guard (`--guard-beir`: sets of other domains), its per-query guard values.

1. The guard: a candidate whose guard mean falls more than `guard_margin` (default: the base's own
   bootstrap standard error on the guard) below the base's is not chosen while another one holds.
2. The best: the highest dev mean among those left.
3. Closer to the base only when shown as good: a candidate closer to the base than the best is kept when the
   dev set shows it within MARGIN (0.5 points) of the best - it is not significantly worse (metrics.paired_p:
   a one-sided paired randomization test, p >= LEVEL) and the upper bound of its deficit (metrics.deficit_bound:
   the paired bootstrap's 95% quantile) is under MARGIN, two one-sided tests. The closest such one is kept.
   Otherwise the best-scoring candidate is kept; when no candidate is significantly worse than it, the dev
   set cannot tell them apart, and that is said.
Every candidate's means, standard errors, p-value, deficit bound and the reason for the choice go into its row.
"""

from .metrics import bootstrap_se, deficit_bound, paired_p

LEVEL = 0.05  # a candidate is significantly worse than the best below this p-value
MARGIN = 0.005  # a candidate closer to the base may give up this much of the best's dev mean (0.5 points), shown
RULE = ("the closest to the base that the dev queries show within 0.5 points of the best (a paired randomization "
        "test and a paired bootstrap bound), else the best (choice.py)")  # (as the records say it)


def mean(values):
    return sum(values) / len(values) if len(values) else 0.0


def choose(candidates, guard_base=None, guard_margin=None, level=LEVEL, margin=MARGIN, seed=0):
    """The rule above. Returns (index of the chosen candidate, rows): one row per candidate with "name", "dev",
    "dev_se", "p_worse_than_best", "deficit_bound" (and "guard", "guard_se", "guard_ok" with a guard), the chosen
    one's "chosen": the reason in words."""
    rows = [{"name": c["name"], "dev": mean(c["dev"]), "dev_se": bootstrap_se(c["dev"], seed=seed)} for c in candidates]
    eligible = list(range(len(candidates)))
    floor = None
    if guard_base is not None:
        floor = mean(guard_base) - (bootstrap_se(guard_base, seed=seed) if guard_margin is None else guard_margin)
        for r, c in zip(rows, candidates):
            r.update(guard=mean(c["guard"]), guard_se=bootstrap_se(c["guard"], seed=seed), guard_ok=True)
            r["guard_ok"] = r["guard"] >= floor
        held = [i for i in eligible if rows[i]["guard_ok"]]
        eligible = held or [max(eligible, key=lambda i: rows[i]["guard"])]  # none holds: the one that loses least
    best = max(eligible, key=lambda i: (rows[i]["dev"], -i))  # (a tie: the one closer to the base)
    for i in eligible:
        rows[i]["p_worse_than_best"] = 1.0 if i == best else paired_p(candidates[best]["dev"], candidates[i]["dev"],
                                                                       seed=seed)
        rows[i]["deficit_bound"] = 0.0 if i == best else deficit_bound(candidates[best]["dev"], candidates[i]["dev"],
                                                                         level, seed=seed)
    apart = [i for i in eligible if rows[i]["p_worse_than_best"] < level]
    shown = [i for i in eligible if i not in apart and rows[i]["deficit_bound"] <= margin]  # (the best among them)
    guard_said = "" if floor is None else (f"; the guard keeps {len([r for r in rows if r['guard_ok']])} of "
                                          f"{len(rows)} (floor {floor:.4f}: the base's guard less its margin)")
    chosen = min(shown)
    if len(eligible) == 1:
        why = "the only candidate" + (" the guard leaves" if floor is not None else "")
    elif chosen != best:
        r = rows[chosen]
        why = (f"the closest to the base that the dev set shows within {margin:g} of the best ({rows[best]['name']}: "
               f"{rows[best]['dev']:.4f} against {r['dev']:.4f}; p {r['p_worse_than_best']:.3f}, deficit at most "
               f"{r['deficit_bound']:.4f})")
    elif not apart:
        why = (f"the dev set cannot tell these candidates apart (none is significantly worse than the best, "
               f"p >= {level:g}; standard error {rows[best]['dev_se']:.4f}): the best-scoring one is kept")
    elif min(eligible) == best:
        why = "the best on dev, and the closest to the base"
    else:
        why = (f"the best on dev; no candidate closer to the base is shown within {margin:g} of it (each is "
               f"significantly worse, or its deficit may exceed {margin:g})")
    rows[chosen]["chosen"] = why + guard_said
    return chosen, rows


# ----- merge weights: score each candidate, then the rule (merge.dev_merge, python -m retrieval_kit.merge) ------

GUARD = "guard"  # the splits of a score named guard* are the guard (--guard-beir)


def values(per_query, split, metric="ndcg@10"):
    """One split's per-query `metric`, in query-id order (the same queries for every candidate)."""
    return [per_query[split][q][metric] for q in sorted(per_query[split])]


def guard_values(per_query, metric="ndcg@10"):
    """Every guard split's per-query values, one after the other; None without a guard."""
    splits = sorted(s for s in per_query if s.startswith(GUARD))
    return [v for s in splits for v in values(per_query, s, metric)] if splits else None


def choose_alpha(candidates, score, tolerance=None, base=None, guard_margin=None, metric=("dev", "ndcg@10")):
    """Score each (alpha, state-loading function) of `candidates` - score(per_query) -> {split: metrics} once
    the state is loaded, filling `per_query` with {split: {qid: metrics}} - and choose an alpha. By default
    the rule above (choose) over the dev queries: the closest to the base (the smallest alpha) that dev
    shows within MARGIN of the best, else the best; with guard splits (--guard-beir), none that loses more
    than `guard_margin` of alpha 0's guard score (`base`: the loading function of alpha 0, scored for it
    when no candidate is 0). With an explicit `tolerance`, the
    smallest alpha within it of the best dev `metric`, as before. Returns (chosen alpha, rows: {"alpha",
    split: metrics, "choice": the rule's row})."""
    rows, per = [], []
    for alpha, apply in sorted(candidates, key=lambda c: c[0]):
        apply()
        pq = {}
        rows.append({"alpha": alpha, **{split: {k: v for k, v in m.items() if not isinstance(v, list)}  # (per-query
                                        for split, m in score(pq).items()}})  # values: in per_query, not the record)
        per.append(pq)
    if tolerance is not None:
        best = max(r[metric[0]][metric[1]] for r in rows)
        return next(r["alpha"] for r in rows if r[metric[0]][metric[1]] >= best - tolerance), rows
    guard_base = None
    if guard_values(per[0]) is not None:
        if rows[0]["alpha"] != 0.0:
            base()
            score(pq := {})
            guard_base = guard_values(pq, metric[1])
        else:
            guard_base = guard_values(per[0], metric[1])
    chosen, table = choose([{"name": r["alpha"], "dev": values(pq, metric[0], metric[1]),
                             "guard": guard_values(pq, metric[1])} for r, pq in zip(rows, per)],
                           guard_base=guard_base, guard_margin=guard_margin)
    for r, t in zip(rows, table):
        r["choice"] = {k: v for k, v in t.items() if k != "name"}
    return rows[chosen]["alpha"], rows


def describe(chosen, rows, metric=("dev", "ndcg@10")):
    said = next((r["choice"].get("chosen") for r in rows if r["alpha"] == chosen and "choice" in r), None)
    lines = [f"merge with the base, chosen on {metric[0]}/{metric[1]}: alpha {chosen:g} (" +
             (said or "the smallest within the tolerance of the best") + ")"]
    for r in rows:
        c = r.get("choice", {})
        extra = (f", p {c['p_worse_than_best']:.3f} that it is worse than the best, deficit at most "
                 f"{c['deficit_bound']:.4f}" if "p_worse_than_best" in c else "") + \
            (f", guard {c['guard']:.4f}{'' if c['guard_ok'] else ' (below the floor)'}" if "guard" in c else "")
        lines.append(f"  alpha {r['alpha']:g}: " + ", ".join(
            f"{s}/{metric[1]} {m[metric[1]]:.4f}" + (f" +- {m[metric[1] + '_se']:.4f}" if metric[1] + "_se" in m else "")
            for s, m in r.items() if s not in ("alpha", "choice") and metric[1] in m) + extra)
    return "\n".join(lines)

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

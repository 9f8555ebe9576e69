"""How the kit chooses for its user among candidates scored on the same dev queries (merge weights;
the rule every choice is to follow: docs/pipeline.md, "Choosing for the user").

    chosen, rows = choose([{"name": 0.2, "dev": [...]}, {"name": 0.4, "dev": [...]}, ...], guard_base=[...])

Candidates come ordered from the closest to the base to the farthest (a merge: the smallest alpha first),
each with its per-query dev values (nDCG@10 of each dev query, the same queries in the same order for
every candidate) and, with a guard (`--guard-beir`: sets of other domains), its per-query guard values.

1. The guard: a candidate whose guard mean falls more than `guard_margin` (default: the base's own
   bootstrap standard error on the guard) below the base's is not chosen while another one holds.
2. The best: the highest dev mean among those left.
3. The paired test: each other candidate against the best, query by query (metrics.paired_p: a one-sided
   randomization test). When none is significantly worse than the best (p < LEVEL), the dev set cannot
   tell them apart: that is said, and the best-scoring candidate is kept. Otherwise the candidate closest to
   the base that is not significantly worse than the best is kept.
Every candidate's means, standard errors, p-value and the reason for the choice go into its row.
"""

from .metrics import bootstrap_se, paired_p

LEVEL = 0.05  # a candidate is significantly worse than the best below this p-value


def mean(values):
    return sum(values) / len(values) if len(values) else 0.0


def choose(candidates, guard_base=None, guard_margin=None, level=LEVEL, seed=0):
    """The rule above. Returns (index of the chosen candidate, rows): one row per candidate with "name", "dev",
    "dev_se", "p_worse_than_best" (and "guard", "guard_se", "guard_ok" with a guard), the chosen one's
    "chosen": the reason in words."""
    rows = [{"name": c["name"], "dev": mean(c["dev"]), "dev_se": bootstrap_se(c["dev"], seed=seed)} for c in candidates]
    eligible = list(range(len(candidates)))
    floor = None
    if guard_base is not None:
        margin = bootstrap_se(guard_base, seed=seed) if guard_margin is None else guard_margin
        floor = mean(guard_base) - margin
        for r, c in zip(rows, candidates):
            r.update(guard=mean(c["guard"]), guard_se=bootstrap_se(c["guard"], seed=seed), guard_ok=True)
            r["guard_ok"] = r["guard"] >= floor
        held = [i for i in eligible if rows[i]["guard_ok"]]
        eligible = held or [max(eligible, key=lambda i: rows[i]["guard"])]  # none holds: the one that loses least
    best = max(eligible, key=lambda i: (rows[i]["dev"], -i))  # (a tie: the one closer to the base)
    for i in eligible:
        rows[i]["p_worse_than_best"] = 1.0 if i == best else paired_p(candidates[best]["dev"], candidates[i]["dev"],
                                                                       seed=seed)
    kept = [i for i in eligible if rows[i]["p_worse_than_best"] >= level]
    guard_said = "" if floor is None else (f"; the guard keeps {len([r for r in rows if r['guard_ok']])} of "
                                          f"{len(rows)} (floor {floor:.4f}: the base's guard less its margin)")
    if len(eligible) == 1:
        chosen, why = best, "the only candidate" + (" the guard leaves" if floor is not None else "")
    elif len(kept) == len(eligible):
        chosen = best
        why = (f"the dev set cannot tell these candidates apart (none is significantly worse than the best, "
               f"p >= {level:g}; standard error {rows[best]['dev_se']:.4f}): the best-scoring one is kept")
    else:
        chosen = min(kept)
        why = ("the best on dev; every candidate closer to the base is significantly worse" if chosen == best else
               f"the closest to the base not significantly worse than the best ({rows[best]['name']}: "
               f"{rows[best]['dev']:.4f} against {rows[chosen]['dev']:.4f}, p {rows[chosen]['p_worse_than_best']:.3f})")
    rows[chosen]["chosen"] = why + guard_said
    return chosen, rows

"""Weight averaging of exported models, and the weight chosen on a dev split.

    python -m retrieval_kit.merge --base BASE --tuned runs/biencoder/final --alpha 0.6 --out merged
    python -m retrieval_kit.merge --base BASE --tuned runs/biencoder/final --alpha 0.2,0.4,0.6,0.8,1.0 \\
        --dev-beir DEV --out merged           # the smallest alpha within --tolerance of the best, on DEV
    python -m retrieval_kit.merge --models run1/final,run2/final,run3/final [--weights 2,1,1] --out soup
    python -m retrieval_kit.merge --models a/final,b/final --slerp 0.5 --out merged

Interpolation with the base (WiSE-FT, Wortsman et al. 2022; FlagEmbedding's LM-Cocktail mixes models the
same way, Xiao et al. 2023): theta = (1 - alpha) * theta_base + alpha * theta_tuned, tensor by tensor;
alpha 0 is the base, 1 the tuned model. A soup (model soups, Wortsman et al. 2022): the weighted mean of N
models of one kind. Spherical interpolation of two models (as Qwen3-Embedding merges checkpoints): each
tensor along the great circle between the two, by its angle (linear where they are nearly parallel).

The models are exports of the kit (or any dir it reads) of one architecture: bi-encoders of any head,
rerankers (LoRA runs are exported merged, so they merge as plain weights). What the base has no
counterpart for - a fresh projection, classifier or MLM head: parameters its dir does not hold, found by
loading it twice under different seeds - is kept from the tuned model. The result is a complete export of
the tuned model's kind (sentence-transformers files, reranker files) with `merge` in its retrieval_kit.json:
the formula, the models, and with a dev split every candidate's scores. Differing kinds or shapes are one
sentence.

With a dev split (`--dev-beir`, or a training run's --dev-queries with --merge-alphas) each alpha is scored
and the rule of choice.py keeps the smallest one that the dev queries show within 0.5 points of the best (a
paired test and a bootstrap bound on its deficit), else the best: the model closest to the base that gives up
almost nothing in domain, where the dev set can show it. `--tolerance` keeps the smallest within it instead.
Reported sets (`--report-beir`, a run's --eval-beir) are scored for every candidate and never used to choose.
"""

import argparse
import json
import math
import os

import torch

from . import choice, dist, flags, heads, outputs
from .st_format import SETTINGS_FILE, edit_json


# ----- the maths ------------------------------------------------------------------------------------

def interpolate(base, tuned, alpha):
    """{name: (1 - alpha) * base + alpha * tuned} for the tensors `base` holds, `tuned`'s own elsewhere
    (computed in fp32, returned in the tuned tensor's dtype)."""
    return {k: ((1.0 - alpha) * base[k].float() + alpha * t.float()).to(t.dtype) if k in base else t.clone()
            for k, t in tuned.items()}


def soup(states, weights=None):
    """The weighted mean of the states (same names and shapes), weights normalized to sum 1."""
    weights = [1.0] * len(states) if weights is None else list(weights)
    total = sum(weights)
    return {k: sum((w / total) * s[k].float() for s, w in zip(states, weights)).to(t.dtype)
            for k, t in states[0].items()}


def slerp(a, b, t, eps=1e-4):
    """Spherical interpolation of two states at t (0 = a, 1 = b), tensor by tensor: the angle between the
    flattened tensors, each moved along the great circle and scaled by its interpolated norm; linear where
    the angle is below eps."""
    out = {}
    for k, x in a.items():
        u, v = x.float().flatten(), b[k].float().flatten()
        nu, nv = u.norm(), v.norm()
        cos = (u @ v / (nu * nv).clamp_min(1e-12)).clamp(-1.0, 1.0)
        angle = float(torch.arccos(cos))
        if angle < eps or nu == 0 or nv == 0:
            mixed = (1.0 - t) * u + t * v
        else:
            s = math.sin(angle)
            dirs = (math.sin((1 - t) * angle) / s) * (u / nu) + (math.sin(t * angle) / s) * (v / nv)
            mixed = dirs * ((1 - t) * nu + t * nv)
        out[k] = mixed.view_as(x).to(x.dtype)
    return out


# ----- models -------------------------------------------------------------------------------------

def checkpoint_of(path):
    """(the run's export, the weights file) when `path` is a run's checkpoint (`RUN/step_000300`: its
    model.safetensors) or the average it keeps (`RUN/step_000300/ema.safetensors`: --ema-decay); else None.
    The architecture, tokenizer and settings come from the run's export, `RUN/final`."""
    folder, name = (os.path.dirname(path), os.path.basename(path)) if os.path.isfile(path) else (path, None)
    if not os.path.isfile(os.path.join(folder, "meta.json")):
        if name is not None:
            raise SystemExit(f"{path}: a file; a model is an export's folder, a run's checkpoint folder "
                             "(RUN/step_N) or the EMA it keeps (RUN/step_N/ema.safetensors)")
        return None
    weights = os.path.join(folder, name or "model.safetensors")
    final = os.path.join(os.path.dirname(os.path.abspath(folder)), "final")
    if not os.path.isfile(weights) or name not in (None, "model.safetensors", "ema.safetensors"):
        raise SystemExit(f"{path}: not a checkpoint's model.safetensors or ema.safetensors")
    if not os.path.isfile(os.path.join(final, SETTINGS_FILE)):
        raise SystemExit(f"{path}: a checkpoint is read with its run's export for the architecture, and "
                         f"{final} holds none (let the run finish, or resume it to its end)")
    from .ckpt import load_meta, verify

    try:
        meta = load_meta(folder)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{folder}/meta.json cannot be read ({e}): not a complete checkpoint") from None
    if meta.get("model_subset") == "trained" or meta.get("model_format") == "dcp":
        raise SystemExit(f"{path}: a LoRA or sharded (DCP) checkpoint; merge its run's exports instead "
                         "(--export-ema, --select-best)")
    problem = verify(folder)  # the digests recorded when it was written, as --resume checks them
    if problem:
        raise SystemExit(f"{path}: {problem}; merge reads only a checkpoint that --resume would")
    return final, weights


def check_finite(state, name):
    """One sentence when a state read for a merge holds NaN or infinite values (a run that diverged)."""
    for k, v in state.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise SystemExit(f"{name}: {k} holds NaN or infinite values: merge writes no model from it")


def load(path, own=None, seed=0, like=None):
    """(the raw model with its head, tokenizer, settings, head module) of a dir: an export of the kit, a
    run's checkpoint (checkpoint_of), or any dir the kit reads as the head `like` (a base: a plain or
    sentence-transformers dir). `own`: the head's load settings (heads.load_args) where the dir does not hold
    them (a fresh projection's width for a base)."""

    ckpt = None if like is not None else checkpoint_of(path)
    if ckpt is not None:
        from safetensors.torch import load_file

        model, tok, settings, head = load(ckpt[0], own, seed)
        try:
            state = load_file(ckpt[1])
        except Exception as e:  # (a truncated or foreign file: safetensors' own error types)
            raise SystemExit(f"{ckpt[1]} cannot be read ({e}): a damaged checkpoint") from None
        unknown = [k for k in state if k not in model.state_dict()]
        if unknown:
            raise SystemExit(f"{ckpt[1]}: {unknown[0]} is not a parameter of {ckpt[0]}'s model: another run's")
        ema = os.path.basename(ckpt[1]) == "ema.safetensors"  # (an EMA holds what was trained: the rest is frozen)
        missing = [n for n, p in model.named_parameters() if n not in state and (p.requires_grad or not ema)]
        if missing:
            raise SystemExit(f"{ckpt[1]}: holds no {missing[0]} ({len(missing)} of {ckpt[0]}'s parameters missing): "
                             "not a whole checkpoint of that run; nothing is taken from elsewhere")
        check_finite(state, ckpt[1])
        model.load_state_dict(state, strict=False)
        return model, tok, settings, head
    from .export import load_exported_reranker
    from .models import load_tokenizer

    spec = heads.read_spec(path)
    name = like or spec.head or heads.EMBEDDING[0]
    if like is not None:
        heads.check_dir(spec, like)  # (differing kinds: one sentence naming both)
    if name in heads.RERANKER:
        if spec.kit.get("kind") == "reranker":
            model, tok, settings = load_exported_reranker(path)
            return model.model, tok, settings, heads.get(name)
        return heads.get(name).load(path), load_tokenizer(path), {}, heads.get(name)
    head, settings = heads.choose(spec, {"head": name})
    model = head.load(path, spec=spec, seed=seed, **heads.load_args(head, {**settings, **(own or {})}))
    return model, load_tokenizer(spec.model_path, prepare=spec.prepare_tokenizer), {**spec.kit, **settings}, head


def base_state(path, like, own=None):
    """The base's parameters that its dir holds, under the tuned model's names: what transformers reports
    it did not find (model.fresh_keys) is left out, and so is what differs between two loads under
    different seeds (a head the kit adds fresh: a projection)."""
    torch.manual_seed(0)
    first = load(path, own, seed=0, like=like)[0]
    torch.manual_seed(1)
    two = load(path, own, seed=1, like=like)[0].state_dict()
    fresh = set(getattr(first, "fresh_keys", []))
    return {k: v for k, v in first.state_dict().items() if k not in fresh and torch.equal(v, two[k])}


def check_base(tuned, base, tuned_name, base_name):
    """One sentence when the base's tensors do not fit the tuned model's (check_shapes) or it shares under half
    of them by name (another architecture: nothing, or little, would be interpolated)."""
    check_shapes([tuned, base], [tuned_name, base_name])
    shared = sum(k in base for k in tuned)
    if 2 * shared < len(tuned):
        raise SystemExit(f"--base {base_name}: shares {shared} of {tuned_name}'s {len(tuned)} tensors (by name and "
                         "shape): a base shares all but a fresh head's; not the model it was tuned from")
    check_finite(base, base_name)


def check_shapes(states, names):
    """One sentence when the states do not share their names' shapes (another architecture or size)."""
    ref = states[0]
    for s, name in zip(states[1:], names[1:]):
        odd = [k for k in ref if k in s and tuple(s[k].shape) != tuple(ref[k].shape)]
        if odd:
            raise SystemExit(f"{name}: {odd[0]} is {tuple(s[odd[0]].shape)}, {names[0]}'s is {tuple(ref[odd[0]].shape)}: "
                             "the models are not of one architecture and size")


def write(out, model, tokenizer, settings, head, record, adapter=None):
    """`model` (its merged weights loaded) exported to `out` as the tuned model's kind, `record` in its
    retrieval_kit.json's "merge" with the list of every file written (what makes `out` merge's own: not_ours).
    What the tuned export held beside the model is rebuilt from the merged weights: its peft adapter dir
    (`adapter`: (the tuned export's adapter dir, alpha): adapter_at) and an LM reranker's seq_cls/
    (--export-seq-cls, export_reranker); the record says what was written."""
    from .export import export_model, export_reranker
    from .outputs import STAGE_MARK

    lora = settings.get("lora")  # (a head's extra dirs, an LM's seq_cls/, are rebuilt as its settings record them)
    settings = {k: v for k, v in settings.items() if k not in ("lora", "sentence_transformers", "merge")}
    if adapter is not None:
        settings["lora"] = {**lora, "adapter_alpha": adapter[1]}  # adapter/ is the merge's, at alpha
    settings["merge"] = record

    def finish(stage):  # rank 0, the staged export complete but for these
        if adapter is not None:
            adapter_at(adapter[0], os.path.join(stage, "adapter"), adapter[1], model.state_dict())
        files = sorted(os.path.relpath(os.path.join(r, f), stage) for r, _, names in os.walk(stage) for f in names
                       if f != STAGE_MARK)
        edit_json(os.path.join(stage, SETTINGS_FILE), lambda c: c["merge"].update(files=files))
    if settings.get("kind") == "reranker":
        return export_reranker(out, model, tokenizer, settings, finish=finish)
    return export_model(out, model, tokenizer, {**settings, "kind": "biencoder", "head": head.NAME}, finish=finish)


def adapter_of(tuned_dir, settings, base_dir):
    """The tuned export's peft adapter dir (--export-adapter) when it has one, else None. Its adapter at alpha
    (adapter_at) is the merge only over the base it was trained on: another --base is one sentence."""
    src = os.path.join(tuned_dir, "adapter")
    lora = settings.get("lora") or {}
    if not os.path.isdir(src) or not lora.get("adapter"):
        return None
    trained_on = lora.get("base_model")
    if trained_on and os.path.realpath(trained_on) != os.path.realpath(base_dir):
        raise SystemExit(f"--base {base_dir}: {tuned_dir}/adapter is a LoRA adapter trained on {trained_on}, and its "
                         "adapter at alpha is the merge only over that base: give --base " + trained_on)
    return src


def adapter_at(src, dst, alpha, merged):
    """The peft adapter dir `src` as the adapter of the merge at `alpha`, written to `dst`: every lora_B times
    alpha - W0 + alpha * s * B A is (1 - alpha) * W0 + alpha * (W0 + s * B A), the base and the tuned model's
    merged weight interpolated - and every fully trained module (modules_to_save: a fresh head) the merge's
    own tensor (`merged`: the merged model's state dict)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from .lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX

    out = {}
    for k, v in load_file(os.path.join(src, ADAPTER_WEIGHTS)).items():
        if ".lora_B." in k:
            out[k] = (v.float() * alpha).to(v.dtype)
        elif ".lora_A." in k:
            out[k] = v
        else:
            name = k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k
            if name not in merged:
                raise SystemExit(f"{src}/{ADAPTER_WEIGHTS}: {k} is no tensor of the merged model: its adapter cannot be "
                                 f"rebuilt at alpha {alpha:g}")
            out[k] = merged[name].detach().to(v.dtype).contiguous()
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, ADAPTER_WEIGHTS))
    shutil.copyfile(os.path.join(src, ADAPTER_CONFIG), os.path.join(dst, ADAPTER_CONFIG))


def not_ours(out):
    """Why merge may not replace the folder `out`, or None: absent, empty, or a merge it wrote with nothing
    added since (its record lists every file in it). A training run's export is not a merge."""
    if not os.path.isdir(out) or not os.listdir(out):
        return None
    try:
        with open(os.path.join(out, SETTINGS_FILE), encoding="utf-8") as f:
            kit = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        kit = None
    record = kit.get("merge") if isinstance(kit, dict) else None
    if not isinstance(record, dict):
        shown = ", ".join(sorted(os.listdir(out))[:3])
        return (f"it is not a merge's folder ({shown}, ...: " + ("an export of a training run" if isinstance(kit, dict)
                                                                 else "files merge did not write") + ")")
    written = record.get("files") if isinstance(record.get("files"), list) else []
    added = sorted(os.path.relpath(os.path.join(r, f), out) for r, _, names in os.walk(out) for f in names
                   if os.path.relpath(os.path.join(r, f), out) not in written)
    if added:
        return f"it holds files merge did not write ({', '.join(added[:3])}{', ...' if len(added) > 3 else ''})"
    return None


# ----- the weight chosen on dev --------------------------------------------------------------------

def dev_merge(final, base_dir, alphas, tolerance, score, device="cpu", guard_margin=None):
    """A run's --merge-alphas, after its export: each alpha's merge of `final` with the run's base scored by
    `score(model, tokenizer, settings, per_query)` -> {split: metrics} (the dev split first; --eval-beir
    reported; --guard-beir as guard*), filling per_query (choice.choose_alpha); `final` rewritten as the chosen merge, the
    choice and every candidate's scores recorded there. Every rank takes part (the scoring is sharded like
    evaluation's). Returns the record."""
    model, tok, settings, head = load(final)
    tuned = {k: v.clone() for k, v in model.state_dict().items()}
    check_finite(tuned, final)
    base = base_state(base_dir, head.NAME, heads.load_args(head, settings))
    check_base(tuned, base, final, base_dir)
    adapter = adapter_of(final, settings, base_dir)  # --export-adapter: rebuilt at the chosen alpha
    model.to(device)

    def candidate(alpha):
        return alpha, lambda: model.load_state_dict(interpolate(base, tuned, alpha))
    chosen, rows = choice.choose_alpha([candidate(a) for a in alphas], lambda pq: score(model, tok, settings, pq),
                                       tolerance, candidate(0.0)[1], guard_margin)
    dist.print0(choice.describe(chosen, rows))
    model.to("cpu").load_state_dict(interpolate(base, tuned, chosen))
    record = {"formula": "(1 - alpha) * base + alpha * tuned", "base": base_dir, "alpha": chosen,
              "chosen_on": "dev/ndcg@10", **({"tolerance": tolerance} if tolerance is not None else
                                            {"rule": choice.RULE}),
              "candidates": rows}
    write(final, model, tok, settings, head, record, adapter and (adapter, chosen))  # (collective: rank 0 writes,
    return record  # staged, over the run's own export)


# ----- the tool -------------------------------------------------------------------------------------

def main(argv=None):
    from . import cli

    ap = cli.KitParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tuned", default=None, help="the fine-tuned export (with --base)")
    ap.add_argument("--base", default=None, help="the model it was tuned from: alpha 0")
    ap.add_argument("--alpha", type=flags.listed(flags.fraction), default=None,
                    help="weight of the tuned model, 0 to 1; several (0.2,0.4,...,1.0) with --dev-beir choose one")
    ap.add_argument("--models", type=flags.listed(str), default=None, help="exports (or a run's checkpoints, "
                    "RUN/step_N, and the EMA they keep, RUN/step_N/ema.safetensors) to average (a soup), or two to "
                    "interpolate spherically (--slerp)")
    ap.add_argument("--weights", type=flags.listed(flags.positive_float), default=None,
                    help="one weight per --models entry (default equal)")
    ap.add_argument("--slerp", type=flags.fraction, default=None, help="spherical interpolation of two --models at t")
    ap.add_argument("--dev-beir", default=None, help="BEIR folder the alpha is chosen on (nDCG@10)")
    ap.add_argument("--report-beir", action=flags.Repeatable, default=[], help="BEIR folder scored for every "
                    "candidate, never used to choose (repeatable)")
    ap.add_argument("--biencoder", default=None, help="rerankers: the bi-encoder export whose top 10 of --dev-beir "
                    "the candidates rerank")
    ap.add_argument("--guard-beir", type=flags.listed(str), default=None,
                    help="BEIR folders of other domains (e.g. data/ood), scored for alpha 0 and every candidate: one "
                         "whose guard nDCG@10 falls more than --guard-margin below alpha 0's is not chosen while another "
                         "holds it")
    ap.add_argument("--guard-margin", type=flags.fraction, default=None,
                    help="with --guard-beir: how far below alpha 0's guard nDCG@10 a candidate may fall (default: alpha "
                         "0's own bootstrap standard error on the guard queries)")
    ap.add_argument("--tolerance", type=flags.fraction, default=None,
                    help="with several --alpha: keep the smallest alpha within this of the best dev nDCG@10, instead "
                         "of the default rule: the smallest alpha that the dev queries show within 0.5 points of the "
                         "best (not significantly worse, and a bootstrap bound on its deficit under 0.005), else the "
                         "best (docs/pipeline.md)")
    ap.add_argument("--out", required=True, help="the merged export to write (a new or empty folder, or an earlier "
                    "merge)")
    a = ap.parse_args(argv)
    pair, many = a.tuned is not None or a.base is not None, a.models is not None
    if many and a.alpha is not None:
        ap.error("--alpha weighs --tuned against --base; --models are averaged (--weights) or interpolated (--slerp)")
    if pair == many or (pair and (a.tuned is None or a.base is None or a.alpha is None)):
        ap.error("give --base, --tuned and --alpha, or --models (with --weights or --slerp)")
    if len(a.alpha or []) > 1 and not a.dev_beir:
        ap.error(f"--alpha {','.join(map(str, a.alpha))}: several weights are chosen among on a dev set: give --dev-beir")
    if a.slerp is not None and len(a.models or []) != 2:
        ap.error("--slerp interpolates two --models")
    if a.slerp is not None and a.weights is not None:
        ap.error("--weights with --slerp: --slerp's t weighs the two models; --weights is for a soup: drop one")
    if a.weights is not None and len(a.weights) != len(a.models or []):
        ap.error(f"--weights: {len(a.weights)} for {len(a.models or [])} --models")
    choosing = len(a.alpha or []) > 1
    for flag, given in (("--dev-beir", a.dev_beir), ("--report-beir", a.report_beir), ("--biencoder", a.biencoder),
                        ("--tolerance", a.tolerance is not None), ("--guard-beir", a.guard_beir),
                        ("--guard-margin", a.guard_margin is not None)):
        if given and not choosing:
            ap.error(f"{flag}: only when several --alpha are chosen among on --dev-beir (this merge " +
                     ("averages --models" if many else f"has the one alpha {a.alpha[0]:g}") + "): drop the flag")
    if a.guard_margin is not None and not a.guard_beir:
        ap.error("--guard-margin: only with --guard-beir (no guard is scored without it): drop the flag")
    if a.tolerance is not None and a.guard_beir:
        ap.error("--tolerance with --guard-beir: the tolerance rule reads dev alone; drop --tolerance for the paired "
                 "rule, which the guard completes")
    ins = [("--tuned", a.tuned), ("--base", a.base), *[("--models", m) for m in a.models or []],
           ("--dev-beir", a.dev_beir), ("--biencoder", a.biencoder), *[("--report-beir", r) for r in a.report_beir],
           *[("--guard-beir", g) for g in a.guard_beir or []]]
    for flag, path in ins:
        if path and not (os.path.isdir(path) or (flag == "--models" and os.path.isfile(path))):
            ap.error(f"{flag} {path}: no such folder")
    exports = [(flag, (checkpoint_of(path) or (path,))[0])  # (a checkpoint's architecture: its run's final/)
               for flag, path in ins if path and flag in ("--tuned", "--models")]
    ins += [(f"{flag} (its run's export, read for the architecture)", d) for flag, d in exports]
    if a.biencoder and heads.read_spec(exports[0][1]).kit.get("kind") != "reranker":
        ap.error(f"--biencoder: {a.tuned} is a bi-encoder; --biencoder names the first stage whose top 10 a reranker's "
                 "candidates rerank: drop the flag")
    outputs.check_dir("--out", a.out, SETTINGS_FILE, ins)
    why = not_ours(a.out)
    if why:
        raise SystemExit(f"--out {a.out}: {why}; merge replaces only a folder it wrote: give a new or empty folder")
    ctx = dist.init()

    if pair:
        model, tok, settings, head = load(a.tuned)
        tuned = {k: v.clone() for k, v in model.state_dict().items()}
        check_finite(tuned, a.tuned)
        base = base_state(a.base, head.NAME, heads.load_args(head, settings))
        check_base(tuned, base, a.tuned, a.base)
        adapter = adapter_of(exports[0][1], settings, a.base)  # --export-adapter: rebuilt at the alpha
        kept = sorted(k for k in tuned if k not in base)
        record = {"formula": "(1 - alpha) * base + alpha * tuned", "base": a.base, "tuned": a.tuned,
                  "kept_from_tuned": kept}
        if len(a.alpha) > 1:
            scorer = scoring(settings, head, a.dev_beir, a.report_beir, a.biencoder, ctx.device, a.guard_beir)
            model.to(ctx.device)
            at = lambda x: lambda: model.load_state_dict(interpolate(base, tuned, x))  # noqa: E731
            chosen, rows = choice.choose_alpha([(x, at(x)) for x in a.alpha],
                                               lambda pq: scorer(model, tok, settings, pq), a.tolerance, at(0.0),
                                               a.guard_margin)
            dist.print0(choice.describe(chosen, rows))
            record.update(alpha=chosen, chosen_on=f"{a.dev_beir} ndcg@10", candidates=rows,
                          **({"tolerance": a.tolerance} if a.tolerance is not None else
                             {"rule": choice.RULE,
                              "guard": a.guard_beir, "guard_margin": a.guard_margin}))
            model.to("cpu")
        else:
            record["alpha"] = a.alpha[0]
        model.load_state_dict(interpolate(base, tuned, record["alpha"]))
        adapter = adapter and (adapter, record["alpha"])
    else:
        loaded = [load(m) for m in a.models]
        kinds = {x[3].NAME for x in loaded}
        if len(kinds) > 1:
            raise SystemExit(f"--models: {', '.join(f'{m} ({x[3].NAME})' for m, x in zip(a.models, loaded))}: models of "
                             "one kind are averaged")
        states = [x[0].state_dict() for x in loaded]
        if any(set(s) != set(states[0]) for s in states):
            raise SystemExit(f"--models: {a.models[0]} and {a.models[1]} hold other parameters: models of one kind and "
                             "architecture are averaged")
        check_shapes(states, a.models)
        for state, name in zip(states, a.models):
            check_finite(state, name)
        model, tok, settings, head = loaded[0]
        adapter = None
        if (settings.get("lora") or {}).get("adapter"):  # (a mean of merged LoRA weights is no rank-r adapter)
            dist.print0("note: --models: a soup of LoRA exports is written merged, without their adapter/ dirs")
        if a.slerp is not None:
            model.load_state_dict(slerp(states[0], states[1], a.slerp))
            record = {"formula": "slerp(a, b, t)", "models": a.models, "t": a.slerp}
        else:
            model.load_state_dict(soup(states, a.weights))
            record = {"formula": "weighted mean", "models": a.models, "weights": a.weights or [1.0] * len(a.models)}
    write(a.out, model, tok, settings, head, record, adapter)  # (collective: rank 0 writes)
    dist.print0(f"wrote the merge to {a.out}")
    dist.cleanup()


def scoring(settings, head, dev_beir, report_beir, biencoder, device, guard_beir=None):
    """score(model, tokenizer, settings, per_query) -> {"dev": metrics, report dir: metrics, "guard_<dir>":
    metrics}: a bi-encoder's retrieval metrics on each set (with the standard error of nDCG@10); a reranker's,
    reranking `biencoder`'s top 10 alone; `per_query` filled with each set's per-query metrics (choice.choose_alpha)."""
    from .evaluate import load_beir, load_biencoder, rerank, retrieve, with_se

    sets = {"dev": load_beir(dev_beir), **{r: load_beir(r) for r in report_beir},
            **{f"{choice.GUARD}_{os.path.basename(os.path.normpath(g))}": load_beir(g) for g in guard_beir or []}}
    if settings.get("kind") != "reranker":
        def score(model, tok, s, per_query):
            embedder = head.embedder(model, s).eval()
            return {k: with_se(retrieve(embedder, tok, s, b, device=device), b[3], per_query.setdefault(k, {}))
                    for k, b in sets.items()}
        return score
    if not biencoder:
        raise SystemExit("--dev-beir with a reranker: give --biencoder, the export whose top 10 it reranks")
    enc, etok, es, _ = load_biencoder(biencoder, device=device)
    runs = {k: retrieve(enc, etok, es, b, device=device) for k, b in sets.items()}

    def score(model, tok, s, per_query):
        scorer = head.scorer(model, s.get("pooling", "native"), s.get("lm_token_ids")).eval()
        return {k: with_se(rerank(runs[k], scorer, tok, s, b, 10, device=device, weight=1.0), b[3],
                           per_query.setdefault(k, {})) for k, b in sets.items()}
    return score


if __name__ == "__main__":
    from .rundir import exit_on_data_error

    exit_on_data_error(main)

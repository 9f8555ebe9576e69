"""The kit's LLM-reranker step (--head lm, LoRA) against a bare transformers + peft loop and against
sentence-transformers' CrossEncoderTrainer, on the same causal LM and the same pairs, in the same run.

    python scripts/build_smollm2.py                     # prints the SmolLM2-135M-Instruct dir
    python bench/bench_decoder_step.py --model DIR      # 2 queries x 4 pairs, pairs up to 192 tokens
    python bench/bench_decoder_step.py --model DIR --profile    # + where the kit's step spends its time

Every side trains rank-16 LoRA adapters (alpha 32, dropout --lora-dropout, 0.1) on the seven Llama / Qwen projections of
a frozen fp32 base, scores a pair by logit("yes") - logit("no") after Qwen3-Reranker's prompt layout
(--prompt-template qwen3), takes the listwise softmax cross-entropy over each query's group (positive
first), clips the grad norm at 1 and steps fused AdamW (lr 2e-4, weight decay 0.01), under bf16 autocast
(--compute-dtype; fp32 throughout with fp32), dropout on.
  kit: train_reranker.py's step - collate.rerank_inputs (the template rendered and tokenized as one,
       pairs sorted by length into chunks of at most --chunk-tokens padded tokens), loop.plain_step with
       losses.reranker_loss, loop.finish_step; the LM head read at two vocabulary rows.
  bare: what a user writes from Qwen3-Reranker's model card: prefix + the body (cut to fit) + suffix
       token ids, tokenizer.pad (left), AutoModelForCausalLM + peft's get_peft_model,
       model(..., logits_to_keep=1) and the two rows of the last position, loss, backward, clip, step.
  st:  sentence-transformers' CrossEncoder on the causal LM (its LogitScore head: the same yes / no
       logits at the last token), its tokenizer's chat template set to the one the kit exports for
       this layout (so it renders the same string), peft adapters on its causal LM, trained by
       CrossEncoderTrainer with ListNetLoss (labels [100, 0, ...]: a one-hot target softmax, the same
       loss), its bf16 mixed precision.
Blocks alternate kit, bare, st (each a fresh process: --warmup untimed + --steps timed steps); medians
over the blocks' timed steps, peak RSS the highest of a side's blocks. Useful FLOP/s: 4 FLOPs per
frozen base parameter (its forward and the backward to its inputs) + 6 per adapter parameter, per real
token (log.flops_per_token), over the step time; against the best torch.mm throughput in the compute
dtype at the model's shapes, measured in this run. Attention's FLOPs are left out (a lower bound).
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.bench_peer import matmul_peak  # noqa: E402
from bench.bench_train_step import batches, current_rss_mb, peak_rss_mb, reset_peak_rss  # noqa: E402
from retrieval_kit import dist, log, loop, lora, optim  # noqa: E402
from retrieval_kit.collate import rerank_inputs  # noqa: E402
from retrieval_kit.pairs import TEMPLATE_PRESETS, pair_layout  # noqa: E402
from retrieval_kit.export import reranker_chat_template  # noqa: E402
from retrieval_kit.hostmem import keep_freed_memory  # noqa: E402
from retrieval_kit.losses import RERANK_LOSSES, reranker_loss  # noqa: E402
from retrieval_kit.heads import lm  # noqa: E402
from retrieval_kit.models import setup_pad_token  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA, LR = 16, 32, 2e-4
SIDES = ("kit", "bare", "st")


def tokenizer_of(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def autocast_dtype(args):
    return torch.bfloat16 if args.compute_dtype == "bf16" else None


def make_kit(model_dir, args, tok):
    """train_reranker.py --head lm --prompt-template qwen3 --lora-rank 16's step: step(queries, groups) ->
    the real token count of its pairs."""
    net = lm.load(model_dir).train()
    setup_pad_token(tok, net)
    layout = pair_layout(tok, TEMPLATE_PRESETS["qwen3"])
    lora.apply_lora(net, RANK, ALPHA, args.lora_dropout, TARGETS)
    ctx = dist.init()
    model, _ = dist.wrap(lm.LMScore(net, lm.token_ids(tok, ("yes", "no"))), net, ctx)
    opt = optim.build_optimizer(optim.param_groups(net, 0.01), LR)
    sched = optim.build_scheduler(opt, 0, 1000, "constant")
    state = loop.LoopState()
    loss_fn = functools.partial(reranker_loss, n_passages=args.n_passages, loss=RERANK_LOSSES["listwise"])
    collate = functools.partial(rerank_inputs, tokenizer=tok, layout=layout, max_length=args.max_length,
                                pad_to_multiple_of=8, chunk_tokens=args.chunk_tokens)

    def step(queries, groups):
        inputs = collate(queries, groups)
        sums = loop.StepSums(ctx.device)
        sums.add(inputs, *loop.plain_step(model, inputs, loss_fn, 1, True, autocast=("cpu", autocast_dtype(args))))
        loop.finish_step(model, opt, sched, state, sums, False, 1.0, 5)
        return int(inputs["pairs"].batch["attention_mask"].sum())
    return step, net


def reference_ids(tok, query, passage, max_length):
    """Qwen3-Reranker's model-card formatting: prefix ids + the body cut to fit + suffix ids."""
    template = TEMPLATE_PRESETS["qwen3"]
    head, rest = template.split("<Instruct>", 1)
    body_t, tail = ("<Instruct>" + rest).split("<|im_end|>\n<|im_start|>assistant", 1)
    prefix = tok(head, add_special_tokens=False)["input_ids"]
    suffix = tok("<|im_end|>\n<|im_start|>assistant" + tail, add_special_tokens=False)["input_ids"]
    body = tok(body_t.format(query=query, passage=passage), add_special_tokens=False, truncation=True,
               max_length=max_length - len(prefix) - len(suffix))["input_ids"]
    return prefix + body + suffix


def make_bare(model_dir, args, tok):
    """The bare transformers + peft loop: step(queries, groups) -> real tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    net = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                         LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=args.lora_dropout,
                                                                 target_modules=list(TARGETS)))
    net.train()
    yes, no = lm.token_ids(tok, ("yes", "no"))
    trained = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR, weight_decay=0.01, fused=True)

    def step(queries, groups):
        ids = [reference_ids(tok, q, p, args.max_length) for q, g in zip(queries, groups) for p in g]
        batch = tok.pad({"input_ids": ids}, return_tensors="pt")
        with torch.autocast("cpu", dtype=autocast_dtype(args), enabled=autocast_dtype(args) is not None):
            logits = net(**batch, logits_to_keep=1).logits[:, -1].float()
        scores = (logits[:, yes] - logits[:, no]).view(len(queries), -1)
        loss = torch.nn.functional.cross_entropy(scores, torch.zeros(len(queries), dtype=torch.long))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return int(batch["attention_mask"].sum())
    return step


def st_times(model_dir, args, tok, work):
    """CrossEncoderTrainer for --warmup + --steps steps on `work`; its step times (end to end)."""
    from peft import LoraConfig, get_peft_model
    from sentence_transformers.cross_encoder import CrossEncoder as STCrossEncoder, CrossEncoderTrainer
    from sentence_transformers.cross_encoder.losses import ListNetLoss
    from sentence_transformers.cross_encoder.training_args import CrossEncoderTrainingArguments

    from bench.bench_peer import st_train

    model = STCrossEncoder(model_dir, max_length=args.max_length, device="cpu")
    model.tokenizer.chat_template = reranker_chat_template(pair_layout(tok, TEMPLATE_PRESETS["qwen3"]),
                                                           model.tokenizer.chat_template)
    # peft's adapters on its causal LM (get_peft_model: transformers' add_adapter wants peft >= 0.22, the
    # test extra holds 0.21)
    model[0].model = get_peft_model(model[0].model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=args.lora_dropout,
                                                               target_modules=list(TARGETS)))
    rows = {"query": [], "docs": [], "labels": []}
    for queries, groups in work:
        for q, group in zip(queries, groups):
            rows["query"].append(q)
            rows["docs"].append(list(group))
            rows["labels"].append([100.0] + [0.0] * (len(group) - 1))
    return st_train(CrossEncoderTrainer, CrossEncoderTrainingArguments, model, rows, ListNetLoss(model),
                    args.batch_size, len(work), LR, bf16=args.compute_dtype == "bf16")


def profile_kit(step, work, top):
    """The kit's step under torch.profiler: the ops with the most self CPU time, and the collate share."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for queries, groups in work:
            with record_function("kit_step"):
                step(queries, groups)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top), file=sys.stderr)


def one_block(side, model_dir, args):
    """This process is one block of one side: its step times, real tokens and memory, as JSON."""
    torch.manual_seed(0)
    tok = tokenizer_of(model_dir)
    work = batches(args)
    if side == "kit":
        keep_freed_memory()
    reset_peak_rss()
    base = current_rss_mb()
    times, tokens = [], []
    if side == "st":
        times = st_times(model_dir, args, tok, work)
    else:
        step = make_kit(model_dir, args, tok)[0] if side == "kit" else make_bare(model_dir, args, tok)
        for queries, groups in work:
            t0 = time.perf_counter()
            tokens.append(step(queries, groups))
            times.append(time.perf_counter() - t0)
        if side == "kit" and args.profile:
            profile_kit(step, work[:2], 20)
    return {"times": times, "tokens": tokens, "peak_rss_mb": peak_rss_mb(), "step_mb": peak_rss_mb() - base}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a causal-LM dir (python scripts/build_smollm2.py prints one)")
    ap.add_argument("--train-file", default=os.path.join(ROOT, "data", "train.jsonl"))
    ap.add_argument("--batch-size", type=int, default=2, help="queries per step")
    ap.add_argument("--n-passages", type=int, default=4, help="pairs per query: 1 positive + n-1 negatives")
    ap.add_argument("--max-length", type=int, default=192, help="tokens per pair (the kit's --rerank-max-length)")
    ap.add_argument("--chunk-tokens", type=int, default=0, help="the kit's --chunk-tokens (default 0: one forward)")
    ap.add_argument("--compute-dtype", choices=("fp32", "bf16"), default="bf16", help="every side's compute dtype")
    ap.add_argument("--lora-dropout", type=float, default=0.1, help="every side's LoRA dropout (default 0.1)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each block")
    ap.add_argument("--blocks", type=int, default=2, help="blocks per side (default 2)")
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    ap.add_argument("--profile", action="store_true", help="the kit's blocks also profile two steps (stderr)")
    ap.add_argument("--only", choices=SIDES, help="(internal) run one block of one side, print it as JSON")
    args = ap.parse_args()
    if args.only:
        print(json.dumps(one_block(args.only, args.model, args)))
        return
    times, tokens, mem = {s: [] for s in args.sides}, [], {}
    for _ in range(args.blocks):
        for side in args.sides:
            out = subprocess.run([sys.executable, sys.argv[0], "--only", side] + sys.argv[1:], capture_output=True,
                                 text=True)
            if out.returncode:
                raise SystemExit(f"{side} block failed:\n{out.stderr[-3000:]}")
            if args.profile and side == "kit":
                print(out.stderr[out.stderr.find("-----"):], file=sys.stderr)
            block = json.loads(out.stdout.strip().splitlines()[-1])
            times[side] += block["times"][args.warmup:]
            if side != "st":
                tokens += block["tokens"][args.warmup:]
            if block["peak_rss_mb"] > mem.get(side, {}).get("peak_rss_mb", 0):
                mem[side] = block
    from transformers import AutoConfig

    net = lm.load(args.model)
    lora.apply_lora(net, RANK, ALPHA, args.lora_dropout, TARGETS)
    flops = statistics.median(tokens) * log.flops_per_token(net) if tokens else float("nan")
    peak = matmul_peak(AutoConfig.from_pretrained(args.model),
                       dtype=torch.bfloat16 if args.compute_dtype == "bf16" else torch.float32)
    print(f"model {args.model}, LoRA r{RANK} on {','.join(TARGETS)}, qwen3 template, {args.batch_size} queries x "
          f"{args.n_passages} pairs, max length {args.max_length} (median {statistics.median(tokens) if tokens else 0:.0f} "
          f"real tokens per step), {args.blocks} x {args.steps} timed steps per side, compute {args.compute_dtype}, threads "
          f"{torch.get_num_threads()}")
    med = {s: statistics.median(t) for s, t in times.items()}
    print(f"{'':22} {'median step s':>14} {'peak RSS MB':>12} {'step MB':>8} {'useful GFLOP/s':>15} {'of peak':>8}")
    for s in args.sides:
        print(f"{s:22} {med[s]:14.3f} {mem[s]['peak_rss_mb']:12.0f} {mem[s]['step_mb']:8.0f} "
              f"{flops / med[s] / 1e9:15.1f} {100 * flops / med[s] / 1e9 / peak:7.0f}%")
    for s in args.sides:
        if s != "kit":
            print(f"kit / {s}: {med['kit'] / med[s]:.3f} (step time), "
                  f"{mem['kit']['peak_rss_mb'] / mem[s]['peak_rss_mb']:.3f} (peak RSS)")
    print(f"{args.compute_dtype} matmul peak at the model's shapes: {peak:.1f} GFLOP/s")


if __name__ == "__main__":
    main()

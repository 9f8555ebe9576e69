"""2-rank checks of the distributed maths, launched by tests/test_dist.py under torchrun.

Every check compares a wrapped, 2-rank run against an independent reference computed in this
same process without any wrapper or collective: one model, the whole global batch. Rank 0
writes {check: {metric: value}} to OUT/results.json; the pytest side asserts the tolerances. Each
check's name is the key written here (`compare("ddp_vs_single", ...)`, `results["sharded_encoding"]`)
and the test that asserts it names the same key, so `grep -n KEY tests/dist_worker.py` finds it.

    torchrun --nproc_per_node=2 tests/dist_worker.py TINY_MODEL_DIR TRAIN_JSONL OUT_DIR
"""

import atexit
import copy
import json
import os
import string
import sys

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers import AutoTokenizer  # noqa: E402

from retrieval_kit import ckpt, data, dist, lora, loop, optim, precision  # noqa: E402
from retrieval_kit.records import read_records  # noqa: E402
from retrieval_kit.chunking import chunk_batch  # noqa: E402
from retrieval_kit.collate import collate_biencoder, collate_rerank  # noqa: E402
from retrieval_kit.heads.multi_vector import maxsim_sides  # noqa: E402
from retrieval_kit.ema import EMA  # noqa: E402
from retrieval_kit.heads import classifier, csr, multi_vector, single_vector, sparse  # noqa: E402
from retrieval_kit.heads.single_vector import BiEncoder  # noqa: E402
from retrieval_kit.losses import contrastive_loss, listwise_loss  # noqa: E402
from retrieval_kit.models import load_encoder  # noqa: E402

B, N, TEMP = 4, 3, 0.05  # queries per rank, passages per group
# Adam's first steps move each weight by about lr * sign(grad): a grad that is ~0 in both runs can
# differ in sign by rounding, so a weight can differ by up to 2 * lr. A small lr keeps that under
# the 1e-6 weight tolerance; the grads themselves are compared too.
LR = 1e-5


def batches(tok, records, n_steps, world, start=0):
    """Global batches of world*B queries: (queries, groups) lists, rank-major like data.rank_batch."""
    out = []
    for s in range(start, start + n_steps):
        recs = records[s * world * B:(s + 1) * world * B]
        out.append(([r.query for r in recs], [data.fixed_group(r, N) for r in recs]))
    return out


def full_grads(module):
    """Param name -> full gradient (DTensor shards gathered), before clipping."""
    out = {}
    for name, p in module.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = g.detach().clone()
    return out


def bi_step(model, opt, tok, queries, groups, gather, label_offset, max_norm, use_buckets=False, accum=1, grads=None,
            grad_cache=0, ema=None):
    """One optimizer step over `accum` micro-batches of this rank's queries through the scripts'
    forward/backward seam (loop.plain_step, or loop.grad_cache_step with chunks of `grad_cache`
    tokens); returns (mean loss, grad norm)."""
    per = len(queries) // accum
    total = 0.0
    fwd_bwd = loop.grad_cache_step if grad_cache else loop.plain_step

    def loss_fn(out):
        if LOSS_KW:  # the training signals beside InfoNCE (issue 64): the script's loss, with the guide's embeddings
            return signal_loss(out, frozen_reps, dist.negative_gathers(gather, label_offset(per)))
        p_all = dist.gather_with_grad(out["p"]) if gather else out["p"]
        loss = contrastive_loss(out["q"], p_all, N, TEMP, True, label_offset(per) if gather else 0, scores=HEAD[0].scores)
        if REG:  # --head sparse: FLOPS of every rank's queries and passages
            loss = loss + REG[0](dist.gather_with_grad(out["q"]) if gather else out["q"], p_all)[0]
        return loss, None
    for m in range(accum):
        qb, pb = collate_biencoder(tok, queries[m * per:(m + 1) * per], groups[m * per:(m + 1) * per], 16, 32,
                                   sides=SIDES)
        inputs = {"q": chunk_batch(qb, grad_cache), "p": chunk_batch(pb, grad_cache)}
        frozen_reps = loop.with_guide(inputs, FROZEN.get("guide"), FROZEN.get("teacher"))  # (chunk by chunk)
        loss, _ = fwd_bwd(model, inputs, loss_fn, accum, m == accum - 1)
        total += loss.item() / accum
    if grads is not None:
        grads.update(full_grads(dist.unwrap(model).encoder))
    norm = dist.clip_grad_norm(model, max_norm, use_buckets).item()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if ema is not None:
        ema.update()
    return total, norm


def bi_model(enc):
    """The module the head of the checks under way runs (HEAD): BiEncoder, LateInteraction (token vectors,
    padded to collate_biencoder's max lengths below), Splade (vocabulary-sized vectors)."""
    return HEAD[0].embedder(enc, SETTINGS)


def signal_loss(out, frozen_reps, gathers):
    """losses.biencoder_loss with the signal keywords of the checks under way (LOSS_KW) and the frozen
    models' embeddings of this batch (loop.with_guide: "guide", "teacher_embeddings"): (loss, None)."""
    from retrieval_kit.losses import biencoder_loss

    loss, _, counts = biencoder_loss(out, n_passages=N, temperature=TEMP, scores=HEAD[0].scores,
                                     guide=frozen_reps.get("guide"), guide_scores=HEAD[0].scores,
                                     teacher_embeddings=frozen_reps.get("teacher_embeddings"), **gathers, **LOSS_KW)
    COUNTS.append(counts.get("false_negatives_masked", torch.zeros(())).item())
    return loss, None


LOSS_KW, FROZEN, COUNTS = {}, {}, []  # biencoder_loss's signal keywords, a frozen guide / teacher, masked counts
HEAD, REG = [single_vector], []  # the head under test; sparse: its regularizer, FLOPS at full weight (no warm-up)
EMAS = []  # the EMA of each run (None without), the last one last
SETTINGS = {"pooling": "avg", "normalize": True, "query_max_length": 16, "passage_max_length": 32}
SIDES = {}  # the multi-vector tokenization (heads/multi_vector.maxsim_sides): set for the ColBERT-style checks


def reference_bi(enc0, tok, steps, max_norm, accum=1, world=2, ema=None):
    """One process, no wrapper: micro-batch m of the global batch = every rank's micro-batch m. `ema`: a
    decay, an EMA kept (EMAS[-1])."""
    enc = copy.deepcopy(enc0)
    model = bi_model(enc)
    opt = optim.build_optimizer(optim.param_groups(enc, 0.01), LR)
    average = EMA(enc, ema) if ema else None
    EMAS.append(average)
    losses, norms, grads = [], [], {}
    for queries, groups in steps:
        per_rank = len(queries) // world
        per = per_rank // accum
        total = 0.0
        for m in range(accum):
            idx = [r * per_rank + m * per + i for r in range(world) for i in range(per)]
            qb, pb = collate_biencoder(tok, [queries[i] for i in idx], [groups[i] for i in idx], 16, 32, sides=SIDES)
            out = model(q=qb, p=pb)
            if LOSS_KW:
                frozen_reps = loop.with_guide({"q": qb, "p": pb}, FROZEN.get("guide"), FROZEN.get("teacher"))
                loss = signal_loss(out, frozen_reps, {})[0]
            else:
                loss = contrastive_loss(out["q"], out["p"], N, TEMP, True, scores=HEAD[0].scores)
            if REG:
                loss = loss + REG[0](out["q"], out["p"])[0]
            (loss / accum).backward()
            total += loss.item() / accum
        if not grads:
            grads.update(full_grads(enc))
        norms.append(dist.clip_grad_norm(model, max_norm).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if average is not None:
            average.update()
        losses.append(total)
    return enc, losses, norms, grads


def max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def rel_norm(a, b):
    """|a - b| / |b| over all the grads of two {name: grad} dicts."""
    num = sum(((a[k].float() - b[k].float()) ** 2).sum().item() for k in b)
    return (num / sum((b[k].float() ** 2).sum().item() for k in b)) ** 0.5


def rank_spread(enc):
    """Max difference of the full params between ranks (0 when replicas agree)."""
    flat = torch.cat([v.float().flatten() for v in ckpt.full_state_dict(enc, all_ranks=True).values()])
    parts = [torch.empty_like(flat) for _ in range(tdist.get_world_size())]
    tdist.all_gather(parts, flat)
    return max((parts[0] - x).abs().max().item() for x in parts)


def run_bi(ctx, enc0, tok, steps, wrap, gather=True, max_norm=1.0, use_buckets=False, accum=1, kw=None, grad_cache=0,
           ema=None):
    enc = copy.deepcopy(enc0)
    model = bi_model(enc)
    if wrap == "ddp":
        model = dist.wrap_ddp(model, ctx, **(kw or {}))
    elif wrap == "fsdp2":
        model = dist.wrap_fsdp2(model, dist.transformer_layers(enc), **(kw or {}))
    opt = optim.build_optimizer(optim.param_groups(enc, 0.01), LR)
    average = EMA(enc, ema) if ema else None  # (built on the wrapped params: FSDP2's are its shards)
    EMAS.append(average)
    losses, norms, grads = [], [], {}
    for queries, groups in steps:
        mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
        loss, norm = bi_step(model, opt, tok, queries[mine], groups[mine], gather,
                             lambda per: ctx.rank * per * N, max_norm, use_buckets, accum,
                             grads=None if grads else grads, grad_cache=grad_cache, ema=average)
        losses.append(dist.reduce_mean({"loss": loss})["loss"])
        norms.append(norm)
    return enc, losses, norms, grads


def main():
    model_dir, train_file, out_dir = sys.argv[1:4]
    ctx = dist.init()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    records, _ = read_records(train_file, N)
    steps = batches(tok, records, 3, ctx.world_size)
    enc0 = load_encoder(model_dir).eval()  # eval: no dropout, so ranks and reference compute the same
    results = {}

    def compare(name, got, ref, extra=None):
        enc, losses, norms, grads = got
        r_enc, r_losses, r_norms, r_grads = ref
        scale = max(g.abs().max().item() for g in r_grads.values())
        results[name] = {
            "grad_rel_diff": max((grads[k] - r_grads[k]).abs().max().item() for k in r_grads) / scale,
            "param_diff": max_diff(ckpt.full_state_dict(enc, all_ranks=True), ckpt.full_state_dict(r_enc, all_ranks=True)),
            "loss_diff": max(abs(a - b) for a, b in zip(losses, r_losses)),
            "loss_scale": max(abs(b) for b in r_losses),
            "norm_rel_diff": max(abs(a - b) / b for a, b in zip(norms, r_norms)),
            "rank_spread": rank_spread(enc), "param_dtypes": sorted({str(p.dtype) for p in enc.parameters()}),
            **(extra or {})}

    # ----- DDP and FSDP2 on 2 ranks vs one process with the global batch (gathered negatives) ----
    ref = reference_bi(enc0, tok, steps, 1.0)
    compare("ddp_vs_single", run_bi(ctx, enc0, tok, steps, "ddp"), ref)
    compare("fsdp2_vs_single", run_bi(ctx, enc0, tok, steps, "fsdp2"), ref)
    compare("fsdp2_no_reshard_vs_single",
            run_bi(ctx, enc0, tok, steps, "fsdp2", kw={"reshard_after_forward": False}), ref)
    # every DDP knob: same maths, so same result as the reference
    for name, kw in {"broadcast_buffers_off": {"broadcast_buffers": False},
                     "find_unused": {"find_unused_parameters": True},
                     "static_graph": {"static_graph": True},
                     "bucket_cap_1mb": {"bucket_cap_mb": 1},
                     "grad_as_bucket_view": {"gradient_as_bucket_view": True}}.items():
        compare(f"ddp_{name}", run_bi(ctx, enc0, tok, steps, "ddp", kw=kw), ref)
    # bucket clipping (DDP + gradient_as_bucket_view) with a norm that really clips
    ref_clip = reference_bi(enc0, tok, steps, 0.05)
    compare("ddp_bucket_clip", run_bi(ctx, enc0, tok, steps, "ddp", max_norm=0.05, use_buckets=True,
                                      kw={"gradient_as_bucket_view": True}), ref_clip)
    # gradient accumulation: 2 micro-batches; static graph syncs each micro-batch instead of no_sync
    ref_acc = reference_bi(enc0, tok, steps, 1.0, accum=2)
    compare("ddp_accum2", run_bi(ctx, enc0, tok, steps, "ddp", accum=2), ref_acc)
    compare("ddp_static_graph_accum2", run_bi(ctx, enc0, tok, steps, "ddp", accum=2,
                                              kw={"static_graph": True}), ref_acc)
    compare("fsdp2_accum2", run_bi(ctx, enc0, tok, steps, "fsdp2", accum=2), ref_acc)
    # FSDP2 with bf16 compute: fp32 master weights, replicas agree, close to the fp32 reference
    compare("fsdp2_bf16_compute", run_bi(ctx, enc0, tok, steps, "fsdp2",
                                         kw={"mp_policy": precision.mp_policy(torch.bfloat16)}), ref)
    # FSDP2's bf16 policy: embeddings and logits still fp32, and GradCache gives the plain step's
    # loss and gradients (it re-runs the same bf16 forward per chunk)
    bf16 = {"mp_policy": precision.mp_policy(torch.bfloat16)}
    plain16 = run_bi(ctx, enc0, tok, steps, "fsdp2", kw=bf16)
    cached16 = run_bi(ctx, enc0, tok, steps, "fsdp2", grad_cache=24, kw=bf16)
    results["fsdp2_bf16_grad_cache_vs_plain"] = {  # first step: the weights have not moved apart yet
        "loss_diff": abs(plain16[1][0] - cached16[1][0]), "loss_vs_fp32": abs(plain16[1][0] - ref[1][0]),
        "grad_diff": rel_norm(cached16[3], plain16[3]), "plain_vs_fp32": rel_norm(plain16[3], ref[3]),
        "cached_vs_fp32": rel_norm(cached16[3], ref[3]), "rank_spread": rank_spread(cached16[0]),
        "param_dtypes": sorted({str(p.dtype) for p in cached16[0].parameters()})}
    # GradCache (chunks of 24 padded tokens) with gathered negatives, DDP and FSDP2, with accumulation
    compare("ddp_grad_cache", run_bi(ctx, enc0, tok, steps, "ddp", grad_cache=24), ref)
    compare("fsdp2_grad_cache", run_bi(ctx, enc0, tok, steps, "fsdp2", grad_cache=24), ref)
    compare("ddp_grad_cache_accum2", run_bi(ctx, enc0, tok, steps, "ddp", accum=2, grad_cache=24), ref_acc)
    # the training signals (issue 64): all four loss directions with the Qwen3 rule on the model's own scores;
    # p2q per direction with a frozen guide's masks (another model's weights), relative and absolute margins
    LOSS_KW.update(directions=("q2p", "p2q", "q2q", "p2p"), false_negative_margin=0.0)
    ref_sig = reference_bi(enc0, tok, steps, 1.0)
    results["signals_counts"] = {"masked": sum(COUNTS)}
    compare("signals_ddp_vs_single", run_bi(ctx, enc0, tok, steps, "ddp"), ref_sig)
    compare("signals_fsdp2_grad_cache", run_bi(ctx, enc0, tok, steps, "fsdp2", grad_cache=24), ref_sig)
    guide_enc = copy.deepcopy(enc0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for p in guide_enc.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    FROZEN["guide"] = BiEncoder(guide_enc).eval()
    for name, margin, relative in (("guide_relative", 0.01, True), ("guide_absolute", 0.0, False)):
        LOSS_KW.clear()
        LOSS_KW.update(directions=("q2p", "p2q"), joint=False, guide_margin=margin, guide_relative=relative)
        COUNTS.clear()
        ref_g = reference_bi(enc0, tok, steps, 1.0)
        results[f"{name}_counts"] = {"masked": sum(COUNTS), "loss_vs_unguided": abs(ref_g[1][0] - ref[1][0])}
        compare(f"{name}_ddp_vs_single", run_bi(ctx, enc0, tok, steps, "ddp"), ref_g)
        compare(f"{name}_ddp_grad_cache", run_bi(ctx, enc0, tok, steps, "ddp", grad_cache=24), ref_g)
    # embedding distillation toward a frozen teacher (the guide's weights), beside InfoNCE, cosine metric
    FROZEN["teacher"] = FROZEN.pop("guide")
    LOSS_KW.clear()
    LOSS_KW.update(embedding_weight=2.0, embedding_metric="cosine")
    ref_t = reference_bi(enc0, tok, steps, 1.0)
    results["teacher_vs_plain"] = {"loss_diff": abs(ref_t[1][0] - ref[1][0])}
    compare("teacher_ddp_vs_single", run_bi(ctx, enc0, tok, steps, "ddp"), ref_t)
    compare("teacher_fsdp2_grad_cache", run_bi(ctx, enc0, tok, steps, "fsdp2", grad_cache=24), ref_t)
    LOSS_KW.clear()
    FROZEN.clear()
    # control: without the gather each rank only sees its own passages - the check must notice
    compare("control_no_gather", run_bi(ctx, enc0, tok, steps, "ddp", gather=False), ref)
    # --ema-decay (issue 52): the average on 2 ranks (DDP replicas, FSDP2 shards) = one process's; FSDP2's
    # sharded average saved (gathered) and loaded into another sharded model's average
    reference_bi(enc0, tok, steps, 1.0, ema=0.5)
    ref_ema = EMAS[-1].state_dict()
    for wrap in ("ddp", "fsdp2"):
        got = run_bi(ctx, enc0, tok, steps, wrap, ema=0.5)
        state = EMAS[-1].state_dict()  # (collective under FSDP2)
        results[f"ema_{wrap}_vs_single"] = {"max_diff": max_diff(state, ref_ema), "n": len(state),
                                            "moved": max_diff(state, {k: v for k, v in enc0.state_dict().items()
                                                                      if k in state}),
                                            "sharded": any(hasattr(t, "device_mesh") for t in EMAS[-1].shadow.values())}
        if wrap == "fsdp2":
            other = copy.deepcopy(enc0)
            dist.wrap_fsdp2(bi_model(other), dist.transformer_layers(other))
            restored = EMA(other, 0.5)
            restored.load_state_dict(state)
            results["ema_fsdp2_restored"] = {"max_diff": max_diff(restored.state_dict(), state)}
        del got
    EMAS.clear()  # (a global holding FSDP2 shards would keep their mesh's group alive past main)
    # --head multi-vector: token vectors (and their masks) gathered with their gradients, MaxSim scores
    HEAD[0] = multi_vector
    mv0 = multi_vector.load(model_dir, multi_vector_dim=8, seed=0).eval()
    ref_mv = reference_bi(mv0, tok, steps, 1.0)
    compare("multi_vector_ddp_vs_single", run_bi(ctx, mv0, tok, steps, "ddp"), ref_mv)
    compare("multi_vector_fsdp2_vs_single", run_bi(ctx, mv0, tok, steps, "fsdp2"), ref_mv)
    compare("multi_vector_ddp_grad_cache", run_bi(ctx, mv0, tok, steps, "ddp", grad_cache=24), ref_mv)
    compare("multi_vector_control_no_gather", run_bi(ctx, mv0, tok, steps, "ddp", gather=False), ref_mv)
    # ColBERT's tokenization: [MASK] query expansion (scored, not attended) and the passages' punctuation skiplist
    SIDES.update(maxsim_sides(tok, {"query_expansion": {"attend": False}, "skiplist_words": list(string.punctuation)}))
    ref_cb = reference_bi(mv0, tok, steps, 1.0)
    compare("colbert_ddp_vs_single", run_bi(ctx, mv0, tok, steps, "ddp"), ref_cb)
    compare("colbert_ddp_grad_cache", run_bi(ctx, mv0, tok, steps, "ddp", grad_cache=24), ref_cb)
    results["colbert_vs_plain_maxsim"] = {"loss_diff": abs(ref_cb[1][0] - ref_mv[1][0])}  # the sides are used
    SIDES.clear()
    # --head sparse: vocabulary-sized vectors gathered with their gradients, the FLOPS term over the global batch
    torch.manual_seed(0)
    HEAD[0] = sparse
    REG.append(sparse.Flops([1e-3, 5e-4], 0, None))
    sp0 = sparse.load(model_dir).eval()
    ref_sp = reference_bi(sp0, tok, steps, 1.0)
    compare("sparse_ddp_vs_single", run_bi(ctx, sp0, tok, steps, "ddp"), ref_sp)
    compare("sparse_fsdp2_vs_single", run_bi(ctx, sp0, tok, steps, "fsdp2"), ref_sp)
    compare("sparse_ddp_grad_cache", run_bi(ctx, sp0, tok, steps, "ddp", grad_cache=24), ref_sp)
    REG.clear()
    # --head csr: the training layout (latents, then reconstruction terms) gathered with its gradients, CSRLoss's
    # reconstruction over the global batch (no latent dead yet in these few steps: the counters are per rank)
    HEAD[0] = csr
    REG.append(csr.Reconstruction(0.1, N))
    csr0 = csr.load(model_dir, csr_dim=64, csr_k=8).eval()
    ref_csr = reference_bi(csr0, tok, steps, 1.0)
    compare("csr_ddp_vs_single", run_bi(ctx, csr0, tok, steps, "ddp"), ref_csr)
    compare("csr_fsdp2_vs_single", run_bi(ctx, csr0, tok, steps, "fsdp2"), ref_csr)
    compare("csr_ddp_grad_cache", run_bi(ctx, csr0, tok, steps, "ddp", grad_cache=24), ref_csr)
    HEAD[0] = single_vector
    REG.clear()

    # ----- LoRA (issue 26): adapters on the frozen base, under DDP, FSDP2, GradCache + accumulation and
    # activation checkpointing, vs one process; lora_B drawn non-zero so every adapter gets a gradient
    lora0 = copy.deepcopy(enc0)
    lora.apply_lora(lora0, 4, 8)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in lora0.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    base_grads = lambda got: {"grads_on_base": sum(".lora_" not in k for k in got[3])}  # noqa: E731
    ref_lora, ref_lora_acc = reference_bi(lora0, tok, steps, 1.0), reference_bi(lora0, tok, steps, 1.0, accum=2)
    for name, got, want in (
            ("lora_ddp_vs_single", run_bi(ctx, lora0, tok, steps, "ddp", kw={"static_graph": True}), ref_lora),
            ("lora_fsdp2_vs_single", run_bi(ctx, lora0, tok, steps, "fsdp2"), ref_lora),
            ("lora_fsdp2_accum2", run_bi(ctx, lora0, tok, steps, "fsdp2", accum=2), ref_lora_acc),
            ("lora_ddp_grad_cache_accum2", run_bi(ctx, lora0, tok, steps, "ddp", accum=2, grad_cache=24),
             ref_lora_acc)):
        compare(name, got, want, base_grads(got))
    checkpointed = copy.deepcopy(lora0)
    dist.enable_activation_checkpointing(checkpointed)
    got = run_bi(ctx, checkpointed, tok, steps, "ddp")
    compare("lora_ddp_activation_checkpointing", got, ref_lora, base_grads(got))

    # ----- reranker: DDP on 2 ranks vs one process ------------------------------------------------
    torch.manual_seed(1)
    net0 = classifier.load(model_dir).eval()
    queries, groups = steps[0]

    def rr_run(net, wrap, grad_cache=0):
        model = classifier.Classifier(net, "avg")
        if wrap:
            model = dist.wrap_ddp(model, ctx, static_graph=not grad_cache)
            sl = slice(ctx.rank * B, (ctx.rank + 1) * B)
        else:
            sl = slice(0, len(queries))
        opt = optim.build_optimizer(optim.param_groups(net, 0.01), LR)
        batch = collate_rerank(tok, queries[sl], groups[sl], max_length=48)
        if grad_cache:
            loss, _ = loop.grad_cache_step(model, {"pairs": chunk_batch(batch, grad_cache)},
                                           lambda out: (listwise_loss(out["pairs"], N), None), 1, True)
        else:
            loss = listwise_loss(model(pairs=batch)["pairs"], N)
            loss.backward()
        dist.clip_grad_norm(model, 1.0)
        grads = full_grads(net)
        opt.step()
        return net, loss.item(), grads
    r_net, r_loss, r_grads = rr_run(copy.deepcopy(net0), False)
    scale = max(g.abs().max().item() for g in r_grads.values())
    # Some params have a zero true gradient: attention's key bias (softmax over keys ignores it) and,
    # as a listwise loss is blind to a shift of a group's scores, what shifts every score alike (the
    # head's bias, the last LayerNorm's bias under mean pooling). Their computed grad is rounding noise
    # of the size of Adam's eps, which Adam turns into steps of up to LR: their grads are compared,
    # their weights are left out of the weight comparison.
    noise = {k for k, g in r_grads.items() if g.abs().max().item() < 1e-5 * scale}
    for name, gc in (("reranker_ddp_vs_single", 0), ("reranker_ddp_grad_cache_vs_single", 40)):
        d_net, d_loss, d_grads = rr_run(copy.deepcopy(net0), True, gc)
        d_params = {k: v for k, v in ckpt.full_state_dict(d_net, all_ranks=True).items() if k not in noise}
        results[name] = {"param_diff": max_diff(d_params, r_net.state_dict()),
                         "grad_rel_diff": max_diff(d_grads, r_grads) / scale,
                         "loss_diff": abs(dist.reduce_mean({"l": d_loss})["l"] - r_loss),
                         "rank_spread": rank_spread(d_net), "zero_grad_params": sorted(noise)}

    # ----- corpus encoding split over ranks equals one process --------------------------------------
    from retrieval_kit.encode import encode_sharded, encode_texts
    texts = [t for r in records[:37] for t in r.pos][:37]  # 37: the shards differ in size
    whole = encode_texts(BiEncoder(enc0), tok, texts, 48, batch_size=8)
    split = encode_sharded(BiEncoder(enc0), tok, texts, 48, batch_size=8)
    results["sharded_encoding"] = {"max_diff": (whole - split).abs().max().item(), "rows": split.shape[0]}
    fsdp_enc = copy.deepcopy(enc0)
    fsdp_model = dist.wrap_fsdp2(BiEncoder(fsdp_enc), dist.transformer_layers(fsdp_enc))
    results["sharded_encoding_fsdp2"] = {
        "max_diff": (whole - encode_sharded(fsdp_model, tok, texts, 48, batch_size=8)).abs().max().item()}

    # ----- duplicate masking with gathered negatives: 2 ranks mask what one process masks ---------
    from retrieval_kit.collate import biencoder_inputs
    from retrieval_kit.losses import biencoder_loss
    queries, groups = steps[0]
    groups = [list(g) for g in groups]
    groups[B][1] = groups[0][0]  # rank 1's first negative is rank 0's first positive
    groups[1][2] = groups[B + 1][0]  # and the other way round
    collate = dict(tokenizer=tok, query_max_length=16, passage_max_length=32)

    def masked(qs, gs, gather, offset):
        batch = biencoder_inputs(qs, gs, **collate)
        with torch.no_grad():
            out = BiEncoder(enc0)(q=batch["q"], p=batch["p"])
        gathers = {"gather": dist.gather, "gather_with_grad": dist.gather_with_grad} if gather else {}
        loss, _, counts = biencoder_loss(out, n_passages=N, temperature=TEMP, label_offset=offset,
                                         p_keys=batch["p_keys"], **gathers)
        return loss.item(), counts["duplicates_masked"].item()
    ref_loss, ref_count = masked(queries, groups, False, 0)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    loss, count = masked(queries[mine], groups[mine], True, ctx.rank * B * N)
    total = dist.all_reduce_sum([loss, count])
    results["masked_gather"] = {"loss_diff": abs(total[0] / ctx.world_size - ref_loss), "count": total[1],
                                "ref_count": ref_count}

    # ----- search split over ranks (each its shard, top k merged) equals one exact search ---------
    from retrieval_kit.search import exact_topk, sharded_topk
    gen = torch.Generator().manual_seed(3)  # the same embeddings on both ranks
    q_all = torch.randn(11, 16, generator=gen)
    worst, same_idx = 0.0, True
    for n_docs, k in ((37, 5), (37, 25), (3, 10), (1, 4)):  # k above a shard's size; rank 1's shard empty
        p_all = torch.randn(n_docs, 16, generator=gen)
        per = -(-n_docs // ctx.world_size)
        own = p_all[ctx.rank * per:(ctx.rank + 1) * per]
        s, i = sharded_topk(q_all, own, min(ctx.rank * per, n_docs), k, n_docs)
        ref_s, ref_i = exact_topk(q_all, p_all, k)
        worst, same_idx = max(worst, (s - ref_s).abs().max().item()), same_idx and torch.equal(i, ref_i)
    results["sharded_topk"] = {"max_diff": worst, "same_indices": same_idx}

    # ----- FSDP2 from the meta device: rank 0 alone loads, the shards get its weights ------------
    import functools
    from retrieval_kit.models import load_once
    for kind, loader in (("biencoder", load_encoder), ("reranker", classifier.load)):
        torch.manual_seed(100 + ctx.rank)  # a fresh head drawn differently on each rank: rank 0's must win
        net, source = load_once(functools.partial(loader, model_dir), True, ctx)
        loaded_bytes = sum(p.numel() * p.element_size() for m in (net, source) if m is not None
                           for p in m.parameters() if not p.is_meta)
        module = BiEncoder(net) if kind == "biencoder" else classifier.Classifier(net, "avg")
        dist.wrap(module, net, ctx, parallel="fsdp2", source=source)
        full = ckpt.full_state_dict(net, all_ranks=True)
        ref = source.state_dict() if source is not None else None
        diffs = [None]
        if ctx.rank == 0:
            diffs = [max((full[k] - ref[k]).abs().max().item() for k in ref) if full.keys() == ref.keys() else -1.0]
        tdist.broadcast_object_list(diffs, src=0)
        bufs = {n: b.clone() for n, b in net.named_buffers()}
        plain = loader(model_dir)
        results[f"meta_init_{kind}_rank{ctx.rank}"] = {
            "loaded_bytes": loaded_bytes, "value_diff": diffs[0], "rank_spread": rank_spread(net),
            "buffers_equal": all(torch.equal(bufs[n], b) for n, b in plain.named_buffers()),
            "devices": sorted({str(p.device) for p in net.parameters()})}
        if ctx.rank == 0:  # a fresh head differs from rank 0's, the rest is the checkpoint's
            full_size = sum(p.numel() * p.element_size() for p in plain.parameters())
            results[f"meta_init_{kind}_rank0"]["full_bytes"] = full_size
    gathered = [None] * ctx.world_size
    tdist.all_gather_object(gathered, {k: v for k, v in results.items() if k.startswith("meta_init_")})
    for part in gathered:
        results.update(part)

    # ----- saved keys do not depend on the wrapper ------------------------------------------------
    keys = {}
    for wrap in ("none", "ddp", "fsdp2", "compile"):
        enc = copy.deepcopy(enc0)
        model = BiEncoder(enc)
        if wrap == "compile":
            for layer in dist.transformer_layers(enc):
                layer.compile()
            model = dist.wrap_ddp(model, ctx)
        elif wrap == "ddp":
            model = dist.wrap_ddp(model, ctx)
        elif wrap == "fsdp2":
            model = dist.wrap_fsdp2(model, dist.transformer_layers(enc))
        sd = ckpt.full_state_dict(enc, all_ranks=True)
        keys[wrap] = sorted(sd)
        results[f"keys_{wrap}"] = {"value_diff": max_diff(sd, enc0.state_dict()), "n_keys": len(sd)}
    results["keys_identical"] = {"ok": all(keys[w] == sorted(enc0.state_dict()) for w in keys)}

    if ctx.rank == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.cleanup()


def record_threads_at_exit(out_dir):
    """Registered before dist.init() registers dist.release_at_exit, so it runs after it (atexit is
    last in, first out): the threads left when the interpreter starts its teardown."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    with open(os.path.join(out_dir, f"threads_at_exit_rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(sorted(names), f)


if __name__ == "__main__":
    if os.path.isdir("/proc/self/task"):
        atexit.register(record_threads_at_exit, sys.argv[3])
    main()

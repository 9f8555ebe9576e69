"""GPU check: what the kit does on a CUDA machine, in one run of under 10 minutes on one GPU.

    bash bench/gpu_check.sh                      # every part (= python -m bench.gpu_check)
    python -m bench.gpu_check --parts versions,fp16 --json out.json

Without CUDA the GPU-only parts say "skipped (no GPU)" and the others run small (a few steps of
batch 4), so the script itself runs and is tested on a CPU. Parts, in order:

  versions    torch, CUDA, NCCL, transformers; GPU name and memory; backend; what `auto` resolves to
  train       20 steps of each script on the default model and bundled data: finite and falling
              loss, peak GPU memory, median step throughput
  throughput  bi-encoder steps (32 queries x 2 passages, passages up to 256 tokens) for
              --chunk-tokens 0 / 1024 / 8192 x fp32 / TF32 / bf16: median step time, tokens/s,
              peak memory                                                              [GPU only]
  gradcache   first step, plain vs GradCache (dropout on): loss and gradient difference, fp32 and bf16
  fsdp2       --parallel fsdp2 with bf16 compute: the checkpoint's params and AdamW moments are fp32
  resume      SIGKILL after a checkpoint, then --resume auto: final weights against an unbroken
              run (bitwise, else the largest difference); the device the optimizer state loads onto
  compile     --compile under TORCH_LOGS=recompiles: recompilations over 10 steps   [GPU only]
  fp16        --compute-dtype fp16: refused with one message and a non-zero exit, no traceback
  decoder     a config-built Qwen3 of Qwen3-0.6B's shape (random weights) as a last-token bi-encoder,
              full fine-tuning vs LoRA (rank 16), bf16 autocast over fp32 master weights: median step
              time, tokens/s, MFU, peak memory against the memory plan (whose params, grads and AdamW
              state must equal the tensors' bytes); with 2+ GPUs also FSDP2 through the script. On a
              CPU the same code runs a 2-layer, 64-wide Qwen3 for 3 steps (the suite's form)

Each part prints its lines as it goes; a part that fails prints FAIL and the script exits 1.
"""

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

PARTS = ("versions", "train", "throughput", "gradcache", "fsdp2", "resume", "compile", "fp16", "decoder")
GPU_ONLY = {"throughput", "compile"}
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda", 0) if CUDA else torch.device("cpu")
SMALL = [] if CUDA else ["--batch-size", "4", "--val-max-groups", "8"]  # CPU: a few small steps


def say(*parts):
    print(*parts, flush=True)


def run(script, args, env=None, timeout=600):
    """A script as a user runs it: (returncode, stdout, stderr, seconds)."""
    t0 = time.perf_counter()
    # the environment of tests.test_ckpt.launch (the SIGKILLed run): one thread count for every run,
    # or CPU matmuls round differently and a resumed run cannot match an unbroken one
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    out = subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, args)], cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout, env=env)
    return out.returncode, out.stdout, out.stderr, time.perf_counter() - t0


def train_rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["split"] == "train"]


def part_versions(tmp):
    import transformers

    from retrieval_kit import cli, log

    info = log.device_info(DEVICE)
    say(f"  torch {torch.__version__}, transformers {transformers.__version__}, CUDA {torch.version.cuda}, "
        f"backend {'nccl' if CUDA else 'gloo'}")
    say("  accelerator:", json.dumps(info))

    class Auto:
        compute_dtype, tf32, chunk_tokens, num_workers, keep_freed_memory = "auto", None, None, None, None
    a = cli.resolve_device_defaults(Auto(), DEVICE)
    say(f"  auto: --compute-dtype {a.compute_dtype}, --tf32 {a.tf32}, --chunk-tokens {a.chunk_tokens}, "
        f"--keep-freed-memory {a.keep_freed_memory}")
    return {"accelerator": info, "auto": {"compute_dtype": a.compute_dtype, "tf32": a.tf32,
                                          "chunk_tokens": a.chunk_tokens, "keep_freed_memory": a.keep_freed_memory}}


def part_train(tmp):
    steps = 20 if CUDA else 4
    out = {}
    for script in ("train_biencoder.py", "train_reranker.py"):
        run_dir = os.path.join(tmp, "train_" + script[6:-3])
        rc, _, err, secs = run(script, ["--max-steps", steps, "--warmup-steps", 2, "--val-every", 1000,
                                        "--output-dir", run_dir, *SMALL])
        if rc:
            raise RuntimeError(f"{script} exited {rc}: {err[-2000:]}")
        rows = train_rows(run_dir)
        losses = [r["loss"] for r in rows]
        w = max(1, len(losses) // 4)
        r = {"seconds": round(secs, 1), "finite": all(math.isfinite(x) for x in losses),
             "first_loss": round(statistics.mean(losses[:w]), 4), "last_loss": round(statistics.mean(losses[-w:]), 4),
             "samples_per_s": round(statistics.median(x["samples_per_s"] for x in rows[1:] or rows), 1),
             "tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in rows[1:] or rows)),
             "max_memory_gib": rows[-1].get("max_memory_gib") and round(rows[-1]["max_memory_gib"], 2),
             "mfu": rows[-1].get("mfu")}
        r["falling"] = r["last_loss"] < r["first_loss"]
        say(f"  {script}: {steps} steps in {r['seconds']} s; loss {r['first_loss']} -> {r['last_loss']} "
            f"(finite {r['finite']}, falling {r['falling']}); {r['samples_per_s']} queries/s, {r['tokens_per_s']} "
            f"tokens/s, peak {r['max_memory_gib']} GiB, mfu {r['mfu']}")
        if not r["finite"] or (CUDA and not r["falling"]):
            raise RuntimeError(f"{script}: loss not finite or not falling")
        out[script] = r
    return out


def kit_batches(n, batch_size=32, n_passages=2, chunk_tokens=0, seed=0):
    """n bi-encoder micro-batches of the bundled data, as train_biencoder.py builds them."""
    import functools

    from transformers import AutoTokenizer

    from retrieval_kit import data
    from retrieval_kit.collate import biencoder_inputs
    from retrieval_kit.records import read_records
    from retrieval_kit.models import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    records, _ = read_records(os.path.join(ROOT, "data", "train.jsonl"), n_passages)
    collate = functools.partial(biencoder_inputs, tokenizer=tok, query_max_length=32, passage_max_length=256,
                                pad_to_multiple_of=8, chunk_tokens=chunk_tokens)
    dataset = data.StepBatches(records, n_passages, batch_size, 0, 1, seed, collate)
    return [dataset[i] for i in range(n)]


def kit_model(train=True):
    from retrieval_kit.heads.single_vector import BiEncoder
    from retrieval_kit.models import default_model_dir, load_encoder

    torch.manual_seed(0)
    enc = load_encoder(default_model_dir()).to(DEVICE)
    return BiEncoder(enc).train(train), enc


def loss_fn(out, **targets):  # InfoNCE only (the batch's passage keys are not used here)
    from retrieval_kit.losses import contrastive_loss

    return contrastive_loss(out["q"], out["p"], 2, 0.05), None


def part_throughput(tmp):
    from retrieval_kit import loop, optim

    out = {}
    for mode in ("fp32", "tf32", "bf16"):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = mode == "tf32"
        for chunk in (0, 1024, 8192):
            model, enc = kit_model()
            opt = optim.build_optimizer(optim.param_groups(enc, 0.01), 1e-5)
            batches = [{k: v.to(DEVICE) for k, v in b.items()} for b in kit_batches(12, chunk_tokens=chunk)]
            torch.cuda.reset_peak_memory_stats()
            times = []
            for i, b in enumerate(batches):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                loop.plain_step(model, b, loss_fn, 1, True, ("cuda", torch.bfloat16 if mode == "bf16" else None))
                torch.nn.utils.clip_grad_norm_(enc.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                if i >= 3:  # warm-up steps left out
                    times.append(time.perf_counter() - t0)
            tokens = statistics.mean(sum(c.n_tokens for c in b.values()) for b in batches)
            step = statistics.median(times)
            out[f"{mode}/chunk{chunk}"] = r = {"step_ms": round(step * 1e3, 1), "tokens_per_s": round(tokens / step),
                                               "max_memory_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)}
            say(f"  {mode:5} --chunk-tokens {chunk:5}: {r['step_ms']} ms/step, {r['tokens_per_s']} tokens/s, "
                f"peak {r['max_memory_gib']} GiB")
            del model, enc, opt, batches
            torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    return out


def part_gradcache(tmp):
    from retrieval_kit import loop

    out = {}
    batch = {k: v.to(DEVICE) for k, v in kit_batches(1, batch_size=32 if CUDA else 8, chunk_tokens=1024)[0].items()}
    for dtype in (None, torch.bfloat16):
        model, enc = kit_model(train=True)  # dropout on: GradCache replays each chunk's RNG state
        res = []
        for step in (loop.plain_step, loop.grad_cache_step):
            model.zero_grad()
            torch.manual_seed(1)
            loss, _ = step(model, batch, loss_fn, 1, True, (DEVICE.type, dtype))
            res.append((loss.item(), {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}))
        (la, ga), (lb, gb) = res
        scale = max(g.abs().max().item() for g in ga.values())
        name = "bf16" if dtype else "fp32"
        out[name] = r = {"loss_plain": la, "loss_grad_cache": lb, "loss_rel_diff": abs(la - lb) / abs(la),
                         "grad_max_rel_diff": max((ga[k] - gb[k]).abs().max().item() for k in ga) / scale}
        say(f"  {name}: loss {la:.6f} plain, {lb:.6f} GradCache (rel. diff {r['loss_rel_diff']:.1e}); "
            f"largest grad difference {r['grad_max_rel_diff']:.1e} of the largest grad")
        if r["loss_rel_diff"] > 1e-4:
            raise RuntimeError("GradCache and the plain step disagree on the loss")
    return out


def part_fsdp2(tmp):
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    run_dir = os.path.join(tmp, "fsdp2")
    rc, _, err, secs = run("train_biencoder.py", ["--parallel", "fsdp2", "--compute-dtype", "bf16", "--max-steps", 3,
                                                  "--ckpt-every", 3, "--val-every", 1000, "--output-dir", run_dir,
                                                  *SMALL])
    if rc:
        raise RuntimeError(f"FSDP2 run exited {rc}: {err[-2000:]}")
    ckpt_dir = os.path.join(run_dir, "step_000003")
    with safe_open(os.path.join(ckpt_dir, "model.safetensors"), "pt") as f:
        params = sorted({str(f.get_slice(k).get_dtype()) for k in f.keys()})
    meta = dcp.FileSystemReader(os.path.join(ckpt_dir, "optimizer_dcp")).read_metadata()
    moments = sorted({str(m.properties.dtype) for k, m in meta.state_dict_metadata.items()
                      if hasattr(m, "properties") and ("exp_avg" in k)})
    rows = train_rows(run_dir)
    r = {"seconds": round(secs, 1), "param_dtypes": params, "moment_dtypes": moments,
         "losses": [round(x["loss"], 4) for x in rows], "max_memory_gib": rows[-1].get("max_memory_gib")}
    say(f"  FSDP2 + bf16 compute, 3 steps in {r['seconds']} s: params {params}, AdamW moments {moments}, "
        f"losses {r['losses']}, peak {r['max_memory_gib']} GiB")
    if moments != ["torch.float32"] or params not in (["F32"], ["torch.float32"]):
        raise RuntimeError("FSDP2 with bf16 compute did not keep fp32 params and moments")
    return r


def part_resume(tmp):
    from retrieval_kit import ckpt, optim
    from tests.golden import weights_hash
    from tests.test_ckpt import kill_after_checkpoint, launch

    args = ["--lr-schedule", "constant", "--ckpt-every", 3, "--val-every", 1000, *SMALL]
    whole, broken = os.path.join(tmp, "whole"), os.path.join(tmp, "broken")
    rc, _, err, _ = run("train_biencoder.py", ["--max-steps", 6, "--output-dir", whole, *args])
    if rc:
        raise RuntimeError(f"unbroken run exited {rc}: {err[-2000:]}")
    proc = launch("train_biencoder.py", ["--max-steps", 100000, "--output-dir", broken, *args])
    rc, _, _ = kill_after_checkpoint(proc, os.path.join(broken, "step_000003"), signal.SIGKILL)
    rc2, _, err, _ = run("train_biencoder.py", ["--max-steps", 6, "--output-dir", broken, "--resume", "auto", *args])
    if rc2:
        raise RuntimeError(f"resumed run exited {rc2}: {err[-2000:]}")
    a, b = (os.path.join(d, "final", "model.safetensors") for d in (whole, broken))
    bitwise = weights_hash(a) == weights_hash(b)
    from safetensors.torch import load_file

    wa, wb = load_file(a), load_file(b)
    diff = max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)
    # where the optimizer state of a checkpoint lands when loaded for a model on this device
    model, enc = kit_model()
    opt = optim.build_optimizer(optim.param_groups(enc, 0.01), 1e-5)
    ckpt.load_optimizer(opt, os.path.join(broken, "step_000003"))
    devices = sorted({str(v.device) for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"})
    r = {"killed_rc": rc, "bitwise": bitwise, "max_weight_diff": diff, "optimizer_state_devices": devices,
         "param_device": str(next(enc.parameters()).device)}
    say(f"  SIGKILL after step 3 (rc {rc}), --resume auto to step 6: final weights bitwise equal to the unbroken "
        f"run: {bitwise} (largest difference {diff:.1e}); optimizer state loaded onto {devices}, params on "
        f"{r['param_device']}")
    if devices != [r["param_device"]]:
        raise RuntimeError("the optimizer state did not land on the params' device")
    return r


def part_compile(tmp):
    run_dir = os.path.join(tmp, "compile")
    rc, _, err, secs = run("train_biencoder.py", ["--compile", "--max-steps", 10, "--val-every", 5, "--output-dir",
                                                  run_dir], env={"TORCH_LOGS": "recompiles"})
    if rc:
        raise RuntimeError(f"--compile run exited {rc}: {err[-2000:]}")
    recompiles = [line for line in err.splitlines() if "Recompiling" in line]
    r = {"seconds": round(secs, 1), "recompilations": len(recompiles), "first": recompiles[:3]}
    say(f"  --compile, 10 steps + 3 validations in {r['seconds']} s: {len(recompiles)} recompilations")
    for line in recompiles[:5]:
        say("    " + line.strip()[:200])
    return r


def part_fp16(tmp):
    rc, out, err, _ = run("train_biencoder.py", ["--compute-dtype", "fp16", "--max-steps", 1,
                                                 "--output-dir", os.path.join(tmp, "fp16")])
    message = (err.strip().splitlines() or [""])[-1]
    r = {"returncode": rc, "traceback": "Traceback" in err, "message": message}
    say(f"  --compute-dtype fp16: exit {rc}, traceback {r['traceback']}: {message}")
    if rc == 0 or r["traceback"]:
        raise RuntimeError("fp16 was not refused cleanly")
    return r


def qwen3_config(small):
    """Qwen3-0.6B's shape (its published config: 28 layers, 1024 wide, 16 query / 8 KV heads of 128,
    MLP 3072, vocabulary 151,936, tied embeddings), or a 2-layer, 64-wide one for a CPU."""
    from transformers import Qwen3Config

    if small:
        return Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0)


def decoder_batch(vocab, n_queries, n_passages, q_len, p_len, gen):
    """Random token ids, left-padded, as a decoder bi-encoder's collate gives them (each row's last token
    real; one chunk per side); lengths drawn between half and all of the maximum."""
    from retrieval_kit.chunking import chunk_batch

    def side(rows, length):
        ids = torch.randint(3, vocab, (rows, length), generator=gen)
        mask = torch.ones_like(ids)
        for i, n in enumerate(torch.randint(length // 2, length + 1, (rows,), generator=gen).tolist()):
            mask[i, :length - n] = 0
        return chunk_batch({"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}, 0).to(DEVICE)
    return {"q": side(n_queries, q_len), "p": side(n_queries * n_passages, p_len)}


def part_decoder(tmp):
    from transformers import AutoModel

    from retrieval_kit import log, lora, loop, optim, plan
    from retrieval_kit.heads.single_vector import BiEncoder
    from tests.test_plan import real_bytes

    small = not CUDA
    steps, (nq, npass, ql, pl) = (3, (4, 2, 16, 32)) if small else (10, (32, 2, 64, 256))
    peak = (log.device_info(DEVICE) or {}).get("peak_bf16_tflops")
    out = {}
    for mode in ("full", "lora"):
        torch.manual_seed(0)
        enc = AutoModel.from_config(qwen3_config(small)).to(DEVICE)  # fp32 master weights
        if mode == "lora":
            lora.apply_lora(enc, 16, 32)
        planned = plan.memory_plan(enc)
        model = BiEncoder(enc, "last").train()
        opt = optim.build_optimizer(optim.param_groups(enc, 0.01), 1e-5, fused=True)
        gen = torch.Generator().manual_seed(0)
        batches = [decoder_batch(enc.config.vocab_size, nq, npass, ql, pl, gen) for _ in range(steps)]
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        times, real = [], None
        for i, b in enumerate(batches):
            if CUDA:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loop.plain_step(model, b, loss_fn, 1, True, (DEVICE.type, torch.bfloat16))
            opt.step()
            if real is None:
                real = real_bytes(enc, opt)  # after the first step: grads and AdamW state exist
            opt.zero_grad(set_to_none=True)
            if CUDA:
                torch.cuda.synchronize()
            if i >= min(3, steps - 1):  # warm-up steps left out (on a CPU: all but the last)
                times.append(time.perf_counter() - t0)
        tokens = statistics.mean(b["q"].n_tokens + b["p"].n_tokens for b in batches)
        step = statistics.median(times)
        fpt = log.flops_per_token(enc)
        r = {"params": sum(p.numel() for p in enc.parameters()),
             "trained": sum(p.numel() for p in enc.parameters() if p.requires_grad),
             "step_ms": round(step * 1e3, 1), "tokens_per_s": round(tokens / step),
             "mfu": log.mfu(tokens / step, fpt, peak, 1), "plan_gib": round(planned["total"] / 2 ** 30, 3),
             "plan_equals_tensors": {k: planned[k] for k in ("params", "grads", "optimizer")} == real,
             "max_memory_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2) if CUDA else None}
        say(f"  {mode:4}: {r['params'] / 1e6:.1f}M params, {r['trained'] / 1e6:.2f}M trained; {r['step_ms']} ms/step, "
            f"{r['tokens_per_s']} tokens/s, MFU {r['mfu'] and round(r['mfu'], 3)}; plan {r['plan_gib']} GiB before "
            f"activations (= the tensors: {r['plan_equals_tensors']}), peak {r['max_memory_gib']} GiB")
        if not r["plan_equals_tensors"]:
            raise RuntimeError(f"{mode}: the memory plan {planned} differs from the tensors {real}")
        out[mode] = r
        del model, enc, opt, batches
        if CUDA:
            torch.cuda.empty_cache()
    if CUDA and torch.cuda.device_count() >= 2:
        out["fsdp2"] = decoder_fsdp2(tmp)
    else:
        say("  FSDP2 over GPUs: skipped (fewer than 2 GPUs)")
    return out


def decoder_fsdp2(tmp):
    """The same model through train_biencoder.py on 2 GPUs: FSDP2, bf16 compute, LoRA, left padding + EOS."""
    from transformers import AutoModel, AutoTokenizer

    from retrieval_kit.models import default_model_dir

    model_dir = os.path.join(tmp, "qwen3_shape")
    AutoModel.from_config(qwen3_config(False)).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(model_dir)  # ids below the vocabulary
    run_dir = os.path.join(tmp, "decoder_fsdp2")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          os.path.join(ROOT, "train_biencoder.py"), "--model", model_dir, "--parallel", "fsdp2",
                          "--compute-dtype", "bf16", "--lora-rank", "16", "--max-steps", "10", "--val-every", "1000",
                          "--passage-max-length", "256", "--output-dir", run_dir], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    if out.returncode:
        raise RuntimeError(f"FSDP2 decoder run exited {out.returncode}: {out.stderr[-2000:]}")
    rows = train_rows(run_dir)
    r = {"seconds": round(time.perf_counter() - t0, 1), "tokens_per_s": round(statistics.median(
         x["tokens_per_s"] for x in rows[3:] or rows)), "mfu": rows[-1].get("mfu"),
         "max_memory_gib": rows[-1].get("max_memory_gib")}
    say(f"  FSDP2 on 2 GPUs, LoRA, bf16 compute: {r['tokens_per_s']} tokens/s, MFU {r['mfu']}, peak "
        f"{r['max_memory_gib']} GiB per rank")
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args()
    parts = [p for p in a.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts: unknown {unknown}; choose from {','.join(PARTS)}")
    results, failed, t0 = {}, [], time.perf_counter()
    say(f"gpu_check on {torch.cuda.get_device_name(0) if CUDA else 'CPU (no CUDA device: GPU-only parts skipped)'}")
    with tempfile.TemporaryDirectory() as tmp:
        for part in parts:
            say(f"[{part}]")
            if part in GPU_ONLY and not CUDA:
                say("  skipped (no GPU)")
                results[part] = "skipped (no GPU)"
                continue
            t = time.perf_counter()
            try:
                results[part] = globals()[f"part_{part}"](tmp)
            except Exception as e:  # report and go on: one broken part should not hide the others
                failed.append(part)
                results[part] = {"error": f"{type(e).__name__}: {e}"}
                say(f"  FAIL: {type(e).__name__}: {str(e)[-1500:]}")
            say(f"  ({time.perf_counter() - t:.0f} s)")
    say(f"done in {time.perf_counter() - t0:.0f} s; " + (f"FAILED: {', '.join(failed)}" if failed else "all parts passed"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

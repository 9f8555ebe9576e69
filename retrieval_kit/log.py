"""Run header, tqdm bar, tensorboard scalars and a metrics JSONL (all on rank 0)."""

import json
import math
import os
import platform
import subprocess
import sys
import time

import torch
from tqdm import tqdm

from .flags import writing


def git_hash(path=None):
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path or os.path.dirname(os.path.abspath(__file__)),
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_header(run_args, world_size, device):
    """What a log needs to reproduce its run: argv, args (a dict), git hash, versions, world size, device."""
    import transformers

    return {
        "argv": sys.argv, "args": run_args, "git": git_hash(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "world_size": world_size, "device": str(device),
        "threads": torch.get_num_threads(),
    }


# Dense bf16 tensor-core peak per GPU, TFLOP/s (vendor datasheets, SXM parts where there are
# several); matched against the device name, longest key first. MFU is reported against it.
PEAK_BF16_TFLOPS = {"B200": 2250, "H200": 989, "H100": 989, "GH200": 989, "H800": 989, "A100": 312, "A800": 312,
                    "L40S": 362, "L40": 181, "L4": 121, "A10G": 70, "A10": 125, "A6000": 155, "4090": 165}


def device_info(device):
    """What the run header records of the accelerator: GPU name, memory, capability, CUDA and NCCL
    versions, visible GPUs, and the bf16 peak used for MFU (None when the GPU is not in the table)."""
    if device.type != "cuda":
        return {"type": device.type, "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    props = torch.cuda.get_device_properties(device)
    nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
    name = props.name
    peak = next((v for k, v in sorted(PEAK_BF16_TFLOPS.items(), key=lambda kv: -len(kv[0])) if k in name), None)
    return {"type": "cuda", "name": name, "memory_gib": round(props.total_memory / 2 ** 30, 1),
            "capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl, "visible_gpus": torch.cuda.device_count(),
            "bf16": torch.cuda.is_bf16_supported(), "peak_bf16_tflops": peak}


def flops_per_token(model):
    """Model FLOPs of a training step per (non-pad) token: 6 x the trained params outside embedding
    tables (forward 2N, backward 4N; Kaplan et al. 2020); under LoRA also 4 x the frozen ones (forward,
    and the backward to their inputs). An LM head (applied to two vocabulary rows only) is left out.
    Attention's own FLOPs (which grow with length) and GradCache's extra forward are not counted, so
    the MFU it gives is a lower bound."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) or m is out_emb
            for p in m.parameters()}
    frozen = 4 if getattr(model, "lora", None) else 0  # without LoRA a frozen param is one that does not run
    return sum((6 if p.requires_grad else frozen) * p.numel() for p in model.parameters() if id(p) not in skip)


def mfu(tokens_per_s, flops_per_token, peak_tflops, world_size):
    """Model-FLOPs utilisation of all ranks against `peak_tflops` per rank (None without a peak)."""
    if not peak_tflops or not flops_per_token:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12 * world_size)


def start(run_args, ctx, output_dir, max_steps, start_step, log_every, bar_keys, summary, **header):
    """run_header.json (`run_args`, a dict, plus `header`) and a Logger at `start_step`, on rank 0;
    prints `summary`."""
    full = run_header(run_args, ctx.world_size, ctx.device)
    full.update(header)
    full["accelerator"] = device_info(ctx.device)
    logger = Logger(output_dir, full, max_steps, start_step, enabled=ctx.is_main, bar_keys=bar_keys, log_every=log_every)
    if ctx.is_main:
        print(summary, flush=True)
        if "memory_plan" in header:
            from .plan import describe

            print(describe(header["memory_plan"]), flush=True)
    return logger


def keep_until(path, step):
    """Keep the lines of metrics.jsonl `path` that a run resumed at `step` does not log again: the
    steps before it and its train line (the validation at `step` is run again; a fresh start keeps
    nothing). A line cut short by a kill is dropped. Atomic (tmp + rename)."""
    if not os.path.isfile(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            at = row.get("step") if isinstance(row, dict) else None
            if step and isinstance(at, int) and (at < step or at == step and row.get("split") == "train"):
                kept.append(line if line.endswith("\n") else line + "\n")
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


class Logger:
    """Writes scalars to tensorboard and metrics.jsonl and shows a tqdm bar; a no-op off rank 0."""

    def __init__(self, out_dir, header, total_steps, initial_step=0, enabled=True, bar_keys=(), log_every=1):
        self.enabled, self.total_steps, self.log_every = enabled, total_steps, log_every
        self.flops = (header.get("flops_per_token"), (header.get("accelerator") or {}).get("peak_bf16_tflops"),
                      header.get("world_size", 1))
        self.bar_keys = bar_keys
        self.writer = self.jsonl = self.bar = None
        self.last = {}
        if not enabled:
            return
        from .ckpt import after_failed_write

        self.failed = writing(f"the run's logs in {out_dir}", then=lambda: after_failed_write(out_dir))
        with self.failed:
            self._open(out_dir, header, total_steps, initial_step)

    def _open(self, out_dir, header, total_steps, initial_step):
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "run_header.json"), "w") as f:
            json.dump(header, f, indent=2, default=str)
        # a resumed run rewrites what came after its checkpoint: one line (and one event) per step
        self.writer = SummaryWriter(os.path.join(out_dir, "tb"), purge_step=initial_step + 1 if initial_step else None)
        self.writer.add_text("run_header", "```\n" + json.dumps(header, indent=2, default=str) + "\n```")
        keep_until(os.path.join(out_dir, "metrics.jsonl"), initial_step)
        self.jsonl = open(os.path.join(out_dir, "metrics.jsonl"), "a")
        self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", dynamic_ncols=True)

    def log(self, step, scalars, prefix="train"):
        self.last[prefix] = {"step": step, **scalars}  # the newest of each split (an export's model card)
        scalars = {k: v for k, v in scalars.items() if not isinstance(v, list)}  # (per-query values: `last` only)
        if not self.enabled:
            return
        finite = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in scalars.items()}
        with self.failed:  # a full disk: one sentence (tensorboard's writer thread raises its error here too)
            for k, v in scalars.items():
                self.writer.add_scalar(f"{prefix}/{k}", v, step)
            self.jsonl.write(json.dumps({"step": step, "split": prefix, **finite}) + "\n")  # NaN -> null: valid JSON
            self.jsonl.flush()
        if prefix == "train":
            self.bar.set_postfix({k: f"{scalars[k]:.4g}" for k in self.bar_keys if k in scalars}, refresh=False)

    def log_step(self, step, scalars):
        """After training step `step`: its train scalars every `log_every` steps and at the last; the bar moves on."""
        if step % self.log_every == 0 or step == self.total_steps:
            if "tokens_per_s" in scalars and self.flops[0]:
                scalars = {**scalars, "model_tflops_per_s": scalars["tokens_per_s"] * self.flops[0] / 1e12}
                if self.flops[1]:
                    scalars["mfu"] = mfu(scalars["tokens_per_s"], self.flops[0], self.flops[1], self.flops[2])
            self.log(step, scalars)
        self.advance()

    def advance(self, n=1):
        if self.enabled:
            self.bar.update(n)

    def write(self, msg):
        if self.enabled:
            self.bar.write(msg)

    def log_eval(self, step, metrics, prefix="val", label=None):
        """An evaluation's metrics: logged under `prefix`, and one line under the progress bar."""
        self.log(step, metrics, prefix=prefix)
        self.write(f"step {step}: {label or prefix} " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                                                                 if not isinstance(v, list)))

    def close(self):
        if self.enabled:
            self.bar.close()
            self.writer.close()
            self.jsonl.close()

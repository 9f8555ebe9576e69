"""Process groups, wrapping, reductions, gathers and unwrapping.

`init()` reads torchrun's environment; under plain `python` it creates a world of 1 (gloo on an
in-memory store), so every code path - DDP wrapping, reductions, gathers - is the same in both.
"""

import argparse
import inspect
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self):
        return self.rank == 0


def init():
    """Start the process group: NCCL on CUDA, gloo on CPU; a world of 1 without torchrun."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        local_rank, device, backend = int(os.environ.get("LOCAL_RANK", 0)), torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device)


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def is_main():
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args, **kwargs):
    """print on rank 0 only."""
    if is_main():
        print(*args, **kwargs, flush=True)


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def all_reduce_sum(values):
    """Sum a list of floats over ranks (one collective); returns a list of floats."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_device())
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def reduce_mean(values):
    """Mean over ranks of a dict of floats (one collective for the whole dict)."""
    keys = list(values)
    world = dist.get_world_size() if dist.is_initialized() else 1
    sums = all_reduce_sum([values[k] for k in keys])
    return {k: s / world for k, s in zip(keys, sums)}


def gather_with_grad(t):
    """Concatenate `t` from all ranks in rank order, keeping the autograd graph.

    The backward sums, into each rank's slice, the gradients every rank computed for it. With DDP
    averaging parameter gradients over W ranks, each rank's loss being the mean over its own
    queries gives the gradient of the mean over all W*B queries: the same as one process with
    the global batch.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t
    return torch.cat(torch.distributed.nn.functional.all_gather(t), dim=0)


def add_ddp_args(parser):
    """DistributedDataParallel knobs, forwarded as given (same flags in both scripts)."""
    g = parser.add_argument_group("distributed (DDP)")
    g.add_argument("--broadcast-buffers", action=argparse.BooleanOptionalAction, default=True,
                   help="DDP broadcast_buffers: sync module buffers from rank 0 each forward (default on)")
    g.add_argument("--find-unused-parameters", action="store_true",
                   help="DDP find_unused_parameters: needed when some params get no grad in a step")
    g.add_argument("--static-graph", action="store_true",
                   help="DDP static_graph: the graph is the same every step; lets DDP skip re-discovery")
    g.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket_cap_mb (default 25)")
    g.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="DDP gradient_as_bucket_view: grads are views into the buckets (saves a copy)")
    return g


def wrap_ddp(model, ctx, broadcast_buffers=True, find_unused_parameters=False, static_graph=False,
             bucket_cap_mb=25.0, gradient_as_bucket_view=False):
    """Wrap in DDP with every knob explicit (a world of 1 goes through DDP too).

    torch 2.13 deprecates `broadcast_buffers` for `forward_sync_buffers` (same meaning at forward
    time; buffers are always synced once at init, which is what training wants): the flag maps to
    `forward_sync_buffers` where torch has it, and to `broadcast_buffers` on older torch.
    """
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        buffers = {"forward_sync_buffers": broadcast_buffers}
    else:
        buffers = {"broadcast_buffers": broadcast_buffers}
    return DDP(model, device_ids=device_ids, find_unused_parameters=find_unused_parameters,
               static_graph=static_graph, bucket_cap_mb=bucket_cap_mb,
               gradient_as_bucket_view=gradient_as_bucket_view, **buffers)


def unwrap(model):
    """The plain module under DDP / FSDP / torch.compile wrappers (for attribute access and saving)."""
    while True:
        if isinstance(model, DDP):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model

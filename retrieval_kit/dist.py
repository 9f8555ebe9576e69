"""Process groups, wrapping, reductions, gathers and unwrapping.

`init()` reads torchrun's environment; under plain `python` it creates a world of 1 (gloo on an
in-memory store), so every code path - DDP wrapping, reductions, gathers - is the same in both.
"""

import atexit
import contextlib
import functools
import inspect
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
# Imported before any process group exists, on purpose: its collectives take `group=group.WORLD`
# as a default argument, and torch imports it on the way to FSDP2 / DTensor; imported after
# init_process_group it keeps the world group alive in ten function defaults past
# destroy_process_group (see release_at_exit). The kit no longer calls it (gather_with_grad).
import torch.distributed.nn.functional  # noqa: F401
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


def choose_device(local_rank, local_world_size, device="auto", backend="auto", cuda_available=None,
                  device_count=None):
    """(torch.device, backend) of this process, from its local rank and the --device /
    --dist-backend flags. CUDA index = local_rank % visible devices, so a launcher that gives each
    process one visible GPU (CUDA_VISIBLE_DEVICES per rank) gets cuda:0 everywhere. NCCL needs a GPU
    per process: more local ranks than visible GPUs is refused with the way out, not a hang."""
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    if device == "cuda" and not cuda_available:
        raise SystemExit("--device cuda: no CUDA device is visible to this process")
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise SystemExit("--dist-backend nccl needs CUDA devices; on CPU use gloo (the default there)")
    if device == "cpu":
        return torch.device("cpu"), backend
    count = torch.cuda.device_count() if device_count is None else device_count
    if backend == "nccl" and 1 < count < local_world_size:
        raise SystemExit(f"{local_world_size} processes on this node but {count} visible GPUs: NCCL needs one GPU "
                         f"per process. Start at most {count} per node (--nproc_per_node), or pass --device cpu")
    return torch.device("cuda", local_rank % count), backend


def shared_gpus(hosts_and_gpus):
    """The ranks that share one GPU, from every rank's (host, GPU uuid): [[rank, ...], ...]. With
    one visible GPU per process the index alone cannot tell a per-rank CUDA_VISIBLE_DEVICES from
    several ranks on the only GPU, which NCCL does not allow."""
    by_gpu = {}
    for rank, key in enumerate(hosts_and_gpus):
        by_gpu.setdefault(tuple(key), []).append(rank)
    return [ranks for ranks in by_gpu.values() if len(ranks) > 1]


def _check_one_gpu_per_rank(device):
    import socket

    mine = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    shared = shared_gpus(every)
    if shared:
        raise SystemExit(f"ranks {shared[0]} run on the same GPU ({every[shared[0][0]][0]}: {device}): NCCL needs "
                         "one GPU per process. Start as many processes per node as it has GPUs, or pass --device cpu")


def init(device="auto", backend="auto", timeout_minutes=None):
    """Start the process group (NCCL on CUDA, gloo on CPU, or as --dist-backend says; a world of 1
    on an in-memory store without torchrun) and make this rank's device current (choose_device).
    `timeout_minutes`: how long a collective or barrier waits (--dist-timeout; None = torch's)."""
    import datetime

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    dev, backend = choose_device(local_rank, local_world, device, backend)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    kw = {"timeout": datetime.timedelta(minutes=timeout_minutes)} if timeout_minutes else {}
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend, device_id=dev if backend == "nccl" else None, **kw)
            if backend == "nccl" and dist.get_world_size() > 1:
                _check_one_gpu_per_rank(dev)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
        atexit.register(release_at_exit)
    dump_stacks_on_sigusr1()
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, dev)


def dump_stacks_on_sigusr1():
    """`kill -USR1 PID` makes this process print every thread's Python stack to stderr and go on: a
    run that seems hung says where each rank waits. A handler someone else installed is left alone."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1") and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def seed_all(seed, rank, torch_per_rank=True):
    """Seed python, numpy (seed + rank) and torch (seed + rank, or `seed` on every rank when
    `torch_per_rank` is False, e.g. so a fresh head starts the same everywhere). Data order and
    negative sampling never use these: they come from `seed` alone (data.py)."""
    import random

    import numpy as np

    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank if torch_per_rank else seed)


def peer_failure(e):
    """What an exception says about the other ranks, in words (None: it is not about them): a peer
    that died (its connection reset or closed) or a collective that waited past --dist-timeout."""
    import re

    name, text = type(e).__name__, str(e)
    if not isinstance(e, RuntimeError) and not name.startswith("Dist"):
        return None
    if re.search(r"timed out|timeout", text, re.I) and (name.startswith("Dist") or re.search(r"gloo|nccl|collective",
                                                                                              text, re.I)):
        return "a collective waited past --dist-timeout: another rank hung (stopped or stuck)"
    if re.search(r"Connection (reset|closed) by peer|Broken pipe|Connection refused|communicator was aborted", text):
        return "another rank stopped answering (it died or was killed)"
    if name.startswith("Dist"):
        return f"the process group failed ({text.strip().splitlines()[0] if text.strip() else name})"
    return None


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def release_at_exit():
    """Free the process groups' C++ objects (and so join gloo's worker threads) before the
    interpreter starts tearing itself down. init() registers this with atexit, which runs after
    main() has returned, so the model and optimizer are gone by then.

    destroy_process_group alone does not free them while Python objects still hold the group:
    DTensor's sharding caches keep every FSDP2 DeviceMesh (and its group) alive, and so did the
    function defaults above. A group freed later, during interpreter teardown, aborted a finished
    2-rank FSDP2 run in CI ("terminate called without an active exception", SIGABRT, exit -6
    after the export had been written). tests/test_dist.py checks no gloo thread is left."""
    import gc
    import sys

    cleanup()
    if "torch.distributed.tensor" in sys.modules:  # DTensor's caches, keyed by the mesh
        for obj in gc.get_objects():
            if type(obj) is functools._lru_cache_wrapper and (obj.__module__ or "").startswith("torch.distributed"):
                obj.cache_clear()
        if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):  # its C++ fast path
            torch._C._clear_DTensor_sharding_propagator_cache()
        redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
        if hasattr(redistribute, "clear_redistribute_planner_cache"):  # planners hold their mesh
            redistribute.clear_redistribute_planner_cache()
    gc.collect()


# The one set of rank helpers: a process without a process group is rank 0 of a world of 1.

def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def is_main():
    return rank() == 0


def barrier():
    """Wait for every rank (nothing to wait for in a world of 1)."""
    if world_size() > 1:
        dist.barrier()


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


# ----- a stop asked for during a long evaluation -------------------------------------------------

class Interrupted(Exception):
    """A stop signal arrived during an evaluation: raised by stop_point on every rank at the same batch."""


_stop = {"requested": None}  # the watched signal's `requested()` (ckpt.StopSignal), or None: no stop points


def watch_stop(requested):
    """From now on the evaluations call `requested()` between their batches (stop_point); None: they do not."""
    _stop["requested"] = requested


def stop_point():
    """Between two batches of an evaluation (encoding, pair scoring, fixed groups): raise Interrupted on every
    rank at once when any rank was asked to stop, so a SIGTERM is honoured within a batch, not after a whole
    validation. One small collective under torchrun: every rank reaches the same stop points (the evaluations
    run as many batches on every rank). Nothing at all while no signal is watched (the tools)."""
    requested = _stop["requested"]
    if requested is None:
        return
    asked = float(bool(requested()))
    if world_size() > 1:
        asked = all_reduce_sum([asked])[0]
    if asked:
        raise Interrupted()


def broadcast_object(obj, src=0):
    """Rank `src`'s `obj` on every rank (one pickle; itself in a world of 1)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def reduce_mean(values):
    """Mean over ranks of a dict of floats (one collective for the whole dict)."""
    keys = list(values)
    sums = all_reduce_sum([values[k] for k in keys])
    return {k: s / world_size() for k, s in zip(keys, sums)}


def reduce_mean_tensor(t):
    """Mean over ranks of a device tensor, with no host read (the result stays on the device)."""
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t = t / world_size()
    return t


def gather(t):
    """Concatenate `t` from all ranks in rank order, without a graph (ids, keys, masks)."""
    if world_size() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=0)


def negative_gathers(on, label_offset):
    """losses.biencoder_loss's keywords for every rank's passages as negatives (`on`): the gathers without
    and with a graph, and this rank's label offset (rank * B * n_passages); none, offset 0, when off."""
    return {"gather": gather, "gather_with_grad": gather_with_grad, "label_offset": label_offset} if on else {
        "label_offset": 0}


def gather_with_grad(t):
    """Concatenate `t` from all ranks in rank order, keeping the autograd graph.

    The backward sums, into each rank's slice, the gradients every rank computed for it. With DDP
    averaging parameter gradients over W ranks, each rank's loss being the mean over its own
    queries gives the gradient of the mean over all W*B queries: the same as one process with
    the global batch.
    """
    if world_size() == 1:
        return t
    return _GatherWithGrad.apply(t.contiguous())


class _GatherWithGrad(torch.autograd.Function):
    """all_gather forward; backward: the gradients of the gathered tensor summed over ranks (all_reduce),
    of which each rank keeps its own slice - d(sum of every rank's loss) / d(this rank's rows). Written
    on the plain collectives (gloo and NCCL alike): torch.distributed.nn.functional.all_gather is
    deprecated (a FutureWarning at every 2-rank run), and the functional collectives' autograd gather
    keeps the process group alive past destroy_process_group (gloo's threads then outlive main)."""

    @staticmethod
    def forward(ctx, t):
        parts = [torch.empty_like(t) for _ in range(world_size())]
        dist.all_gather(parts, t)
        ctx.rows = t.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # (autograd may hand the same buffer elsewhere)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[rank() * ctx.rows:(rank() + 1) * ctx.rows]


def enable_activation_checkpointing(model):
    """Non-reentrant activation checkpointing of each layer of a Hugging Face model. transformers 5
    renamed gradient_checkpointing_enable (now a deprecated alias) to activation_checkpointing_enable."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


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


def wrap(module, hf_model, ctx, *, parallel="ddp", activation_checkpointing=False, compile=False, mp_policy=None,
         reshard_after_forward=True, broadcast_buffers=True, find_unused_parameters=False, static_graph=False,
         bucket_cap_mb=25.0, gradient_as_bucket_view=False, source=None):
    """The wrap order of both scripts: activation checkpointing -> compile (each transformer layer
    of `hf_model`, in place, so no `_orig_mod.` in any key) -> FSDP2 (fully_shard each layer, then
    `module`) or DDP (a world of 1 too). Returns (model to train, model to evaluate: DDP's inner
    module, so validation does no DDP bookkeeping). FSDP2 of a model built on the meta device
    (models.load_once): its shards are then filled from `source`, rank 0's loaded copy (materialize)."""
    if activation_checkpointing:
        enable_activation_checkpointing(hf_model)
    if compile:
        for layer in transformer_layers(hf_model):
            layer.compile()
    if parallel == "fsdp2":
        model = wrap_fsdp2(module, transformer_layers(hf_model), mp_policy, reshard_after_forward)
        if any(p.is_meta for p in hf_model.parameters()):
            materialize(model, hf_model, source, ctx.device)
        return model, model
    model = wrap_ddp(module, ctx, broadcast_buffers=broadcast_buffers, find_unused_parameters=find_unused_parameters,
                     static_graph=static_graph, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view)
    return model, model.module


def materialize(model, hf_model, source, device):
    """A model built on the meta device and sharded with fully_shard gets its memory on `device`
    (each rank its shards only) and its values from `source`, the full model rank 0 loaded on the
    CPU (None on the other ranks): set_model_state_dict broadcasts it tensor by tensor from rank 0
    (broadcast_from_rank0) and each rank keeps its shard. Buffers (BERT's position ids, a
    decoder's rotary frequencies: not all in the state dict) are copied on rank 0 and broadcast."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if (source is None) == is_main():
        raise ValueError("materialize: rank 0, and only rank 0, passes the loaded model as `source`")
    model.to_empty(device=device)
    full = source.state_dict() if source is not None else {}
    set_model_state_dict(hf_model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    loaded = dict(source.named_buffers()) if source is not None else {}
    with torch.no_grad():
        for name, buf in hf_model.named_buffers():
            if source is not None:
                buf.copy_(loaded[name])
            if world_size() > 1:
                dist.broadcast(buf, src=0)


def unwrap(model):
    """The plain module under DDP / FSDP / torch.compile wrappers (for attribute access and saving)."""
    while True:
        if isinstance(model, DDP):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def transformer_layers(model):
    """The ModuleList of transformer blocks of an HF model (the largest ModuleList it holds)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"{type(model).__name__}: no ModuleList of layers found to shard")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def embedding_block(model, layers):
    """The largest submodule of `model` that holds the (first) HF model's input embeddings and none
    of its transformer `layers`: BERT's `embeddings` (word, position and type tables + LayerNorm), a
    decoder's `embed_tokens`; None when the model has no input embeddings."""
    hf = next((m for m in model.modules() if hasattr(m, "get_input_embeddings")), None)
    emb = hf.get_input_embeddings() if hf is not None else None
    if emb is None:
        return None
    block = model
    while any(m is layers for m in block.modules()):
        block = next(c for c in block.children() if any(m is emb for m in c.modules()))
    return block


def wrap_fsdp2(model, layers, mp_policy=None, reshard_after_forward=True):
    """fully_shard each transformer layer, then the root (one all-gather per layer, the rest at the root).

    Under a low-precision policy the input embeddings (embedding_block) are sharded on their own and
    kept fp32, as autocast keeps them under DDP: a bf16 embedding table gets a bf16 gradient, and a
    row every token uses (BERT's token type 0) sums hundreds of them in bf16. Measured on a tiny
    BERT, 2 ranks, first step: the plain and GradCache gradients were 15.5% and 3.1% from the fp32
    gradient and 14.7% from each other (relative norm) with bf16 embeddings; 2.3%, 1.8% and 1.5%
    with fp32 ones (tests/test_dist.py). The cost: the gathered table is fp32 (twice the bytes of
    bf16) while a forward or backward uses it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mp_policy": mp_policy or MixedPrecisionPolicy(), "reshard_after_forward": reshard_after_forward}
    block = embedding_block(model, layers)
    if kw["mp_policy"].param_dtype not in (None, torch.float32) and block is not None:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
                    reshard_after_forward=reshard_after_forward)
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def is_fsdp(model):
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def grad_sync(model, sync):
    """Context for one micro-batch: gradients synchronize only when `sync` (the last micro-batch).

    DDP: `no_sync()` on the others. FSDP2: `set_requires_gradient_sync`. DDP with static_graph
    always syncs: `no_sync` under `static_graph=True` trips an internal assert and then silently
    stops all-reducing (pytorch/pytorch#143580), so accumulation there pays one all-reduce per
    micro-batch instead (the gradients are the same).
    """
    if is_fsdp(model):
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if isinstance(model, DDP) and not sync and not model.static_graph:
        return model.no_sync()
    return contextlib.nullcontext()


def ddp_buckets(model):
    """The flat gradient buckets under DDP with gradient_as_bucket_view: grads are views into them,
    so distinct grad storages are the buckets. Returns flat tensors (few and large)."""
    seen, flats = set(), []
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        st = g.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        flats.append(torch.empty(0, dtype=g.dtype, device=g.device).set_(st, 0, (st.nbytes() // g.element_size(),)))
    return flats


def clip_grad_norm(model, max_norm, use_buckets=False):
    """Clip the global grad norm to max_norm (inf = measure only); returns the norm as a 0-d tensor
    on the device (no host read).

    use_buckets (DDP with gradient_as_bucket_view): the norm is taken over the few flat bucket
    tensors instead of every param's grad, and they are scaled in place by min(1, coef) - a
    multiply by exactly 1 when under the threshold, as `clip_grad_norm_` does. Otherwise
    `torch.nn.utils.clip_grad_norm_` (DTensor-aware under FSDP2).
    """
    if use_buckets:
        flats = ddp_buckets(model)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(f, dtype=torch.float32) for f in flats]))
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for f in flats:
            f.mul_(coef.to(f.dtype))
        return norm
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm

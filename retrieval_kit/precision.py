"""Storage dtype, compute dtype (autocast) and optimizer-state dtype checks.

The contract:
- Full-parameter training with torch.optim keeps master weights fp32 by default. Compute may be
  lower precision through autocast (`--autocast-dtype bf16`).
- An explicit storage dtype from the user (`--torch-dtype bf16`) wins.
- `--force-fp32-params` pins params (and so AdamW moments) to fp32, whatever the load dtype.
- Adam moments take the dtype of the params they are created from or loaded into
  (`Optimizer.load_state_dict` casts state to the param dtype), so on resume the model must be
  cast to the storage dtype *before* the optimizer state is loaded.
"""

import contextlib
import functools

import torch

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def parse_dtype(name):
    """'bf16' -> torch.bfloat16; None, '', 'none' and 'auto' -> None."""
    if name is None or name in ("", "none", "auto"):
        return None
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_storage_dtype(torch_dtype=None, force_fp32_params=False, lora=False):
    """The dtype params are stored (and AdamW moments kept) in.

    fp32 unless the user asks otherwise; `force_fp32_params` overrides and conflicts with an
    explicit non-fp32 `torch_dtype`, except under LoRA: there `torch_dtype` is the frozen base's
    and `force_fp32_params` keeps what is trained (adapters, a fresh head) in fp32 (trained_dtype).
    """
    explicit = parse_dtype(torch_dtype)
    if force_fp32_params and not lora:
        if explicit not in (None, torch.float32):
            raise SystemExit(f"--force-fp32-params conflicts with --torch-dtype {torch_dtype}: drop one of them")
        return torch.float32
    return explicit or torch.float32


def trained_dtype(storage, force_fp32_params):
    """The dtype of what LoRA trains (adapters, a fresh head) and their AdamW moments: fp32 under
    --force-fp32-params, else the storage dtype."""
    return torch.float32 if force_fp32_params else storage


def resolve(torch_dtype, force_fp32_params, compute_dtype, parallel, lora=False):
    """(storage dtype, compute dtype or None, autocast dtype or None) from the precision flags: under
    DDP the compute dtype is autocast's; under FSDP2 it is the MixedPrecisionPolicy's (mp_policy)."""
    storage = resolve_storage_dtype(torch_dtype, force_fp32_params, lora)
    compute = parse_dtype(compute_dtype)
    if torch.float16 in (storage, compute):  # issue 16: no loss scaling yet
        flag = f"--torch-dtype {torch_dtype}" if storage == torch.float16 else f"--compute-dtype {compute_dtype}"
        raise SystemExit(f"{flag}: fp16 needs loss scaling (a GradScaler), which the kit does not have yet; without "
                         "it fp16 gradients underflow and overflowing steps stop the run. Use bf16 (or fp32)")
    return storage, compute, compute if parallel == "ddp" else None


def autocast(device_type, dtype):
    """autocast to `dtype` on `device_type` with shared weight casts (SharedCasts), or a no-op
    context when dtype is None.

    Without autocast's own cache of cast weights: with it, every use of a weight inside one context
    shares one bf16 copy *and one autograd node*, so the weight's gradient is summed over the uses
    (queries and passages, every chunk) in bf16 before it reaches the fp32 param. Measured on a tiny
    BERT: plain and GradCache gradients 5.8e-4 apart (4.8e-2 for the reranker) with the cache, 1.6e-7
    without (tests/test_gradcache.py). SharedCasts keeps the one copy but gives each use its own node."""
    if dtype is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device_type=device_type, dtype=dtype, cache_enabled=False))
    stack.enter_context(SharedCasts(device_type, dtype))
    return stack


class _CastUse(torch.autograd.Function):
    """One use of a shared low-precision copy of `weight`: the forward hands back the copy (no new
    memory); the backward casts this use's gradient to the weight's dtype, as autocast's own per-use
    cast (`weight.to(bf16)`, a ToCopy node) does. The weight's gradient is then summed over its uses
    in its own dtype, in the order the uses' nodes run - the same sums as with a cast per use."""

    @staticmethod
    def forward(ctx, weight, low):
        ctx.dtype = weight.dtype
        return low.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


class SharedCasts(torch.overrides.TorchFunctionMode):
    """Inside autocast: each fp32 weight that `F.linear` meets is cast to the autocast dtype once per
    context, not once per use. Without it a step of 8 length chunks casts every linear weight 8 times
    and keeps the 8 copies for the backward: 8 x 2 bytes a parameter (85 MB for MiniLM's reranker at
    4 chunks; 16 GB a chunk for an 8B model). The numbers are bitwise those of a cast per use:
    the copy's values are the same, and the gradient of each use is cast back to fp32 alone
    (_CastUse) before the uses are summed (tests/test_precision.py). Other ops that autocast casts
    (matmul, bmm, ...) and linears under torch.compile keep autocast's cast per use."""

    def __init__(self, device_type, dtype):
        super().__init__()
        self.device_type, self.dtype, self.copies = device_type, dtype, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and len(args) > 1:
            weight = args[1]
            if (isinstance(weight, torch.nn.Parameter) and weight.dtype == torch.float32
                    and weight.device.type == self.device_type and torch.is_autocast_enabled(self.device_type)
                    and not torch.compiler.is_compiling()):
                args = (args[0], self._use(weight)) + tuple(args[2:])
        return func(*args, **kwargs)

    def __exit__(self, *exc):
        self.copies.clear()
        return super().__exit__(*exc)

    def _use(self, weight):
        held = self.copies.get(id(weight))
        if held is None or held[0] is not weight:
            with torch.no_grad():
                held = self.copies[id(weight)] = (weight, weight.to(self.dtype))
        if weight.requires_grad and torch.is_grad_enabled():
            return _CastUse.apply(weight, held[1])
        return held[1]


def add_inference_dtype(parser):
    """--compute-dtype of the inference tools (evaluate, mine, score)."""
    parser.add_argument("--compute-dtype", choices=("none", "bf16"), default="none",
                        help="bf16: the model's forwards under bf16 autocast (pooling, normalizing, search and "
                             "the reranker's head stay fp32): about 2x the texts/s on a GPU or a CPU with "
                             "AVX512-BF16 or AMX, embeddings within ~1e-3 of fp32's (docs/pipeline.md); default "
                             "none = fp32")


def autocast_forward(model, device_type, dtype):
    """`model` with every forward run under autocast to `dtype` (None: unchanged), for inference:
    what the forward returns is used outside autocast (pooled, normalized, searched in fp32)."""
    if dtype is None:
        return model
    check_cpu_bf16(device_type, dtype)
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with autocast(device_type, dtype):
            return inner(*args, **kwargs)
    model.forward = forward
    return model


def mp_policy(compute_dtype):
    """FSDP2 mixed precision: params gathered in `compute_dtype` (None = storage dtype), grads reduced in fp32.
    The sharded params - the master weights the optimizer updates - stay in the storage dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def optimizer_state_dtypes(optimizer):
    """{(param dtype, state dtype)} over the floating tensor state of every param (step excluded)."""
    pairs = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            for name, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.is_floating_point() and name != "step":
                    pairs.add((p.dtype, value.dtype))
    return pairs


def check_optimizer_state_dtype(optimizer):
    """Fail loudly if any fp32 param has non-fp32 moments (the wrong-resume-order bug)."""
    bad = sorted({str(s) for p, s in optimizer_state_dtypes(optimizer) if p == torch.float32 and s != p})
    if bad:
        raise RuntimeError(
            f"optimizer state is {', '.join(bad)} for fp32 params: the state was loaded into "
            "low-precision params. Resume in the order model -> cast to storage dtype -> optimizer.")


def cuda_bf16():
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def cpu_bf16_matmul():
    """The instructions this CPU does bf16 matmuls with ('amx_bf16', 'avx512_bf16'), or None when it
    has neither: there oneDNN converts to fp32 and a bf16 matmul is 10-26x slower than fp32 (AVX2).
    None too when torch runs below its AVX512 kernels (ATEN_CPU_CAPABILITY=avx2 or default on such a
    CPU): its bf16 matmuls then stop with "pack_vnni2 is only supported when avx512 is supported"."""
    if "AVX512" not in torch.backends.cpu.get_cpu_capability():
        return None
    try:
        caps = torch.cpu.get_capabilities()
    except (AttributeError, RuntimeError):  # older torch: the kernel's own flags
        try:
            with open("/proc/cpuinfo") as f:
                caps = dict.fromkeys(f.read().split(), True)
        except OSError:
            return None
    return next((name for name in ("amx_bf16", "avx512_bf16") if caps.get(name)), None)


def cpu_bf16_blocked():
    """This CPU has bf16 matmul instructions but torch runs below its AVX512 kernels
    (ATEN_CPU_CAPABILITY=avx2 or default): some of torch's bf16 matmuls (scoring, evaluation) stop there
    with "pack_vnni2 is only supported when avx512 is supported", so a run is refused at start-up rather
    than midway (a CPU without them converts to fp32 instead, slowly)."""
    if "AVX512" in torch.backends.cpu.get_cpu_capability():
        return False
    caps = getattr(torch.cpu, "get_capabilities", dict)()
    return bool(caps.get("amx_bf16") or caps.get("avx512_bf16"))


def check_cpu_bf16(device_type, dtype):
    """One sentence instead of torch's RuntimeError when bf16 compute is asked for where it cannot run."""
    if device_type == "cpu" and dtype == torch.bfloat16 and cpu_bf16_blocked():
        raise SystemExit(f"--compute-dtype bf16: torch runs its {torch.backends.cpu.get_cpu_capability()} kernels here "
                         "(ATEN_CPU_CAPABILITY) on a CPU with bf16 instructions, where some of its bf16 matmuls fail: unset "
                         "ATEN_CPU_CAPABILITY, or compute in fp32 (--compute-dtype none)")


def set_tf32(enabled, device):
    """fp32 matmuls and convolutions in TF32 on a CUDA device (--tf32); the CPU has no such mode."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(enabled)

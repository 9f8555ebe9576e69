"""Memory plan of a training run, before it runs: bytes per rank of the parameters (by dtype), their
gradients and AdamW's state (two moments in the parameter's dtype, and a float32 step per tensor),
under DDP (every rank holds everything) or FSDP2 (each rank a dim-0 shard, padded: rank 0 holds
ceil(rows / world) rows of each tensor). Activations and the allocator's slack are not counted.

Printed at start-up and kept in the run header (`memory_plan`); for any model dir or config without
training (built on the meta device, no memory):

    python -m retrieval_kit.plan --model PATH --world-size 8 --parallel fsdp2 --torch-dtype bf16
    python -m retrieval_kit.plan --model PATH --lora-rank 16 --torch-dtype bf16 --force-fp32-params
"""

import argparse
import math
from collections import Counter

STEP_BYTES = 4  # AdamW's per-tensor step count: a float32 scalar tensor


def local_numel(shape, world_size=1, parallel="ddp"):
    """Elements of one tensor on rank 0: all of it under DDP; under FSDP2 its dim-0 shard."""
    n = math.prod(shape)
    if parallel != "fsdp2" or world_size == 1 or not shape:
        return n
    return -(-shape[0] // world_size) * (n // shape[0])


def memory_plan(model, world_size=1, parallel="ddp", ema=False):
    """{"parallel", "world_size", "params": {dtype: bytes}, "grads", "optimizer", "ema", "total"}: bytes on
    rank 0 for `model` (its trained parameters: requires_grad) under `parallel` over `world_size`; `ema`
    (--ema-decay): a copy of the trained parameters, sharded like them."""
    params, grads, optimizer, average = Counter(), 0, 0, 0
    for p in model.parameters():  # a tied weight once
        n = local_numel(tuple(p.shape), world_size, parallel)
        size = n * p.element_size()
        params[str(p.dtype).replace("torch.", "")] += size
        if p.requires_grad:
            grads += size
            optimizer += 2 * size + STEP_BYTES
            average += size if ema else 0
    total = sum(params.values()) + grads + optimizer + average
    return {"parallel": parallel, "world_size": world_size, "params": dict(params), "grads": grads,
            "optimizer": optimizer, "ema": average, "total": total}


def describe(plan):
    """One line: what the plan says each rank holds."""
    gib = lambda b: f"{b / 2 ** 30:.2f} GiB" if b >= 2 ** 30 else f"{b / 2 ** 20:.1f} MiB"  # noqa: E731
    params = ", ".join(f"{gib(b)} {dtype}" for dtype, b in plan["params"].items())
    ema = f"; EMA {gib(plan['ema'])}" if plan.get("ema") else ""
    return (f"memory per rank ({plan['parallel']}, world {plan['world_size']}): params {params}; grads "
            f"{gib(plan['grads'])}; AdamW state {gib(plan['optimizer'])}{ema}; total {gib(plan['total'])} before "
            "activations")


SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads")


def defaulted_shape(model_dir, config):
    """{key: value} of the shape settings `config` holds that the dir's config.json does not set (so
    transformers' defaults for the model type filled them in)."""
    import json
    import os

    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            written = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: getattr(config, k) for k in SHAPE_KEYS if k not in written and hasattr(config, k)}


def main(argv=None):
    from . import cli, flags, heads, lora
    from .precision import resolve, trained_dtype

    ap = cli.KitParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=flags.model_path, help="model dir (or a dir holding only its config.json)")
    ap.add_argument("--head", choices=tuple(heads.MODULES), default=None,
                    help="what is trained, as the scripts' --head (default: the model dir's kind, else "
                         f"{heads.EMBEDDING[0]})")
    cli.add_head_args({"model": ap, "loss": ap}, heads.MODULES, only=heads.LOAD_FLAGS)  # e.g. a projection's width
    ap.add_argument("--world-size", type=flags.positive_int, default=1, help="ranks (default 1)")
    ap.add_argument("--parallel", choices=("ddp", "fsdp2"), default="ddp", help="default ddp")
    ap.add_argument("--torch-dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                    help="storage dtype of params and AdamW state, as in the scripts (default auto = fp32)")
    ap.add_argument("--force-fp32-params", action="store_true",
                    help="as in the scripts: fp32 params; with --lora-rank, what is trained in fp32")
    ap.add_argument("--ema", action="store_true", help="count --ema-decay's average of the trained weights")
    g = ap.add_argument_group("LoRA")
    for name in ("--lora-rank", "--lora-targets"):  # the scripts' flags, with their help
        action = next(x for x in cli.biencoder_parser()._actions if name in x.option_strings)
        g.add_argument(name, type=action.type, default=action.default, help=action.help)
    a = ap.parse_args(argv)
    spec = heads.read_spec(a.model)
    head, _ = heads.choose(spec, {"head": a.head}, heads.group_of(a.head or spec.head))
    cli.head_flags(a, head.NAME, "the plan's", spec)  # a flag of another head, or against the dir's: one sentence
    storage, _, _ = resolve(a.torch_dtype, a.force_fp32_params, "none", a.parallel, a.lora_rank > 0)
    model = head.load(a.model, storage, meta=True, spec=spec, **cli.head_load_settings(a, head))
    assumed = defaulted_shape(spec.model_path, model.config)
    if assumed:
        print(f"note: {a.model}/config.json does not set {', '.join(assumed)}: planned with transformers' defaults "
              f"for {model.config.model_type} ({', '.join(f'{k} {v}' for k, v in assumed.items())})")
    lora.apply_each([model], a.lora_rank, train=head.lora_trained, alpha=1.0,
                    targets=tuple(a.lora_targets), dtype=trained_dtype(storage, a.force_fp32_params))
    print(describe(memory_plan(model, a.world_size, a.parallel, a.ema)))
    note = head.memory_note(model)  # multi-vector, sparse: what the plan leaves out
    if note:
        print(note)


if __name__ == "__main__":
    main()

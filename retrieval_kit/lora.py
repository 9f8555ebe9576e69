"""LoRA: low-rank adapters on a frozen base model (Hu et al. 2021, arXiv:2106.09685).

Each targeted nn.Linear y = W x + b becomes y = W x + b + (alpha / r) * B (A dropout(x)), with A
(r x in) drawn like nn.Linear's default and B (out x r) zero, so training starts from the base
model's outputs. The base stays in its storage dtype (bf16 is fine) and gets no gradient and no
optimizer state; the adapters and whatever else is trained (a reranker's fresh head) are kept in
`dtype` (fp32 under --force-fp32-params).

Module and parameter names follow peft's (`q_proj.base_layer.weight`, `q_proj.lora_A.weight`), so
the adapter export is a peft adapter dir that `PeftModel.from_pretrained(base, dir)` loads; the
default export merges the adapters into the base weights (`merged_state_dict`), which every loader
reads. Checkpoints hold only what is trained (`trained_state_dict`), not the base.
"""

import hashlib
import json
import math
import os

import torch

# Llama / Qwen / Mistral attention and MLP projections, and BERT's attention projections
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "query", "key",
                   "value")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what peft's saved keys start with


class LoRALinear(torch.nn.Module):
    """`base_layer` (frozen) plus a rank-r update; same outputs as `base_layer` while lora_B is zero."""

    def __init__(self, base_layer, rank, alpha, dropout=0.0, dtype=torch.float32, generator=None):
        super().__init__()
        self.base_layer, self.rank, self.alpha, self.scaling = base_layer, rank, alpha, alpha / rank
        device = base_layer.weight.device
        self.lora_A = torch.nn.Linear(base_layer.in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = torch.nn.Linear(rank, base_layer.out_features, bias=False, device=device, dtype=dtype)
        self.lora_dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        if device.type != "meta":  # a meta model gets its values from the loaded copy (dist.materialize)
            with torch.no_grad():
                torch.nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)
                torch.nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        out = self.base_layer(x)
        delta = self.lora_B(self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype))))
        return out + (delta * self.scaling).to(out.dtype)


def linear_names(model):
    """The distinct last names of the model's nn.Linear modules (what --lora-targets may list)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n})


def apply_lora(model, rank, alpha, dropout=0.0, targets=DEFAULT_TARGETS, dtype=torch.float32, seed=0, train=()):
    """Freeze `model`, wrap each nn.Linear whose last name is in `targets` in a LoRALinear, and train
    the adapters plus the params in `train` (a fresh head), cast to `dtype`. Each adapter's A is drawn
    from a generator seeded by (seed, module name): the same on every rank and in every world size.
    Returns the LoRA settings (also kept as `model.lora`)."""
    trained = {id(p) for p in train}
    skip = {n for n, m in model.named_modules() if any(id(p) in trained for p in m.parameters(recurse=False))}
    chosen = [(n, m) for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and n and n.rsplit(".", 1)[-1] in targets and n not in skip]
    if not chosen:
        raise SystemExit(f"--lora-targets {','.join(targets)}: no linear layer of {type(model).__name__} is named so; "
                         f"its linear layers are named {', '.join(linear_names(model))}")
    narrow = min(chosen, key=lambda c: min(c[1].in_features, c[1].out_features))
    width = min(narrow[1].in_features, narrow[1].out_features)
    if rank > width:  # A (r x in) and B (out x r) would hold more than the layer they adapt
        raise SystemExit(f"--lora-rank {rank}: above the width of the targeted layer {narrow[0]} ({width}: "
                         f"{narrow[1].in_features} in, {narrow[1].out_features} out); an adapter of that rank is no "
                         f"low-rank update: choose at most {width}, or train every weight (no --lora-rank)")
    model.requires_grad_(False)
    for name, module in chosen:
        digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2 ** 63 - 1))
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(module, rank, alpha, dropout, dtype, gen))
    names = {id(p): n for n, p in model.named_parameters()}
    for p in train:
        p.data = p.data.to(dtype)
        p.requires_grad_(True)
    saved = sorted({names[id(p)].rsplit(".", 1)[0] for p in train})
    for name in saved:  # a head kept in fp32 behind a bf16 base reads the base's states in its own dtype
        model.get_submodule(name).register_forward_pre_hook(_input_in_own_dtype)
    model.lora = {"rank": rank, "alpha": alpha, "dropout": dropout,
                  "targets": sorted({n.rsplit(".", 1)[-1] for n, _ in chosen}), "modules_to_save": saved,
                  "layers": len(chosen)}
    return model.lora


def _input_in_own_dtype(module, args):
    dtype = next(module.parameters()).dtype
    return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def apply_each(models, rank=0, train=None, base_model=None, adapter=False, **kw):
    """apply_lora to each distinct model of `models` (the model to train and, under FSDP2, rank 0's
    loaded copy; None skipped), `train(model)` giving its fully trained params; `base_model` and
    `adapter` (--export-adapter) are kept for the export. rank 0: nothing, returns None."""
    if not rank:
        return None
    info = None
    for m in {id(m): m for m in models if m is not None}.values():
        info = apply_lora(m, rank, train=train(m) if train else (), **kw)
        info.update(base_model=base_model, adapter=adapter)
    return info


def has_lora(model):
    return getattr(model, "lora", None) is not None


def trained_state_dict(model):
    """{name: full CPU tensor} of the params that are trained (requires_grad): a LoRA checkpoint's
    weights. Collective under FSDP2 (each DTensor gathered); every rank gets the tensors."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = t.detach().cpu().contiguous()
    return out


def widest_dtype(state):
    """The widest floating dtype among the tensors of `state` (fp32 over bf16)."""
    return max((v.dtype for v in state.values() if v.is_floating_point()), key=lambda d: torch.finfo(d).bits)


def merged_state_dict(state, lora):
    """A full state dict with LoRA keys (peft's names) turned into the base model's own keys: each
    `X.base_layer.weight` becomes `X.weight` = W + (alpha / r) * B @ A (computed in fp32), `X.base_layer.bias`
    becomes `X.bias`, and the adapter keys go. Every tensor is stored in the widest dtype of the run's
    params (widest_dtype): a bf16 base with fp32 adapters merges into fp32 weights, since rounding
    W + BA to bf16 would round most of a small update away."""
    scaling = lora["alpha"] / lora["rank"]
    dtype = widest_dtype(state)
    out = {}
    for k, v in state.items():
        if ".lora_A." in k or ".lora_B." in k:
            continue
        if ".base_layer." in k:
            prefix, _, leaf = k.partition(".base_layer.")
            if leaf == "weight":
                a, b = state[f"{prefix}.lora_A.weight"].float(), state[f"{prefix}.lora_B.weight"].float()
                v = v.float() + scaling * (b @ a)
            k = f"{prefix}.{leaf}"
        out[k] = v.to(dtype) if v.is_floating_point() else v
    return out


def write_adapter(out_dir, state, lora, base_model, trained_names):
    """A peft LoRA adapter dir: adapter_config.json and adapter_model.safetensors holding the adapters
    and the fully trained modules (`modules_to_save`, e.g. a fresh head), under peft's key names."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file({PEFT_PREFIX + k: state[k] for k in trained_names}, os.path.join(out_dir, ADAPTER_WEIGHTS))
    config = {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": base_model, "r": lora["rank"],
              "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"], "target_modules": lora["targets"],
              "modules_to_save": lora["modules_to_save"] or None,  # full paths: peft matches by suffix
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True}
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir

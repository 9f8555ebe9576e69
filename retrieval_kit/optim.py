"""Param groups, fused AdamW, warmup + decay schedule."""

import math

import torch



def _is_norm(module):
    name = type(module).__name__.lower()
    return isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm)) or "norm" in name


def param_groups(model, weight_decay):
    """Two groups: weights that decay, and biases + norm weights that don't.

    Returns [{"params", "names", "weight_decay"}, ...]; `names` only serves logging and tests
    (torch.optim ignores extra keys and keeps them in the group).
    """
    decay, no_decay = {}, {}
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            target = no_decay if (p_name.endswith("bias") or _is_norm(module)) else decay
            target.setdefault(id(p), (full, p))  # a tied weight is listed once
    seen = set(decay) & set(no_decay)
    for k in seen:
        no_decay.pop(k)
    groups = []
    for params, wd in ((decay, weight_decay), (no_decay, 0.0)):
        if params:
            groups.append({"params": [p for _, p in params.values()],
                           "names": [n for n, _ in params.values()], "weight_decay": wd})
    return groups


def scale_lr(groups, params, lr, mult):
    """Split each param group in two: `params` get lr * mult (an explicit per-group "lr", which the
    schedule scales like the rest), the others keep the optimizer's lr. mult 1 (or None) changes nothing."""
    if mult in (None, 1.0) or not params:
        return groups
    chosen, out = {id(p) for p in params}, []
    for g in groups:
        for pick, extra in ((False, {}), (True, {"lr": lr * mult})):
            idx = [i for i, p in enumerate(g["params"]) if (id(p) in chosen) == pick]
            if idx:
                out.append({**g, "params": [g["params"][i] for i in idx], "names": [g["names"][i] for i in idx], **extra})
    return out


def step_if_finite(optimizer, scheduler, grad_norm, bad_in_a_row, max_bad_steps, step):
    """Optimizer and scheduler step when the global grad norm is finite, else skip the update.

    The norm is global (reduced over ranks), so a non-finite loss or grad on any rank makes every
    rank skip together, and no checkpoint ever holds weights from such an update. Returns the
    number of non-finite steps in a row (0 after an update); stops the run at `max_bad_steps`.
    """
    if math.isfinite(grad_norm):
        optimizer.step()
        scheduler.step()
        bad_in_a_row = 0
    else:
        bad_in_a_row += 1
        if bad_in_a_row >= max_bad_steps:
            raise SystemExit(f"step {step}: {bad_in_a_row} steps in a row with a non-finite loss or grad norm; "
                             "stopping (lower --lr, check the data, or resume from the last checkpoint)")
    optimizer.zero_grad(set_to_none=True)
    return bad_in_a_row


def build_optimizer(groups, lr, betas=(0.9, 0.999), eps=1e-8, fused=True):
    """torch.optim.AdamW with the groups as given; fused by default (16x faster than the loop on CPU)."""
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)


def lr_factor(step, warmup_steps, total_steps, schedule="linear"):
    """Multiplier on the peak LR: linear warmup over warmup_steps, then linear/cosine decay to 0 or constant."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {schedule!r}; choose linear, cosine or constant")


def build_scheduler(optimizer, warmup_steps, total_steps, schedule="linear"):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps, schedule))

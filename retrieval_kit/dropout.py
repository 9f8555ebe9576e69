"""--fast-dropout: dropout masks drawn four at a time from 64-bit random words, kept as 1-byte masks.

On a CPU, torch's dropout draws one random number per element (`bernoulli_`, about 7 ns each here)
and keeps the mask as float32 for the backward pass. With dropout on BERT's attention probabilities
that is the largest cost after the matmuls (docs/benchmarks.md). `lane_dropout` draws one 64-bit
word per four elements and compares each 16-bit lane with a threshold: the drop probability is
round(p * 65536) / 65536 (within 1 / 131072 of p), the mask is a bool tensor, and the draws come from
the device's default generator, so `torch.manual_seed` and gradient caching's RNG replay hold.

It changes the training numbers (another random stream), so it is opt-in: `apply_fast_dropout(model)`
swaps every nn.Dropout of the model for FastDropout and, where the model's attention runs through
transformers' SDPA, routes it through `attention` below: SDPA itself when the dropout is 0 (eval),
else the same maths unfused with the lane mask on the probabilities.
"""

import torch

ATTN_NAME = "kit_fast_dropout"


def lane_mask(shape, p, device):
    """A bool keep-mask of `shape`: each element dropped with probability round(p * 65536) / 65536."""
    n = 1
    for s in shape:
        n *= s
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-2 ** 63, None)
    lanes = words.view(torch.int16)[:n].view(shape)
    return lanes >= -32768 + round(p * 65536)


class _LaneDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p):
        keep = lane_mask(x.shape, p, x.device)
        scale = 1.0 / (1.0 - p)
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x.mul(keep).mul_(scale)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad.mul(keep).mul_(ctx.scale), None


def lane_dropout(x, p, training=True):
    """Dropout of `x` with probability p (see the module docstring); identity when not training or p == 0."""
    if not training or p == 0.0:
        return x
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    return _LaneDropout.apply(x, p)


class FastDropout(torch.nn.Dropout):
    """nn.Dropout with lane_dropout's masks (same p, same train / eval switch; a subclass, so code that
    looks for nn.Dropout, such as --attention-dropout, still finds it)."""

    def forward(self, x):
        return lane_dropout(x, self.p, self.training)


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention interface: SDPA when `dropout` is 0, else softmax(q k^T * scaling + mask)
    with lane_dropout on the probabilities, times v. `attention_mask` is SDPA's (bool, True = attend, or
    additive float, or None)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if dropout == 0.0:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if kwargs.get("position_bias") is not None or kwargs.get("sliding_window") is not None:
        raise NotImplementedError("--fast-dropout: attention with a position bias or a sliding window")
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query * scaling, key.transpose(2, 3))
    if attention_mask is None and (is_causal if is_causal is not None else getattr(module, "is_causal", False)):
        q_len, k_len = query.shape[2], key.shape[2]
        attention_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:  # to an additive mask, the size of the mask, not of the scores
            attention_mask = torch.zeros(attention_mask.shape, dtype=scores.dtype, device=scores.device).masked_fill_(
                ~attention_mask, torch.finfo(scores.dtype).min)
        scores = scores.add_(attention_mask[..., :key.shape[2]])
    if scores.dtype == torch.float32:
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(lane_dropout(probs, dropout), value).transpose(1, 2).contiguous(), None


def register():
    """Make ATTN_NAME known to transformers (its attention and its mask, SDPA's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def apply_fast_dropout(model):
    """--fast-dropout on a loaded model: every nn.Dropout becomes FastDropout (in place, same p) and an
    SDPA attention runs through `attention`. Returns (dropout modules swapped, whether the attention was).
    Another attention kernel (eager, flash), or a config with a sliding window, keeps its own dropout on
    the probabilities."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Dropout:
                new = FastDropout(child.p, child.inplace)
                new.train(child.training)
                setattr(parent, name, new)
                swapped += 1
    routed = False
    for m in model.modules():
        config = getattr(m, "config", None)
        if getattr(config, "_attn_implementation", None) == "sdpa" and getattr(config, "sliding_window", None) is None:
            register()
            config._attn_implementation = ATTN_NAME
            routed = True
    return swapped, routed


def applied(model):
    """What apply_fast_dropout did to `model`, read off it: (FastDropout modules, whether the attention runs
    through `attention`), or None where neither (the flag was off)."""
    swapped = sum(isinstance(m, FastDropout) for m in model.modules())
    routed = any(getattr(getattr(m, "config", None), "_attn_implementation", None) == ATTN_NAME
                 for m in model.modules())
    return (swapped, routed) if swapped or routed else None


def describe(model):
    """The run summary's words for what apply_fast_dropout did to `model` ("" where nothing)."""
    done = applied(model)
    if done is None:
        return ""
    return f"; fast dropout on {done[0]} dropout modules" + (" and the attention" if done[1] else "")

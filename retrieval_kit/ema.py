"""An exponential moving average of the trained weights (--ema-decay D), kept beside the fp32 master
weights and updated after every optimizer step that was taken: ema = D * ema + (1 - D) * weight.

It averages what the optimizer trains (requires_grad: under LoRA the adapters and a fresh head, never the
frozen base), in the parameters' own dtype (fp32 master weights by default), held as the parameters are
held: replicated under DDP, the same dim-0 shards under FSDP2 (each rank averages its own shards). A
checkpoint keeps it (`ema.safetensors`, full tensors gathered by rank 0), a resume restores it bitwise,
`plan` counts it, validation can score it (`swapped`: the weights and the average traded in place and back),
and the export can be it (--export-ema).
"""

import contextlib

import torch


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t  # (an FSDP2 DTensor: this rank's shard)


class EMA:
    """The average of `model`'s trained parameters (those with requires_grad, by name), started at their
    values now."""

    def __init__(self, model, decay):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay {decay}: must be between 0 and 1")
        self.decay = decay
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        with torch.no_grad():
            self.shadow = {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self):
        """After an optimizer step: shadow += (1 - decay) * (weight - shadow), on every tensor at once."""
        names = list(self.params)
        torch._foreach_lerp_([_local(self.shadow[n]) for n in names], [_local(self.params[n].detach()) for n in names],
                             1.0 - self.decay)

    @contextlib.contextmanager
    def swapped(self):
        """The average in the model's parameters for the body of the `with` (validation, export), the
        weights back after it."""
        self._swap()
        try:
            yield self
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self):
        for n, p in self.params.items():
            a, b = _local(p), _local(self.shadow[n])
            tmp = a.clone()
            a.copy_(b)
            b.copy_(tmp)

    def copy_to_model(self):
        """The average into the model's parameters, for good (the export of --export-ema)."""
        with torch.no_grad():
            for n, p in self.params.items():
                _local(p).copy_(_local(self.shadow[n]))

    def state_dict(self):
        """{name: full CPU tensor}; collective under FSDP2 (each shard gathered), every rank gets it."""
        return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().contiguous()
                for n, t in self.shadow.items()}

    def load_state_dict(self, state, where="the checkpoint"):
        """A saved average back into the shadow (each rank its shard under FSDP2); its names and shapes must
        be this run's trained parameters'."""
        if set(state) != set(self.shadow) or any(tuple(state[n].shape) != tuple(self.shadow[n].shape) for n in state):
            raise SystemExit(f"{where}: its EMA is not of this run's trained parameters (missing "
                             f"{sorted(set(self.shadow) - set(state))[:3]}, unexpected {sorted(set(state) - set(self.shadow))[:3]}): "
                             "resume with the flags it was trained with")
        with torch.no_grad():
            for n, t in self.shadow.items():
                if hasattr(t, "device_mesh"):
                    from torch.distributed.tensor import distribute_tensor

                    _local(t).copy_(_local(distribute_tensor(state[n].to(t.device, t.dtype), t.device_mesh,
                                                             t.placements)))
                else:
                    t.copy_(state[n].to(t.device, t.dtype))

"""GradCache (Gao et al., 2021): the gradients of a large batch with the memory of one chunk.

1. Run every chunk of every input without a graph, recording the RNG state before each, into
   one output buffer per input (only the small RNG states outlive a chunk).
2. The loss on the full outputs (gathers across ranks included), backward to d loss / d outputs.
3. Run each chunk again with a graph, replaying its RNG state (the same dropout), and
   backpropagate the cached output gradients. Only one chunk's activations live at a time, so
   memory stays flat as the batch grows; the parameter gradients are the ones a plain backward
   of the whole batch leaves. Gradients sync only on the last chunk's backward (when `sync`).
"""

import torch

from .dist import grad_sync


def _rng_state():
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if torch.cuda.is_available() else None)


def _set_rng_state(state):
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


def grad_cache(model, inputs, run, loss_fn, accum=1, sync=True):
    """inputs: {name: chunking.Chunked}; run(model, name, sub_batch) -> that piece's output rows;
    loss_fn({name: full outputs in batch order}) -> (loss, *extra). Backpropagates loss / accum and
    returns (loss detached, *extra), with the parameter gradients accumulated."""
    parts = [(name, start, end, sub) for name, c in inputs.items() for start, end, sub in c.pieces()]
    buffers, states = {}, []
    with torch.no_grad():
        for name, start, end, sub in parts:
            states.append(_rng_state())
            out = run(model, name, sub)
            if name not in buffers:
                buffers[name] = out.new_empty((inputs[name].rows,) + tuple(out.shape[1:]))
            buffers[name][start:end] = out
            del out
    full = {name: inputs[name].restore(t).requires_grad_(True) for name, t in buffers.items()}
    loss, *extra = loss_fn(full)
    (loss / accum).backward()
    after = _rng_state()
    for i, ((name, start, end, sub), state) in enumerate(zip(parts, states)):
        _set_rng_state(state)
        with grad_sync(model, sync and i == len(parts) - 1):
            out = run(model, name, sub)
            cached = full[name].grad[inputs[name].batch_rows(start, end)]
            (out * cached).sum().backward()  # d loss / d params through this piece's outputs
    _set_rng_state(after)
    return (loss.detach(), *extra)

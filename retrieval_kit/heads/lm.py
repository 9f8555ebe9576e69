"""--head lm: an LLM reranker. A causal LM scores a (query, passage) pair by logit(true word) -
logit(false word) of the next token after the pair's last token (Qwen3-Reranker's layout with
`--prompt-template qwen3`, FlagEmbedding's LLM rerankers); only that position's hidden state meets
only the two vocabulary rows. Pairs pad on the left. Its export is the causal LM with
sentence-transformers' LogitScore (CrossEncoder(lm_tokens)) and, with --export-seq-cls, a
*ForSequenceClassification whose one logit is the same difference. The interface: heads/__init__.py."""

import os

import torch

from ..chunking import Chunked, run_chunked
from ..flags import Flag, listed
from ..models import encoder_type, load_auto, pool
from ..st_format import IDENTITY, SETTINGS_FILE, write_json_files

NAME = "lm"
RECORD_FIELDS = {  # what it keeps in an export's retrieval_kit.json: (check, what it must be)
    "lm_token_ids": (lambda v: v is None or (isinstance(v, list) and len(v) == 2 and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)), "two vocabulary ids, or null"),
}
FLAGS = {  # its flags (cli.py adds them to the reranker script's parser; cli.head_flags checks them)
    "lm_tokens": Flag(
        ["yes", "no"], "--lm-tokens", type=listed(str),
        help="--head lm: the true and false words, one token each (default yes,no)"),
    "export_seq_cls": Flag(
        False, "--export-seq-cls", neutral=True, action="store_true",
        help="--head lm: also write final/seq_cls/, a *ForSequenceClassification dir whose one logit is "
             "logit(true) - logit(false) (the score row = the difference of the two LM-head rows), which "
             "AutoModelForSequenceClassification, CrossEncoder and seq-cls servers read"),
}


def load(path, dtype=torch.float32, *, meta=False, spec=None, seed=0, **load_kw):
    """AutoModelForCausalLM (`meta`: built on the meta device); an encoder is one sentence (its LM head
    would start fresh and its attention be bidirectional)."""
    from transformers import AutoModelForCausalLM

    encoder = encoder_type(path)
    if encoder:
        raise SystemExit(f"--head lm: {path} is a {encoder} encoder, not a causal LM: its LM head would start fresh "
                         "and its attention be bidirectional; use --head classifier, or a decoder (Llama, Qwen, ...)")
    return load_auto(AutoModelForCausalLM, path, dtype, meta=meta, **load_kw)


def padding_side(flag):
    """Left unless --padding-side says otherwise: the score reads the last column."""
    return "left" if flag == "auto" else flag


def token_ids(tokenizer, words):
    """The vocabulary ids of --lm-tokens (true word, false word): one token each, or one sentence."""
    ids = []
    for w in words:
        got = tokenizer(w, add_special_tokens=False)["input_ids"]
        if len(got) != 1:
            raise SystemExit(f"--lm-tokens: {w!r} is {len(got)} tokens for this tokenizer ({got}); the score reads one "
                             "vocabulary row per word: choose words that are one token each")
        ids.append(got[0])
    if ids[0] == ids[1]:
        raise SystemExit(f"--lm-tokens: {words[0]!r} and {words[1]!r} are the same token")
    return ids


class LMScore(torch.nn.Module):
    """`model(pairs=batch)` -> {"pairs": (n_pairs,) fp32 scores}: logit(true) - logit(false) of the next
    token after each pair's last real token. A batch is a tokenized dict or a chunking.Chunked. Save and
    export `.model`."""

    def __init__(self, model, token_ids):
        super().__init__()
        self.model, self.token_ids = model, token_ids
        self.train(model.training)  # a wrapper takes its model's mode (from_pretrained: eval)

    def score(self, batch):
        """Only the last real position's hidden state meets only the two vocabulary rows (never
        (pairs, length, vocab))."""
        extra = {k: batch[k] for k in ("token_type_ids", "position_ids") if k in batch}
        hidden = self.model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                       **extra).last_hidden_state  # (n, L, H), after the final norm
        last = pool(hidden, batch["attention_mask"], "last").float()  # (n, H)
        rows = self.model.get_output_embeddings().weight[self.token_ids].float()  # (2, H)
        with torch.autocast(last.device.type, enabled=False):
            logits = last @ rows.T  # (n, 2), fp32
        return logits[:, 0] - logits[:, 1]

    def forward(self, **batches):
        return {name: run_chunked(self.score, b) if isinstance(b, Chunked) else self.score(b)
                for name, b in batches.items()}


def scorer(net, pooling=None, token_ids=None):
    return LMScore(net, token_ids)


def kit_only_reasons(pooling, bidirectional):
    """Why CrossEncoder (LogitScore over the causal LM) and AutoModelForCausalLM would score otherwise."""
    return ["--bidirectional: stock loaders keep the decoder's causal attention"] if bidirectional else []


def write_export(stage, settings, tokenizer):
    """sentence-transformers' files: the causal LM, then LogitScore on the last position (write_cross_encoder_files)."""
    from ..pairs import PAIR

    write_cross_encoder_files(stage, settings["lm_token_ids"], settings["rerank_max_length"],
                                 chat=settings["prompt_template"] != PAIR)
    return settings


def finish_export(stage, settings, trust_remote_code=False, seq_cls=False):
    """--export-seq-cls: also stage/seq_cls (write_seq_cls); a dir that cannot be written is a warning."""
    if seq_cls:
        settings["seq_cls"] = write_seq_cls(stage, settings, trust_remote_code)
        if not settings["seq_cls"]["written"]:
            print(f"warning: --export-seq-cls: not written: {settings['seq_cls']['reason']}", flush=True)
    return settings


def write_seq_cls(out_dir, settings, trust_remote_code=False):
    """Beside an export in `out_dir`: `out_dir/seq_cls`, the same network as a *ForSequenceClassification
    with one logit whose weight row is W[true] - W[false] of the LM head (and its bias likewise), so that
    logit is the kit's score at the last real token. Transformers' seq-cls models read the last token that
    is not the pad token: refused (a reason returned) when the pairs end in the pad token. Loads the
    written LM once more on this process (CPU)."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from ..pairs import pair_layout

    yes, no = settings["lm_token_ids"]
    lm = AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=trust_remote_code)
    config = AutoConfig.from_pretrained(out_dir, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(out_dir, trust_remote_code=trust_remote_code)
    layout = pair_layout(tokenizer, settings["prompt_template"], settings["append_eos"])
    last = layout.encode_pairs(["q"], ["p"], 1 << 20)[0][0][-1]  # (a probe pair, never cut)
    pad = tokenizer.pad_token_id
    if pad is None or last == pad:
        return {"written": False, "reason": f"pairs end in the pad token (id {last}): a seq-cls model would not find "
                                            "the last real token"}
    config.num_labels, config.pad_token_id = 1, pad
    config.architectures = None
    config.sentence_transformers = {"activation_fn": IDENTITY}
    try:
        seq = AutoModelForSequenceClassification.from_config(config, trust_remote_code=trust_remote_code,
                                                             dtype=lm.dtype)
    except ValueError as e:  # an architecture transformers has no sequence-classification class for
        return {"written": False, "reason": str(e).splitlines()[0]}
    head = lm.get_output_embeddings()
    base = getattr(lm, lm.base_model_prefix)
    getattr(seq, seq.base_model_prefix).load_state_dict(base.state_dict())  # strict: every weight, same names
    score = seq.score if hasattr(seq, "score") else seq.get_output_embeddings()
    with torch.no_grad():
        score.weight.copy_((head.weight[yes] - head.weight[no]).unsqueeze(0))
        if getattr(head, "bias", None) is not None:
            if getattr(score, "bias", None) is None:
                return {"written": False, "reason": "the LM head has a bias and the seq-cls head none"}
            score.bias.copy_((head.bias[yes] - head.bias[no]).view(1))
    dest = os.path.join(out_dir, "seq_cls")
    seq.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    with open(os.path.join(dest, SETTINGS_FILE), "w") as f:
        json.dump({**settings, "head": "classifier", "pooling": "native", "lm_token_ids": None,
                   "seq_cls_of": {"true_token_id": yes, "false_token_id": no}}, f, indent=2)
    return {"written": True, "dir": "seq_cls"}


def write_cross_encoder_files(out_dir, token_ids, max_length, chat=False):
    """The sentence-transformers files (6.x layout) that make `CrossEncoder(out_dir)` score a --head lm
    export as the kit does: its Transformer module on the causal LM ("text-generation", logits of the
    last position, left padding), then LogitScore: logit(true) - logit(false), no activation.
    `chat`: pairs go through the chat template's query / document roles (the "message" modality,
    flat: each message's content a string)."""
    text = {"method": "forward", "method_output_name": "logits"}
    modality = {"text": text, **({"message": {**text, "format": "flat"}} if chat else {})}
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
               {"idx": 1, "name": "1", "path": "1_LogitScore",
                "type": "sentence_transformers.cross_encoder.modules.logit_score.LogitScore"}]
    files = {"modules.json": modules,
             os.path.join("1_LogitScore", "config.json"): {"true_token_id": token_ids[0], "false_token_id": token_ids[1],
                                                           "module_input_name": "causal_logits"},
             "sentence_bert_config.json": {"transformer_task": "text-generation", "max_seq_length": max_length,
                                           "modality_config": modality,
                                           "module_output_name": "causal_logits"},
             "config_sentence_transformers.json": {"model_type": "CrossEncoder", "activation_fn": IDENTITY,
                                                   "prompts": {}, "default_prompt_name": None}}
    write_json_files(out_dir, files)

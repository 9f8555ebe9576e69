"""Exported models in the form their consumers read, and loading them back.

Every export is a Hugging Face model dir (`save_pretrained`) with the kit's settings beside it in
retrieval_kit.json (pooling, normalization, prefixes, max lengths, template), so evaluation
tokenizes and pools as training did (`export_model`, `load_settings`).

A reranker export is a plain transformers dir (`AutoModelForSequenceClassification`, or
`AutoModelForCausalLM` for --head lm, and `AutoTokenizer`) that sentence-transformers' `CrossEncoder`
also loads, and all of them score a (query, passage) pair as the kit does:
  - the head is the model's own (`--pooling native`); other poolings are kit-only (`kit_only_reasons`);
  - pairs are rendered as training rendered them. The tokenizer's pair encoding (`--prompt-template
    pair`): `tokenizer(query, passage)`, with `model_max_length` the trained `rerank_max_length` so
    `truncation=True` cuts where training cut (an appended EOS is added by a rewritten pair
    post-processor, collate.pair_post_processor). A prompt template: a chat template whose
    `query` / `document` roles render the trained string (`reranker_chat_template`; other roles
    render with the model's own chat template), which CrossEncoder applies to a pair and tokenizes
    as one string, restoring the tail after truncation, as the kit cuts. A classifier export with the
    pair encoding drops the model's chat template, through which CrossEncoder would render the pair;
  - `config.json` declares the score activation (identity: the kit's scores are raw logits), which
    CrossEncoder reads instead of its default sigmoid;
  - --head lm with --export-seq-cls: also `seq_cls/`, the same model as a *ForSequenceClassification
    whose one logit is logit(true) - logit(false) (`write_seq_cls`).
The export checks its own tokenizer after writing it and records the outcome in retrieval_kit.json
(`portable`, `tokenizer_pairs`).
"""

import json
import os

import torch
from safetensors.torch import save_file

from .ckpt import full_state_dict
from .collate import PAIR, TemplateLayout, pair_layout, pair_post_processor
from .dist import barrier, rank, unwrap
from .flags import writing
from .outputs import publish, stage as make_stage, staging
from .lora import merged_state_dict, widest_dtype, write_adapter
from .st_format import SETTINGS_FILE, load_settings, write_multi_vector_files, write_sparse_files, write_st_files

IDENTITY = "torch.nn.modules.linear.Identity"  # sentence-transformers' activation_fn path for raw logits
PROBES = [("how do i list files", "ls lists directory contents " * 200), ("q", "p"),
          ("a fast compressor for data", "zstd is a fast lossless compression algorithm")]


AFTER_EXPORT_FAILED = "the last checkpoint is intact: free space, then continue with --resume auto"


def export_model(out_dir, model, tokenizer, settings, publish=True, card=None):
    """export_model_ (below); a failed write (a full disk) ends the run with one sentence."""
    with writing(f"the model to {out_dir}", then=AFTER_EXPORT_FAILED):
        return export_model_(out_dir, model, tokenizer, settings, publish, card)


def export_model_(out_dir, model, tokenizer, settings, publish=True, card=None):
    """Save a dir that AutoModel / AutoTokenizer.from_pretrained load, plus our settings beside it
    (pooling, normalization, prefixes, max lengths, template) so evaluation tokenizes as training did.
    A bi-encoder (settings["kind"] == "biencoder") also gets the sentence-transformers files
    (st_format.write_st_files), so SentenceTransformer(out_dir) embeds as the kit does.

    Written into `out_dir.partial` and renamed to `out_dir` when complete (publish=False leaves it
    there for the caller to finish and publish), so a kill never leaves a model dir that looks
    complete but is not. `card`: the model card (README.md, model_card), as the hub shows it."""

    weights = full_state_dict(model)  # collective under FSDP2
    lora = getattr(unwrap(model), "lora", None)
    trained = [n for n, p in unwrap(model).named_parameters() if p.requires_grad]
    stage = staging(out_dir)
    if rank() == 0:
        make_stage(out_dir, "the export")  # (a leftover of the kit's own is cleared; anything else refused)
        if lora:  # the merged model for every loader; with --export-adapter also peft's adapter dir
            if lora["adapter"]:
                write_adapter(os.path.join(stage, "adapter"), weights, lora, lora["base_model"], trained)
            weights = merged_state_dict(weights, lora)
            settings = {**settings, "lora": lora}
        multi = settings.get("head") == "multi-vector"  # the token projection: MultiVectorEncoder's 1_Dense
        dense = getattr(unwrap(model), "multi_vector" if multi else "st_dense", None)  # a Dense: its own module dir
        prefix = "multi_vector." if multi else "st_dense."
        dense_weights = {k[len(prefix):]: weights.pop(k) for k in list(weights) if k.startswith(prefix)}
        dtype = str(widest_dtype(weights)).replace("torch.", "")  # (save_pretrained may empty `weights`)
        unwrap(model).save_pretrained(stage, state_dict=weights, safe_serialization=True)
        if lora:  # config.json names the first param's dtype; the merged weights are all in the widest
            _edit_json(os.path.join(stage, "config.json"), lambda c: c.update(dtype=dtype))
        tokenizer.save_pretrained(stage)
        if settings.get("kind") == "biencoder" and settings.get("head") == "sparse":
            from .models import is_decoder_only

            if is_decoder_only(unwrap(model).config):  # SparseEncoder 6.3 reads a causal LM otherwise (checked:
                why = ("sentence-transformers' SparseEncoder reads a causal LM's logits otherwise (it scored a "  # zeros)
                       "decoder's SPLADE vectors wrong when tried); the kit's tools load this dir")
                print(f"warning: {out_dir}: no SparseEncoder files for a decoder: {why}", flush=True)
                settings = {**settings, "sentence_transformers": {"files": False, "warnings": [why]}}
            else:
                write_sparse_files(stage, settings)
                settings = {**settings, "sentence_transformers": {"files": True, "warnings": []}}
        elif settings.get("kind") == "biencoder" and multi:
            write_multi_vector_files(stage, settings, unwrap(model).config.hidden_size, dense.linear.out_features)
            save_file({k: v.contiguous() for k, v in dense_weights.items()},
                      os.path.join(stage, "1_Dense", "model.safetensors"))
            settings = {**settings, "sentence_transformers": {"files": True, "warnings": []}}
        elif settings.get("kind") == "biencoder":
            warnings = write_st_files(stage, settings, unwrap(model).config.hidden_size,
                                      dense.config() if dense is not None else None)
            if dense is not None:
                save_file(dense_weights, os.path.join(stage, "2_Dense", "model.safetensors"))
            settings = {**settings, "sentence_transformers": {"files": True, "warnings": warnings}}
            for w in warnings:
                print(f"warning: {out_dir}: {w}", flush=True)
        with open(os.path.join(stage, SETTINGS_FILE), "w") as f:
            json.dump(settings, f, indent=2)
        if card:
            with open(os.path.join(stage, "README.md"), "w", encoding="utf-8") as f:
                f.write(card)
    if publish:
        publish_dir(out_dir)
    barrier()
    return out_dir


def model_card(kind, base_model, train_files, steps, loss, metrics, command=None):
    """README.md of an export, as sentence-transformers writes one: YAML front matter (base model,
    library, pipeline tag, datasets) and what the run was - its data files and record counts, its
    loss and settings, its steps, its newest validation and retrieval metrics (`metrics`, Logger.last:
    {split: {"step", name: value}}), and the command line."""
    import sys

    command = " ".join(command if command is not None else sys.argv)
    pipeline = "sentence-similarity" if kind == "biencoder" else "text-ranking"
    lines = ["---", f"base_model: {base_model}", "library_name: sentence-transformers", f"pipeline_tag: {pipeline}",
             "tags:", "- retrieval_kit", "- sentence-transformers", f"- {'bi-encoder' if kind == 'biencoder' else 'reranker'}",
             "datasets:"] + [f"- {f['file']}" for f in train_files] + ["---", "",
             f"# {'Embedding model' if kind == 'biencoder' else 'Reranker'} fine-tuned from {base_model}", "",
             f"Trained with retrieval_kit ({'SentenceTransformer' if kind == 'biencoder' else 'CrossEncoder'} and "
             "transformers load this dir).",
             "", "## Training", "", "| data file | records | share of the batches |", "|---|---|---|"]
    total = sum(f.get("batches_per_round", 0) for f in train_files) or 1
    lines += [f"| {f['file']} | {f['records']} | {f.get('batches_per_round', 0) / total:.0%} |" for f in train_files]
    lines += ["", f"- steps: {steps}", "- loss: " + ", ".join(f"{k} {v}" for k, v in loss.items())]
    for split, row in metrics.items():
        if split == "train":
            continue
        values = ", ".join(f"{k} {v:.4f}" for k, v in row.items() if k != "step" and isinstance(v, (int, float)))
        lines.append(f"- {split} at step {row['step']}: {values}")
    lines += ["", "## Command", "", "```bash", command, "```", ""]
    return "\n".join(lines)


def publish_dir(out_dir):
    """Rank 0: replace out_dir (the kit's own export, if there: outputs.publish) by its finished staging dir."""
    if rank() == 0:
        publish(out_dir, SETTINGS_FILE, "the export")


def kit_only_reasons(pooling, bidirectional, head="classifier"):
    """Why a reranker with these settings scores differently in transformers / sentence-transformers
    (for --head lm: AutoModelForCausalLM + the template, and CrossEncoder with its LogitScore)."""
    reasons = []
    if pooling != "native" and head != "lm":  # an LM head reads the last token, whatever --pooling says
        reasons.append(f"--pooling {pooling}: stock loaders run the model's own classification head "
                       "(--pooling native), not pooled hidden states")
    if bidirectional:
        reasons.append("--bidirectional: stock loaders keep the decoder's causal attention")
    return reasons


def warn_kit_only(pooling, bidirectional, head="classifier"):
    """Say at start-up (rank 0) why the reranker's export will score differently in the stock loaders."""
    for reason in kit_only_reasons(pooling, bidirectional, head):
        if rank() == 0:
            print(f"warning: kit-only reranker: {reason}; score the export with retrieval_kit, not "
                  "AutoModelForSequenceClassification or CrossEncoder", flush=True)


def write_lm_cross_encoder_files(out_dir, token_ids, max_length, chat=False):
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
    os.makedirs(os.path.join(out_dir, "1_LogitScore"), exist_ok=True)
    files = {"modules.json": modules,
             os.path.join("1_LogitScore", "config.json"): {"true_token_id": token_ids[0], "false_token_id": token_ids[1],
                                                           "module_input_name": "causal_logits"},
             "sentence_bert_config.json": {"transformer_task": "text-generation", "max_seq_length": max_length,
                                           "modality_config": modality,
                                           "module_output_name": "causal_logits"},
             "config_sentence_transformers.json": {"model_type": "CrossEncoder", "activation_fn": IDENTITY,
                                                   "prompts": {}, "default_prompt_name": None}}
    for name, obj in files.items():
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(obj, f, indent=2)


def _edit_json(path, fn):
    with open(path) as f:
        obj = json.load(f)
    fn(obj)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


def _tokenizer_matches(out_dir, tokenizer, layout, max_length, trust_remote_code=False):
    """Does the exported tokenizer render the probe pairs to the kit's ids? The pair encoding: with
    `truncation=True` at its own max length; a template: its chat template's query / document roles,
    tokenized as one string (uncut: truncation and the restored tail are the consumer's part)."""
    from transformers import AutoTokenizer

    stock = AutoTokenizer.from_pretrained(out_dir, trust_remote_code=trust_remote_code)
    if isinstance(layout, TemplateLayout):  # a probe longer than the model's positions is compared uncut, unwarned
        stock.model_max_length = 10 ** 9
    for q, p in PROBES:
        if isinstance(layout, TemplateLayout):
            ids, types = layout.encode_pairs([q], [p], None)[0]
            enc = stock.apply_chat_template(pair_messages(q, p), tokenize=True, return_dict=True)
        else:
            ids, types = layout.encode_pairs([q], [p], max_length)[0]
            enc = stock(q, p, truncation=True)
        if enc["input_ids"] != ids or (layout.with_types and enc.get("token_type_ids", types) != types):
            return False
    return True


def pair_messages(query, passage):
    """A (query, passage) pair as sentence-transformers hands it to a chat template (flat format)."""
    return [{"role": "query", "content": query}, {"role": "document", "content": passage}]


def reranker_chat_template(layout, original=None):
    """A Jinja chat template that renders a conversation holding a `query` and a `document` message as
    `layout` renders the pair (its special tokens written as text, which the tokenizer reads back as
    those tokens), and any other conversation with `original` (the model's own chat template)."""
    tok = layout.tokenizer
    lit = lambda text: "{{ " + json.dumps(text, ensure_ascii=False) + " }}" if text else ""  # noqa: E731
    text_of = "(m.content if m.content is string else (m.content | first)['text'])"
    body = lit("".join(tok.convert_ids_to_tokens(layout.before)))
    for kind, piece in layout.pieces:
        body += lit(piece) if kind == "text" else "{{ pair.%s }}" % ("query" if kind == "query" else "document")
    body += lit("".join(tok.convert_ids_to_tokens(layout.after)))
    head = ("{%- set pair = namespace(query=none, document=none) -%}"
            "{%- for m in messages -%}"
            "{%- if m.role == 'query' -%}{%- set pair.query = " + text_of + " -%}"
            "{%- elif m.role == 'document' -%}{%- set pair.document = " + text_of + " -%}{%- endif -%}"
            "{%- endfor -%}"
            "{%- if pair.query is not none and pair.document is not none -%}")
    if isinstance(original, dict):  # several named templates: the default one serves other conversations
        original = original.get("default")
    other = original if original else "{{ raise_exception('this reranker renders a query and a document message') }}"
    return head + body + "{%- else %}" + other + "{% endif %}"


def export_reranker(out_dir, net, tokenizer, settings, trust_remote_code=False, card=None, seq_cls=False):
    """Write the reranker `net` (the unwrapped *ForSequenceClassification model, or its FSDP2 module)
    to `out_dir` as described in the module docstring; returns the settings written beside it.
    A failed write (a full disk) ends the run with one sentence.

    `settings` holds pooling, bidirectional and the tokenization (prompt_template, rerank_max_length,
    append_eos, padding_side, pad_to_multiple_of); `seq_cls` (--head lm): also write `out_dir/seq_cls`."""
    with writing(f"the reranker to {out_dir}", then=AFTER_EXPORT_FAILED):
        return _export_reranker(out_dir, net, tokenizer, settings, trust_remote_code, card, seq_cls)


def _export_reranker(out_dir, net, tokenizer, settings, trust_remote_code, card, seq_cls):
    template, max_length = settings["prompt_template"], settings["rerank_max_length"]
    reasons = kit_only_reasons(settings["pooling"], settings.get("bidirectional", False),
                               settings.get("head", "classifier"))
    settings = dict(settings, score_activation="identity", tokenizer_pairs=False, portable=False,
                    kit_only=reasons, lora=getattr(unwrap(net), "lora", None))
    export_model(out_dir, net, tokenizer, settings, publish=False, card=card)  # collective under FSDP2
    final, out_dir = out_dir, staging(out_dir)  # finished in the staging dir, then published
    if rank() == 0:
        layout = pair_layout(tokenizer, template, settings["append_eos"])
        if settings.get("head") == "lm":  # CrossEncoder: the causal LM, then LogitScore on the last position
            write_lm_cross_encoder_files(out_dir, settings["lm_token_ids"], max_length, chat=template != PAIR)
        else:
            _edit_json(os.path.join(out_dir, "config.json"),
                       lambda c: c.setdefault("sentence_transformers", {}).update(activation_fn=IDENTITY))
        _edit_json(os.path.join(out_dir, "tokenizer_config.json"), lambda c: c.update(model_max_length=max_length))
        if template != PAIR:  # one mechanism for every consumer: the chat template's query / document roles
            write_chat_template(out_dir, reranker_chat_template(layout, tokenizer.chat_template))
        else:
            if tokenizer.chat_template and settings.get("head") != "lm":  # CrossEncoder would render a pair
                drop_chat_template(out_dir)  # through it, not as tokenizer(query, passage) (the LM head's files
                settings["chat_template_dropped"] = True  # pin the text modality instead)
            if settings["append_eos"]:
                rewrite_pair_post_processor(out_dir, tokenizer, layout)
        settings["tokenizer_pairs"] = _tokenizer_matches(out_dir, tokenizer, layout, max_length, trust_remote_code)
        if not settings["tokenizer_pairs"]:
            settings["kit_only"] = reasons + [f"{type(tokenizer).__name__}: could not make the exported tokenizer "
                                              "reproduce the trained input; score with retrieval_kit"]
        settings["portable"] = not settings["kit_only"]
        if seq_cls:
            settings["seq_cls"] = write_seq_cls(out_dir, settings, trust_remote_code)
        with open(os.path.join(out_dir, SETTINGS_FILE), "w") as f:
            json.dump(settings, f, indent=2)
    publish_dir(final)
    barrier()
    return settings


def write_chat_template(out_dir, template):
    """`template` as the dir's chat template (chat_template.jinja, which transformers reads first)."""
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    _edit_json(os.path.join(out_dir, "tokenizer_config.json"), lambda c: c.pop("chat_template", None))


def drop_chat_template(out_dir):
    """No chat template in the dir: sentence-transformers then encodes a pair as `tokenizer(query, passage)`."""
    for name in ("chat_template.jinja", "chat_template.json"):
        if os.path.isfile(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    _edit_json(os.path.join(out_dir, "tokenizer_config.json"), lambda c: c.pop("chat_template", None))


def rewrite_pair_post_processor(out_dir, tokenizer, layout):
    """The pair encoding plus an appended EOS as the dir's tokenizer.json pair post-processor."""
    tok_json = os.path.join(out_dir, "tokenizer.json")
    if not os.path.isfile(tok_json):
        return
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(tok_json)
    backend.post_processor = pair_post_processor(tokenizer, layout)
    backend.save(tok_json)
    # a model-specific tokenizer class may rebuild its post-processor on load (BertTokenizer does):
    # the generic fast class reads tokenizer.json as written
    names = list(tokenizer.model_input_names)
    _edit_json(os.path.join(out_dir, "tokenizer_config.json"),
               lambda c: c.update(tokenizer_class="PreTrainedTokenizerFast", model_input_names=names))


def write_seq_cls(out_dir, settings, trust_remote_code=False):
    """Beside a --head lm export in `out_dir`: `out_dir/seq_cls`, the same network as a
    *ForSequenceClassification with one logit whose weight row is W[true] - W[false] of the LM head
    (and its bias likewise), so that logit is the kit's score at the last real token. Transformers'
    seq-cls models read the last token that is not the pad token: refused (a reason returned) when
    the pairs end in the pad token. Loads the written LM once more on this process (CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    yes, no = settings["lm_token_ids"]
    lm = AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=trust_remote_code)
    config = AutoConfig.from_pretrained(out_dir, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(out_dir, trust_remote_code=trust_remote_code)
    layout = pair_layout(tokenizer, settings["prompt_template"], settings["append_eos"])
    last = layout.encode_pairs(["q"], ["p"], None)[0][0][-1]
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
        print(f"warning: --export-seq-cls: not written: {str(e).splitlines()[0]}", flush=True)
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


def rerank_layout(tokenizer, settings):
    """The layout to score with: the saved template (an export's tokenizer renders it as training did)."""
    return pair_layout(tokenizer, settings.get("prompt_template", PAIR), settings.get("append_eos", False))


def load_exported_reranker(model_dir, dtype=torch.float32, trust_remote_code=False):
    """(CrossEncoder in eval mode, tokenizer, settings) from a train_reranker.py export, with the
    saved padding side, pooling and attention direction applied."""
    from transformers import AutoTokenizer

    from .models import CrossEncoder, load_lm_reranker, load_reranker, make_bidirectional, setup_pad_token

    settings = load_settings(model_dir)
    if settings.get("kind", "reranker") != "reranker":
        raise SystemExit(f"{model_dir}: a {settings['kind']} export (its {SETTINGS_FILE}), not a reranker: pass the "
                         "dir train_reranker.py exported")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    if settings.get("padding_side"):
        tokenizer.padding_side = settings["padding_side"]
    lm = settings.get("head") == "lm"  # a causal LM scored by its LM head
    net = (load_lm_reranker if lm else load_reranker)(model_dir, dtype, trust_remote_code)
    setup_pad_token(tokenizer, net)
    if settings.get("bidirectional"):
        make_bidirectional(net)
    model = CrossEncoder(net, settings.get("pooling", "native"), settings.get("lm_token_ids") if lm else None)
    return model.eval(), tokenizer, settings

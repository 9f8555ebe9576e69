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
    post-processor, pairs.pair_post_processor). A prompt template: a chat template whose
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

from . import heads
from .ckpt import full_state_dict
from .pairs import PAIR, TemplateLayout, pair_layout, pair_post_processor
from .dist import barrier, rank, unwrap
from .flags import writing
from .outputs import publish, stage as make_stage, staging
from .lora import merged_state_dict, widest_dtype, write_adapter
from .st_format import SETTINGS_FILE, edit_json, write_chat_template
PROBES = [("how do i list files", "ls lists directory contents " * 200), ("q", "p"),
          ("a fast compressor for data", "zstd is a fast lossless compression algorithm")]


AFTER_EXPORT_FAILED = "the last checkpoint is intact: free space, then continue with --resume auto"


def export_model(out_dir, model, tokenizer, settings, publish=True, card=None, finish=None):
    """export_model_ (below); a failed write (a full disk) ends the run with one sentence."""
    with writing(f"the model to {out_dir}", then=AFTER_EXPORT_FAILED):
        return export_model_(out_dir, model, tokenizer, settings, publish, card, finish)


def export_model_(out_dir, model, tokenizer, settings, publish=True, card=None, finish=None):
    """Save a dir that AutoModel / AutoTokenizer.from_pretrained load, plus our settings beside it
    (pooling, normalization, prefixes, max lengths, template) so evaluation tokenizes as training did.
    A bi-encoder (settings["kind"] == "biencoder") also gets its head's sentence-transformers files
    (head.write_export), so SentenceTransformer(out_dir) - or MultiVectorEncoder, SparseEncoder - embeds
    as the kit does.

    Written into `out_dir.partial` and renamed to `out_dir` when complete (publish=False leaves it
    there for the caller to finish and publish), so a kill never leaves a model dir that looks
    complete but is not. `card`: the model card (README.md, model_card), as the hub shows it. `finish(stage)`:
    rank 0's last word on the staged dir before it is published (merge: the adapter at alpha, its file list)."""

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
        embedding = settings.get("kind") == "biencoder"
        if embedding:
            settings = {"head": heads.EMBEDDING[0], **settings}
        head = heads.get(settings["head"]) if embedding else None  # (a reranker's files: export_reranker)
        head_weights = head.split_export(weights) if embedding else {}  # a Dense or projection: its own module dir
        dtype = str(widest_dtype(weights)).replace("torch.", "")  # (save_pretrained may empty `weights`)
        unwrap(model).save_pretrained(stage, state_dict=weights, safe_serialization=True)
        if lora:  # config.json names the first param's dtype; the merged weights are all in the widest
            edit_json(os.path.join(stage, "config.json"), lambda c: c.update(dtype=dtype))
        tokenizer.save_pretrained(stage)
        if embedding:  # (inference's lengths where training's differ: one vector reads a query whole)
            settings = {**settings, **head.serving(settings)}
            settings = {**settings, "sentence_transformers": head.write_export(stage, unwrap(model), settings,
                                                                               head_weights, out_dir)}
        with open(os.path.join(stage, SETTINGS_FILE), "w") as f:
            json.dump(settings, f, indent=2)
        if card:
            with open(os.path.join(stage, "README.md"), "w", encoding="utf-8") as f:
                f.write(card)
        if finish is not None and publish:
            finish(stage)
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


def warn_kit_only(head, pooling, bidirectional):
    """Say at start-up (rank 0) why the reranker's export will score differently in the stock loaders
    (head.kit_only_reasons)."""
    for reason in head.kit_only_reasons(pooling, bidirectional):
        if rank() == 0:
            print(f"warning: kit-only reranker: {reason}; score the export with retrieval_kit, not "
                  "AutoModelForSequenceClassification or CrossEncoder", flush=True)


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


def export_reranker(out_dir, net, tokenizer, settings, trust_remote_code=False, card=None, seq_cls=None,
                    finish=None):
    """Write the reranker `net` (the unwrapped *ForSequenceClassification model, or its FSDP2 module)
    to `out_dir` as described in the module docstring; returns the settings written beside it.
    A failed write (a full disk) ends the run with one sentence.

    `settings` holds the head, pooling, bidirectional and the tokenization (prompt_template,
    rerank_max_length, append_eos, padding_side, pad_to_multiple_of); `seq_cls` (--head lm --export-seq-cls):
    also write `out_dir/seq_cls` (None: when `settings` records one, as a merge of such an export does);
    `finish(stage)`: as export_model's."""
    with writing(f"the reranker to {out_dir}", then=AFTER_EXPORT_FAILED):
        return _export_reranker(out_dir, net, tokenizer, settings, trust_remote_code, card, seq_cls, finish)


def _export_reranker(out_dir, net, tokenizer, settings, trust_remote_code, card, seq_cls, finish):
    seq_cls = "seq_cls" in settings if seq_cls is None else seq_cls  # (rebuilt, and recorded anew)
    settings = {"head": heads.RERANKER[0], **settings}  # (the default head, as train_reranker.py's)
    template, max_length = settings["prompt_template"], settings["rerank_max_length"]
    head = heads.get(settings["head"])
    reasons = head.kit_only_reasons(settings["pooling"], settings.get("bidirectional", False))
    settings = dict(settings, score_activation="identity", tokenizer_pairs=False, portable=False,
                    kit_only=reasons, lora=getattr(unwrap(net), "lora", None) or settings.get("lora"))
    export_model(out_dir, net, tokenizer, settings, publish=False, card=card)  # collective under FSDP2
    final, out_dir = out_dir, staging(out_dir)  # finished in the staging dir, then published
    if rank() == 0:
        layout = pair_layout(tokenizer, template, settings["append_eos"])
        settings = head.write_export(out_dir, settings, tokenizer)  # the head's files for CrossEncoder / transformers
        edit_json(os.path.join(out_dir, "tokenizer_config.json"), lambda c: c.update(model_max_length=max_length))
        if template != PAIR:  # one mechanism for every consumer: the chat template's query / document roles
            write_chat_template(out_dir, reranker_chat_template(layout, tokenizer.chat_template))
            if layout.passage_first():  # sentence-transformers cuts a long pair otherwise (tail after the passage)
                settings["kit_only"] = reasons = reasons + [
                    "the template puts the passage before the query: a pair too long for --rerank-max-length is cut "
                    "by the kit at the passage's end, by sentence-transformers' chat-template truncation elsewhere"]
        elif settings["append_eos"]:
            rewrite_pair_post_processor(out_dir, tokenizer, layout)
        settings["tokenizer_pairs"] = _tokenizer_matches(out_dir, tokenizer, layout, max_length, trust_remote_code)
        if not settings["tokenizer_pairs"]:
            settings["kit_only"] = reasons + [f"{type(tokenizer).__name__}: could not make the exported tokenizer "
                                              "reproduce the trained input; score with retrieval_kit"]
        settings["portable"] = not settings["kit_only"]
        settings = head.finish_export(out_dir, settings, trust_remote_code, seq_cls)  # lm: seq_cls/
        with open(os.path.join(out_dir, SETTINGS_FILE), "w") as f:
            json.dump(settings, f, indent=2)
        if finish is not None:
            finish(out_dir)
    publish_dir(final)
    barrier()
    return settings


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
    edit_json(os.path.join(out_dir, "tokenizer_config.json"),
              lambda c: c.update(tokenizer_class="PreTrainedTokenizerFast", model_input_names=names))


def load_exported_reranker(model_dir, dtype=torch.float32, trust_remote_code=False):
    """(the head's scorer in eval mode, tokenizer, settings) from a train_reranker.py export, with the
    saved padding side, pooling and attention direction applied."""
    from .models import load_tokenizer, make_bidirectional, setup_pad_token

    settings = heads.read_spec(model_dir).kit  # (the dir read and checked as a whole)
    if settings.get("kind") != "reranker":
        raise SystemExit(f"{model_dir}: " + (f"a {settings['kind']} export (its {SETTINGS_FILE}), not a reranker" if
                                             settings.get("kind") else f"not an export of train_reranker.py (no "
                                             f"{SETTINGS_FILE} saying how it scores pairs)") +
                         ": pass the dir train_reranker.py exported")
    missing = [k for k in ("prompt_template", "rerank_max_length") if k not in settings]
    if missing:
        raise SystemExit(f"{os.path.join(model_dir, SETTINGS_FILE)}: no {' or '.join(missing)} (how the reranker "
                         "tokenized pairs): copy the export whole again")
    head = heads.get(settings.get("head", heads.RERANKER[0]))
    tokenizer = load_tokenizer(model_dir, trust_remote_code)
    if settings.get("padding_side"):
        tokenizer.padding_side = settings["padding_side"]
    net = head.load(model_dir, dtype, trust_remote_code=trust_remote_code)
    setup_pad_token(tokenizer, net)
    if settings.get("bidirectional"):
        make_bidirectional(net)
    model = head.scorer(net, settings.get("pooling", "native"), settings.get("lm_token_ids"))
    return model.eval(), tokenizer, settings

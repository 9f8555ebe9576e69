"""Decoder embedders (issue 26): a decoder bi-encoder pads on the left and ends each text with EOS
(through its tokenizer, so the export's tokenizer does too), pools the last token by default,
attends both ways with --bidirectional (proven on Llama, Qwen3 and Mistral, and kept by a reload),
and its LoRA export loads in SentenceTransformer, in transformers (merged) and in peft (adapter)
with the embeddings of the unmerged model; a LoRA run killed with SIGKILL resumes bitwise."""

import json
import os
import signal

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from retrieval_kit import ckpt, lora
from retrieval_kit.collate import tokenize
from retrieval_kit.heads import biencoder_settings
from retrieval_kit.heads.single_vector import BiEncoder, encode
from retrieval_kit.heads import read_spec
from retrieval_kit.models import (load_encoder, load_tokenizer, make_bidirectional,
                                  prepare_embedder)
from tests.conftest import run_script, WORDS
from tests.test_ckpt import assert_same_run, kill_after_checkpoint, launch
from tests.test_lora import causal_config

PROMPT = "Instruct: find the package\nQuery: "
LAST, AVG = ({"pooling": p, "query_max_length": 32, "passage_max_length": 32} for p in ("last", "avg"))
TEXTS = ["python server", "a graphical user interface tool for the command line", "data"]


def word_tokenizer(**kw):
    """Word-level, BOS-prefixed, no pad token: like many decoder checkpoints (kw: Llama-style flags)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = ["<unk>", "<s>", "</s>"] + WORDS + [":", "question", "passage", "Instruct", "Query", "find", "the",
                                                 "package", "a", "tool", "for", "data"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(dict.fromkeys(vocab))}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", **kw)


@pytest.fixture(scope="module")
def qwen3_base(tmp_path_factory):
    """A tiny random Qwen3 (AutoModel) with a tokenizer that has no pad token."""
    out = tmp_path_factory.mktemp("qwen3_base")
    tok = word_tokenizer()
    torch.manual_seed(0)
    AutoModel.from_config(causal_config("qwen3", vocab_size=len(tok), pad_token_id=None)).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("llama_style", [False, True])
def test_a_decoder_pads_left_and_ends_each_text_with_eos_and_so_does_its_saved_tokenizer(llama_style, qwen3_base,
                                                                                         tmp_path):
    tok = word_tokenizer(**({"add_bos_token": True, "add_eos_token": False} if llama_style else {}))
    model = load_encoder(qwen3_base)
    done = prepare_embedder(tok, model, LAST)
    assert done == {"decoder": True, "append_eos": True, "padding_side": "left", "bidirectional": False}
    batch = tokenize(tok, TEXTS, 16, PROMPT)
    assert (batch["input_ids"][:, -1] == tok.eos_token_id).all() and (batch["attention_mask"][:, -1] == 1).all()
    assert (batch["attention_mask"][:, 0] == 0).any()  # rows of different lengths: padded on the left
    bare = tok(TEXTS[0], add_special_tokens=False)["input_ids"]
    assert tok(TEXTS[0])["input_ids"] == [tok.bos_token_id] + bare + [tok.eos_token_id]
    tok.save_pretrained(tmp_path)  # a model-specific class may rebuild its post-processor on load
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(TEXTS)["input_ids"] == tok(TEXTS)["input_ids"] and again.padding_side == "left"
    assert prepare_embedder(again, load_encoder(qwen3_base), LAST)["append_eos"]  # already: unchanged
    assert again(TEXTS)["input_ids"] == tok(TEXTS)["input_ids"]
    no_eos = word_tokenizer()
    assert not prepare_embedder(no_eos, load_encoder(qwen3_base), LAST, append_eos=False)["append_eos"]
    assert no_eos(TEXTS[0])["input_ids"][-1] != no_eos.eos_token_id


def test_decoders_pool_the_last_token_by_default_and_encoders_refuse_the_decoder_flags(qwen3_base, tiny_model_dir):
    assert biencoder_settings(read_spec(qwen3_base), {})["pooling"] == "last"
    assert biencoder_settings(read_spec(tiny_model_dir), {})["pooling"] == "avg"
    assert biencoder_settings(read_spec(qwen3_base), {"pooling": "avg"})["pooling"] == "avg"
    for flag, kw in (("--append-eos", {"append_eos": True}), ("--bidirectional", {"bidirectional": True})):
        with pytest.raises(SystemExit, match=f"{flag}: BertModel is an encoder \\(bert\\)"):
            prepare_embedder(load_tokenizer(tiny_model_dir), load_encoder(tiny_model_dir), AVG, **kw)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
def test_bidirectional_is_real_and_survives_a_reload(kind, tmp_path):
    torch.manual_seed(0)
    model = AutoModel.from_config(causal_config(kind)).eval()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9], [1, 5, 6, 7, 8, 9]])
    changed = ids.clone()
    changed[:, -1] = 10  # only the last token changes
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])  # one row without padding, one padded on the left

    def states(m, x):
        with torch.no_grad():
            return m(input_ids=x, attention_mask=mask).last_hidden_state
    causal = states(model, ids) - states(model, changed)
    assert causal[:, :-1].abs().max() < 1e-6  # causal: no earlier position sees the last token
    make_bidirectional(model)
    both = states(model, ids) - states(model, changed)
    assert both[0, 0].abs().max() > 1e-4 and both[1, 2].abs().max() > 1e-4  # the first real token now sees it
    model.save_pretrained(tmp_path)  # config.json: is_causal false, which from_pretrained honours
    reloaded = AutoModel.from_pretrained(tmp_path).eval()
    assert (states(reloaded, ids) - states(model, ids)).abs().max() < 1e-5


# ----- a LoRA decoder-embedder run: SIGKILL + resume, and its exports ------------------------------

STEPS = 6


def lora_args(base, train_file, out, *extra):
    return ["--model", base, "--train-file", train_file, "--val-file", "", "--batch-size", 4, "--query-max-length", 32,
            "--passage-max-length", 32, "--lr-schedule", "constant", "--warmup-steps", 2, "--lr", 1e-3,
            "--ckpt-every", 2, "--output-dir", out, "--lora-rank", 4, "--bidirectional", "--query-prefix", PROMPT,
            "--export-adapter", *extra]


@pytest.fixture(scope="module")
def lora_run(qwen3_base, small_train_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_run")
    run_script("train_biencoder.py", lora_args(qwen3_base, small_train_file, out, "--max-steps", STEPS,
                                               "--keep-last", 0))
    return str(out)


@pytest.mark.slow
def test_a_lora_run_killed_with_sigkill_resumes_bitwise(lora_run, qwen3_base, small_train_file, tmp_path):
    args = lora_args(qwen3_base, small_train_file, tmp_path)
    proc = launch("train_biencoder.py", args + ["--max-steps", 100000])  # constant LR: the same path
    rc, _, _ = kill_after_checkpoint(proc, tmp_path / "step_000002", signal.SIGKILL)
    assert rc == -signal.SIGKILL
    run_script("train_biencoder.py", args + ["--max-steps", STEPS, "--resume", "auto"])
    assert_same_run(lora_run, tmp_path)
    from safetensors.torch import load_file

    kept = load_file(tmp_path / "step_000002" / "model.safetensors")  # the adapters only, not the frozen base
    assert kept and all(".lora_A." in k or ".lora_B." in k for k in kept)


@pytest.mark.slow
def test_the_lora_decoder_export_embeds_alike_in_sentence_transformers_transformers_and_peft(lora_run, qwen3_base):
    from peft import PeftModel
    from sentence_transformers import SentenceTransformer

    final = os.path.join(lora_run, "final")
    with open(os.path.join(final, "retrieval_kit.json")) as f:
        saved = json.load(f)
    assert saved["pooling"] == "last" and saved["decoder"] and saved["append_eos"] and saved["bidirectional"]
    assert saved["lora"]["rank"] == 4 and saved["lora"]["base_model"] == qwen3_base
    with open(os.path.join(final, "config.json")) as f:
        assert json.load(f)["is_causal"] is False

    # the kit on the merged export (as evaluate / mine / score load it)
    tok, enc = load_tokenizer(final), load_encoder(final).eval()
    settings = biencoder_settings(read_spec(final), {})
    prepare_embedder(tok, enc, settings)
    q_batch, p_batch = tokenize(tok, TEXTS, 32, settings["query_prefix"]), tokenize(tok, TEXTS, 32)
    with torch.no_grad():
        kit_q, kit_p = (BiEncoder(enc, "last").embed(b) for b in (q_batch, p_batch))
    assert settings["query_prefix"] == PROMPT

    # the unmerged model: the base, bidirectional, with the last checkpoint's adapters
    base = load_encoder(qwen3_base)
    make_bidirectional(base)
    lora.apply_lora(base, 4, 8, 0.1)
    ckpt.restore_model(base, os.path.join(lora_run, f"step_{STEPS:06d}"), torch.float32)
    with torch.no_grad():
        unmerged = encode(base.eval(), p_batch, "last")
    assert (unmerged - kit_p).abs().max() < 1e-5

    # sentence-transformers on the export: its last-token pooling, its query prompt
    st = SentenceTransformer(final, device="cpu")
    st_q = st.encode(TEXTS, prompt_name="query", convert_to_tensor=True)
    st_p = st.encode(TEXTS, convert_to_tensor=True)
    assert (st_q - kit_q).abs().max() < 1e-5 and (st_p - kit_p).abs().max() < 1e-5

    # peft's PeftModel on the adapter dir, over the base made bidirectional
    peft = PeftModel.from_pretrained(make_bidirectional(AutoModel.from_pretrained(qwen3_base)),
                                     os.path.join(final, "adapter")).eval()
    with torch.no_grad():
        assert (encode(peft, p_batch, "last") - kit_p).abs().max() < 1e-5
    base_only = load_encoder(qwen3_base).eval()
    make_bidirectional(base_only)
    with torch.no_grad():
        assert (encode(base_only, p_batch, "last") - kit_p).abs().max() > 1e-4  # training did move it

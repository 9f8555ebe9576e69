"""The LLM reranker (train_reranker.py --head lm, issue 26): a causal LM scored by its own LM head,
logit(yes) - logit(no) after each pair's last real token - against AutoModelForCausalLM's full
logits at that position, on tiny random Llama and Qwen3 models built from configs; the LM head is
never applied to a sequence of positions (only the two vocabulary rows meet the last hidden state)."""

import os

import pytest
import torch

from retrieval_kit.collate import collate_rerank
from retrieval_kit.pairs import TEMPLATE_PRESETS
from retrieval_kit.heads import lm
from retrieval_kit.models import setup_pad_token

lm_token_ids, load_lm_reranker = lm.token_ids, lm.load
from tests.conftest import python_run, ROOT, run_script, WORDS

QUERIES = ["python package manager", "graphical user interface"]
GROUPS = [["a tool for the command line", "python library documentation", "server"],
          ["the client interface", "data files", "a graphical tool for the user"]]


@pytest.fixture(scope="module")
def lm_tokenizer():
    """A word-level tokenizer with yes / no, the chat markers Qwen3-Reranker's layout uses, and no pad token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = ["<unk>", "<s>", "</s>", "x", "y"] + WORDS + ["yes", "no", ":", "<", ">", "question", "passage", "Query",
                                                  "Document"]  # x, y: the probe of the pair encoding
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def causal_dir(kind, tokenizer, out):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config}[kind]
    config = config_class(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                          eos_token_id=2, tie_word_embeddings=kind == "qwen3", head_dim=8)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_lm_head_score_is_the_causal_lms_yes_minus_no_at_the_last_token(kind, lm_tokenizer, tmp_path):
    path = causal_dir(kind, lm_tokenizer, tmp_path / kind)
    net = load_lm_reranker(path).eval()
    tok = lm_tokenizer
    setup_pad_token(tok, net)
    tok.padding_side = "left"
    ids = lm_token_ids(tok, ["yes", "no"])
    calls = []
    net.get_output_embeddings().register_forward_hook(lambda m, inputs, out: calls.append(inputs[0].shape))
    for template in ("question:{query} \n \n passage:{passage}", TEMPLATE_PRESETS["qwen3"]):
        batch = collate_rerank(tok, QUERIES, GROUPS, template, max_length=192)
        assert (batch["attention_mask"][:, 0] == 0).any()  # rows of different lengths, padded on the left
        with torch.no_grad():
            kit = lm.LMScore(net, ids)(pairs=batch)["pairs"]
            assert not calls  # the kit never ran the LM head over positions
            logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, -1]
        calls.clear()
        want = logits[:, ids[0]] - logits[:, ids[1]]
        assert kit.shape == (6,) and (kit - want).abs().max() < 1e-5, (kit, want)


def test_lm_tokens_must_be_one_token_each(lm_tokenizer):
    assert lm_token_ids(lm_tokenizer, ["yes", "no"]) == [lm_tokenizer.convert_tokens_to_ids(w) for w in ("yes", "no")]
    with pytest.raises(SystemExit, match=r"--lm-tokens: 'yes please' is 2 tokens"):
        lm_token_ids(lm_tokenizer, ["yes please", "no"])
    with pytest.raises(SystemExit, match="are the same token"):
        lm_token_ids(lm_tokenizer, ["yes", "yes"])


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_a_head_lm_run_exports_a_causal_lm_that_scores_as_the_kit(lora, lm_tokenizer, small_train_file, tmp_path):
    from transformers import AutoModelForCausalLM

    from retrieval_kit.encode import rerank_groups
    from retrieval_kit.pairs import rerank_layout
    from retrieval_kit.export import load_exported_reranker

    path = causal_dir("qwen3", lm_tokenizer, tmp_path / "qwen3")
    out = tmp_path / "run"
    run_script("train_reranker.py", ["--model", path, "--head", "lm", "--prompt-template", "qwen3", "--train-file",
                                     small_train_file, "--val-max-groups", 8, "--batch-size", 2, "--n-passages", 2,
                                     "--rerank-max-length", 192, "--max-steps", 2, "--output-dir", out,
                                     *(["--lora-rank", 4, "--lr", 1e-2, "--export-adapter"] if lora else [])])
    model, tok, settings = load_exported_reranker(str(out / "final"))
    assert settings["head"] == "lm" and tok.padding_side == "left" and settings["portable"], settings["kit_only"]
    kit = rerank_groups(model, tok, QUERIES, GROUPS, settings)  # (2, 3)
    # the stock loader on the pairs as the export tokenizes them: the trained template's ids, padded left
    batch = collate_rerank(tok, QUERIES, GROUPS, max_length=192, layout=rerank_layout(tok, settings))
    lm_tokenizer.pad_token, lm_tokenizer.padding_side = lm_tokenizer.eos_token, "left"
    trained = collate_rerank(lm_tokenizer, QUERIES, GROUPS, TEMPLATE_PRESETS["qwen3"], max_length=192)
    assert torch.equal(batch["input_ids"], trained["input_ids"])
    net = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    with torch.no_grad():
        logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, -1]
    yes, no = settings["lm_token_ids"]
    assert (kit.view(-1) - (logits[:, yes] - logits[:, no])).abs().max() < 1e-5
    from sentence_transformers import CrossEncoder as STCrossEncoder  # its LogitScore module, as the export declares

    pairs = [(q, p) for q, g in zip(QUERIES, GROUPS) for p in g]
    st = torch.tensor(STCrossEncoder(str(out / "final"), device="cpu").predict(pairs, batch_size=4))
    assert (st - kit.view(-1)).abs().max() < 1e-5, (st, kit)
    assert os.path.isfile(out / "final" / "README.md")
    if lora:  # the merged export above; peft's PeftModel on the adapter dir over the base gives the same
        from peft import PeftModel

        assert settings["lora"]["rank"] == 4 and settings["lora"]["modules_to_save"] == []
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), out / "final" / "adapter").eval()
        with torch.no_grad():
            got = peft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, -1]
            base = AutoModelForCausalLM.from_pretrained(path).eval()(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, -1]
        assert (got[:, yes] - got[:, no] - kit.view(-1)).abs().max() < 1e-5
        assert (base[:, yes] - base[:, no] - kit.view(-1)).abs().max() > 1e-4  # the adapters did move the scores


@pytest.mark.slow
def test_a_template_longer_than_the_max_length_is_one_sentence_at_start_up(lm_tokenizer, small_train_file, tmp_path):
    path = causal_dir("qwen3", lm_tokenizer, tmp_path / "qwen3")
    out = python_run([os.path.join(ROOT, "train_reranker.py"), "--model", path, "--head", "lm", "--prompt-template",
                      "qwen3", "--rerank-max-length", 64, "--train-file", small_train_file, "--val-file", "",
                      "--output-dir", tmp_path / "run"])
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "--rerank-max-length 64 leaves no room for text" in out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first step

"""Flags checked against each other and against the model (issue 30): max lengths beyond the model's
positions or too short for its special tokens, max lengths that are not a multiple of
--pad-to-multiple-of (the padding is rounded, not the truncation), a reranker with one pair per
query, --sharded-checkpoints under DDP, warmup past the last step, a bi-encoder export given as a
reranker, Matryoshka sizes beyond the embedding."""

import pytest
import torch

from retrieval_kit import cli
from retrieval_kit.collate import tokenize
from retrieval_kit.models import check_max_lengths, load_encoder, load_tokenizer
from tests.conftest import python_run, ROOT
from tests.test_lora import causal_config


def test_max_lengths_are_checked_against_the_models_positions_and_special_tokens(tiny_model_dir):
    tok, config = load_tokenizer(tiny_model_dir), load_encoder(tiny_model_dir).config  # 128 positions
    check_max_lengths(config, tok, {"--passage-max-length": 128, "--query-max-length": 3}, 8)
    with pytest.raises(SystemExit, match=r"--passage-max-length 200 is beyond the 128 positions of bert "
                                         r"\(max_position_embeddings\): give at most 128"):
        check_max_lengths(config, tok, {"--passage-max-length": 200}, 8)
    check_max_lengths(config, tok, {"--rerank-max-length": 127}, 8)  # padded to 128: fits
    with pytest.raises(SystemExit, match=r"--rerank-max-length 129 \(padded to 136, a multiple of "
                                         r"--pad-to-multiple-of 8\) is beyond the 128 positions"):
        check_max_lengths(config, tok, {"--rerank-max-length": 129}, 8)
    with pytest.raises(SystemExit, match=r"--query-max-length 2: the tokenizer adds 2 special token\(s\) to every "
                                         r"text; give at least 3"):
        check_max_lengths(config, tok, {"--query-max-length": 2}, 8)


def test_a_decoder_beyond_its_positions_is_a_warning(capsys):
    from transformers import AutoTokenizer

    from tests.conftest import minilm_dir

    config = causal_config("qwen3")  # 128 positions, rotary
    check_max_lengths(config, AutoTokenizer.from_pretrained(minilm_dir()), {"--passage-max-length": 304}, 8)
    assert "warning: --passage-max-length 304 is beyond the 128 positions of qwen3" in capsys.readouterr().out


def test_a_max_length_that_is_not_a_multiple_of_the_padding_pads_up_and_truncates_at_it(tokenizer):
    long = " ".join(["word"] * 100)
    for n in (30, 100, 20):
        batch = tokenize(tokenizer, [long, "short text"], n, pad_to_multiple_of=8)
        assert batch["input_ids"].shape[1] == -(-n // 8) * 8  # padded up to the multiple
        assert batch["attention_mask"].sum(1).tolist()[0] == n  # truncated at the max length
        plain = tokenize(tokenizer, [long, "short text"], n)
        assert torch.equal(batch["input_ids"][:, :n], plain["input_ids"])


@pytest.mark.parametrize("argv,says", [
    (["--n-passages", "1"], "--n-passages 1: a reranker learns by ranking"),
    (["--sharded-checkpoints"], "--sharded-checkpoints: only with --parallel fsdp2"),
    (["--lora-alpha", "8"], "--lora-alpha: only with --lora-rank"),
])
def test_flags_that_cannot_go_together_are_one_sentence(argv, says):
    with pytest.raises(SystemExit, match=says.replace("(", r"\(")):
        cli.parse(cli.reranker_parser(), argv)


def test_warmup_past_the_last_step_is_a_warning(capsys):
    cli.parse(cli.biencoder_parser(), ["--warmup-steps", "10", "--max-steps", "2"])
    assert "warning: --warmup-steps 10 > --max-steps 2: the LR never reaches --lr" in capsys.readouterr().out


def test_evaluate_refuses_a_biencoder_as_reranker_and_dims_beyond_the_embedding(tiny_model_dir, small_beir, tmp_path):
    from retrieval_kit.export import export_model

    out = export_model(str(tmp_path / "bi"), load_encoder(tiny_model_dir), load_tokenizer(tiny_model_dir),
                       {"kind": "biencoder", "pooling": "avg", "normalize": True, "query_prefix": "",
                        "passage_prefix": "", "query_max_length": 32, "passage_max_length": 32})
    for extra, says in ((["--reranker", out], f"{out}: a biencoder export (its retrieval_kit.json), not a reranker"),
                        (["--truncate-dims", "16,64"], "--truncate-dims 16,64: " + out + " embeds in 32 dimensions")):
        res = python_run(["-m", "retrieval_kit.evaluate", "--model", out, "--beir", small_beir, *extra],
                         cwd=ROOT)
        assert res.returncode in (1, 2) and "Traceback" not in res.stderr and says in res.stderr, res.stderr[-2000:]


def test_a_full_disk_reads_the_same_from_python_torch_save_and_tokenizers(tokenizer):
    """/dev/full fails every write with ENOSPC: each writer's own error becomes the one reason."""
    from retrieval_kit.flags import os_reason, writing

    writers = {"tokenizers": lambda: tokenizer.backend_tokenizer.save("/dev/full"),
               "torch.save": lambda: torch.save({"w": torch.zeros(100_000)}, "/dev/full"),
               "python": lambda: open("/dev/full", "w").write("x" * 100_000)}
    for name, write in writers.items():
        with pytest.raises(Exception) as got:
            write()
        assert os_reason(got.value) in ("No space left on device", "the file could not be written whole (a full disk "
                                        "or a file-size limit)"), (name, got.value)
        with pytest.raises(SystemExit, match=r"cannot write the export: .+; the last checkpoint is intact"):
            with writing("the export", then=lambda: "the last checkpoint is intact"):
                write()
    with pytest.raises(ValueError):  # anything else is a bug: its traceback stays
        with writing("the export"):
            raise ValueError("not a write")


def test_a_log_write_that_fails_is_one_sentence_naming_the_newest_checkpoint(tmp_path):
    from retrieval_kit.log import Logger

    logger = Logger(str(tmp_path), {}, total_steps=10)
    logger.log(1, {"loss": 1.0})
    logger.jsonl = open("/dev/full", "w")  # the disk fills up mid-run
    with pytest.raises(SystemExit, match=f"cannot write the run's logs in {tmp_path}: No space left on device; the "
                                         "newest intact checkpoint is none: free space, then continue with --resume "
                                         "auto"):
        logger.log(2, {"loss": 0.5})
    logger.jsonl = open(tmp_path / "metrics.jsonl", "a")
    logger.close()


def test_select_best_keeps_the_best_in_its_direction_and_refuses_a_metric_no_validation_logs():
    from retrieval_kit.loop import LoopState

    state, seen = LoopState(), []
    for step, loss, acc in ((0, 1.0, 0.5), (2, 0.8, 0.4), (4, 0.9, 0.7)):
        logged = {"train": {"step": step, "loss": 3.0}, "val": {"step": step, "loss": loss, "acc@1": acc}}
        seen.append(state.observe("val/loss", logged, step))
    assert seen == [True, True, False] and state.best == {"metric": "val/loss", "value": 0.8, "step": 2}
    state = LoopState()
    assert [state.observe("val/acc@1", {"val": {"step": s, "acc@1": a}}, s) for s, a in ((0, .5), (2, .4), (4, .7))] \
        == [True, False, True]
    assert not state.observe("val/acc@1", {"val": {"step": 4, "acc@1": .9}}, 5)  # no validation at step 5
    with pytest.raises(SystemExit, match=r"--select-best val/ndcg@10: no validation of this run logs it; it logs "
                                         r"val/loss, val/acc@1"):
        LoopState().observe("val/ndcg@10", {"val": {"step": 0, "loss": 1.0, "acc@1": 0.5}}, 0)
    with pytest.raises(SystemExit, match="--select-best dev/ndcg@10: no validation"):
        LoopState().observe("dev/ndcg@10", {"val": {"step": 0, "loss": 1.0}}, 0)

"""Issue 61: a stop signal honoured between the batches of an evaluation. With a watched signal
(ckpt.StopSignal calls dist.watch_stop) encoding, pair scoring and the fixed-group validation raise
dist.Interrupted at their next batch; without one (the tools) nothing changes; loop.until_stopped turns it
into the loop's stop; after the loop, the entry point exits 0 with one line (the 2-rank, real-signal runs:
tests/test_ckpt.py)."""

import pytest
import torch

from retrieval_kit import dist, loop
from retrieval_kit.metrics import WindowedAverage


class Counting:
    """A `requested()` that says yes from its n-th call on: the evaluation stops at its n-th batch."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def __call__(self):
        self.calls += 1
        return self.calls >= self.n


@pytest.fixture
def watched():
    yield lambda requested: dist.watch_stop(requested)
    dist.watch_stop(None)


def test_encoding_and_pair_scoring_stop_at_the_next_batch_only_when_watched(tiny_model_dir, watched):
    from retrieval_kit.encode import encode_texts, score_pairs
    from retrieval_kit.heads import classifier, single_vector
    from retrieval_kit.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    texts = [f"text number {i}" for i in range(10)]
    embedder = single_vector.embedder(single_vector.load(tiny_model_dir), {"pooling": "avg", "normalize": True})
    want = encode_texts(embedder, tok, texts, 16, batch_size=2)  # (no watched signal: the tools)
    asked = Counting(3)
    watched(asked)
    with pytest.raises(dist.Interrupted):
        encode_texts(embedder, tok, texts, 16, batch_size=2)
    assert asked.calls == 3  # stopped before its third of five batches
    watched(lambda: False)
    assert torch.equal(encode_texts(embedder, tok, texts, 16, batch_size=2), want)  # watched, not asked: the same
    scorer = classifier.scorer(classifier.load(tiny_model_dir), "native", None).eval()
    settings = {"prompt_template": "pair", "rerank_max_length": 32, "append_eos": False}
    watched(Counting(2))
    with pytest.raises(dist.Interrupted):
        score_pairs(scorer, tok, texts, texts, settings, batch_size=3)


def test_until_stopped_turns_a_stop_into_the_loops_and_returns_nothing(watched, capsys):
    state = loop.LoopState(step=4, loss_avg=WindowedAverage(2))

    def validation():
        dist.stop_point()
        return {"val": {"loss": 1.0}}

    assert loop.until_stopped(state, validation) == {"val": {"loss": 1.0}} and not state.stopping
    watched(lambda: True)
    assert loop.until_stopped(state, validation) == {} and state.stopping
    assert "a stop signal during validation at step 4" in capsys.readouterr().out


def test_a_stop_after_the_loop_exits_0_in_one_line(watched, capsys):
    from retrieval_kit.rundir import exit_on_data_error

    def main():  # the reranker's fusion choice, --merge-alphas' candidates: after the last checkpoint
        dist.stop_point()

    watched(lambda: True)
    with pytest.raises(SystemExit) as e:
        exit_on_data_error(main)
    assert e.value.code == 0
    assert "stopped by a signal during the run's final dev scoring" in capsys.readouterr().out

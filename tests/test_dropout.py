"""retrieval_kit/dropout.py (--fast-dropout) against plain references, and hostmem.py (--keep-freed-memory)."""

import os
import subprocess
import sys

import pytest
import torch

from retrieval_kit.dropout import ATTN_NAME, FastDropout, apply_fast_dropout, attention, lane_dropout, lane_mask


def test_lane_mask_drops_at_the_rate_asked_and_follows_the_seed():
    for p in (0.1, 0.5):
        torch.manual_seed(0)
        keep = lane_mask((1024, 4097), p, "cpu")  # an element count that is not a multiple of 4
        assert keep.dtype == torch.bool and keep.shape == (1024, 4097)
        exact = 1 - round(p * 65536) / 65536
        assert abs(keep.float().mean().item() - exact) < 2e-3  # about 8 binomial standard deviations
        torch.manual_seed(0)
        assert torch.equal(keep, lane_mask((1024, 4097), p, "cpu"))
        assert not torch.equal(keep, lane_mask((1024, 4097), p, "cpu"))  # the stream moves on
    # the lanes of one word are independent: the four lanes' keep rates and pair rates match the product
    torch.manual_seed(1)
    lanes = lane_mask((1 << 20, 4), 0.5, "cpu").float()
    assert torch.allclose(lanes.mean(0), torch.full((4,), 0.5), atol=3e-3)
    assert abs((lanes[:, 0] * lanes[:, 1]).mean().item() - 0.25) < 3e-3


def test_lane_dropout_is_the_masked_scaled_input_and_its_gradient():
    x = torch.randn(7, 33, requires_grad=True)
    torch.manual_seed(3)
    y = lane_dropout(x, 0.25)
    torch.manual_seed(3)
    keep = lane_mask(x.shape, 0.25, "cpu")
    torch.testing.assert_close(y, torch.where(keep, x / 0.75, 0.0), rtol=1e-6, atol=0)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad, torch.where(keep, g / 0.75, 0.0), rtol=1e-6, atol=0)
    assert lane_dropout(x, 0.25, training=False) is x and lane_dropout(x, 0.0) is x
    with pytest.raises(ValueError):
        lane_dropout(x, 1.0)


class _Attn(torch.nn.Module):
    def __init__(self, groups=1, causal=False):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, causal


@pytest.mark.parametrize("groups,causal,mask_kind", [(1, False, "bool"), (1, False, None), (2, True, None),
                                                     (2, True, "float")])
def test_attention_is_the_softmax_maths_with_the_lane_mask(groups, causal, mask_kind):
    torch.manual_seed(0)
    b, h, n, d = 2, 4, 6, 8
    q = torch.randn(b, h, n, d, requires_grad=True)
    k, v = (torch.randn(b, h // groups, n, d, requires_grad=True) for _ in range(2))
    pad = torch.ones(b, n, dtype=torch.bool)
    pad[1, 4:] = False  # the second row has 2 pad columns
    allowed = pad[:, None, None, :].expand(b, 1, n, n) if mask_kind else torch.ones(b, 1, n, n, dtype=torch.bool)
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool).tril()
    mask = {"bool": allowed, "float": torch.zeros(b, 1, n, n).masked_fill(~allowed, -1e9), None: None}[mask_kind]
    module = _Attn(groups, causal)

    torch.manual_seed(7)
    out, _ = attention(module, q, k, v, mask, dropout=0.3, scaling=0.2, is_causal=causal if mask is None else None)
    # the reference: a plain loop over heads, each reading its key/value group
    torch.manual_seed(7)
    keep = lane_mask((b, h, n, n), 0.3, "cpu")
    ref = torch.empty(b, n, h, d)
    for i in range(b):
        for j in range(h):
            s = (q[i, j] @ k[i, j // groups].T) * 0.2
            s = s.masked_fill(~allowed[i, 0], float("-inf"))
            p = torch.softmax(s, -1) * keep[i, j] / 0.7
            ref[i, :, j] = p @ v[i, j // groups]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)
    # dropout 0 (eval) is SDPA itself
    out0, _ = attention(module, q, k, v, mask, dropout=0.0, scaling=0.2, is_causal=causal if mask is None else None)
    ref0 = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=allowed, scale=0.2)
    torch.testing.assert_close(out0, ref0.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_fast_dropout_on_a_bert_swaps_every_dropout_keeps_eval_and_exports_plainly(tiny_model_dir, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    from retrieval_kit.models import load_encoder

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    batch = tok(["a short one", "a longer sentence, so the first one is padded"], padding=True, return_tensors="pt")
    plain, fast = load_encoder(tiny_model_dir).eval(), load_encoder(tiny_model_dir).eval()
    swapped, routed = apply_fast_dropout(fast)
    n_dropout = sum(isinstance(m, torch.nn.Dropout) for m in plain.modules())
    assert swapped == n_dropout > 0 and routed
    assert all(isinstance(m, FastDropout) for m in fast.modules() if isinstance(m, torch.nn.Dropout))
    assert fast.config._attn_implementation == ATTN_NAME
    with torch.no_grad():
        torch.testing.assert_close(fast(**batch).last_hidden_state, plain(**batch).last_hidden_state, rtol=0, atol=0)
    fast.train()
    torch.manual_seed(0)
    a = fast(**batch).last_hidden_state
    torch.manual_seed(0)
    assert torch.equal(a, fast(**batch).last_hidden_state)
    assert not torch.allclose(a, plain(**batch).last_hidden_state)  # dropout is on in train mode
    fast.save_pretrained(tmp_path)
    assert ATTN_NAME not in (tmp_path / "config.json").read_text()
    again = AutoModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(**batch).last_hidden_state, plain(**batch).last_hidden_state)


FAULTS = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from retrieval_kit.hostmem import keep_freed_memory
    assert keep_freed_memory()

def step():  # a word-embedding gradient and attention scores, allocated and freed as a step does
    a = torch.zeros(30522, 384)
    b = torch.ones(4, 12, 256, 256)
    del a, b

for _ in range(10):  # glibc's bins settle within a few steps
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_spares_the_page_faults_of_reallocating():
    def faults(mode):
        out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return int(out.stdout.split()[-1])

    system, kept = faults("system"), faults("keep")
    pages = 10 * (30522 * 384 + 4 * 12 * 256 * 256) * 4 // 4096
    assert system > pages // 4  # the 47 MB block is mapped afresh each time and faults its pages in
    assert kept < pages // 100  # reused: next to none


def test_fast_dropout_leaves_a_sliding_window_attention_to_sdpa():
    from transformers import Qwen2Config, Qwen2Model

    kw = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2)
    assert apply_fast_dropout(Qwen2Model(Qwen2Config(**kw))) == (0, True)  # no dropout modules; the attention
    windowed = Qwen2Model(Qwen2Config(use_sliding_window=True, sliding_window=8, **kw))
    assert apply_fast_dropout(windowed) == (0, False) and windowed.config._attn_implementation == "sdpa"

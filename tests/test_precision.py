"""The resume order decides the AdamW moment dtype: model -> cast -> optimizer keeps them fp32."""

import pytest
import torch

from retrieval_kit import ckpt, optim, precision
from retrieval_kit.heads.classifier import load as load_reranker
from tests.conftest import needs_cpu_bf16


def test_resolve_storage_dtype():
    r = precision.resolve_storage_dtype
    assert r() is torch.float32 and r("auto") is torch.float32
    assert r("bf16") is torch.bfloat16  # explicit wins
    assert r(None, force_fp32_params=True) is torch.float32
    assert r("fp32", force_fp32_params=True) is torch.float32
    with pytest.raises(SystemExit, match="--force-fp32-params conflicts with --torch-dtype bf16"):
        r("bf16", force_fp32_params=True)
    for storage, compute, flag in (("fp16", None, "--torch-dtype fp16"), ("auto", "fp16", "--compute-dtype fp16")):
        with pytest.raises(SystemExit, match=f"{flag}: fp16 needs loss scaling"):
            precision.resolve(storage, False, compute, "ddp")
    assert precision.resolve("auto", False, "bf16", "ddp") == (torch.float32, torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown dtype"):
        precision.parse_dtype("fp8")


def one_step(net, opt):
    torch.manual_seed(0)
    ids = torch.randint(5, 100, (4, 12))
    loss = net(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def build(net):
    opt = optim.build_optimizer(optim.param_groups(net, 0.01), lr=1e-3)
    return opt, optim.build_scheduler(opt, 0, 10)


def moment_dtypes(opt):
    return {s for _, s in precision.optimizer_state_dtypes(opt)}


@pytest.fixture
def bf16_checkpoint(tiny_model_dir, tmp_path):
    """A checkpoint written by a bf16 run: bf16 weights and bf16 AdamW moments."""
    net = load_reranker(tiny_model_dir, torch.bfloat16)
    opt, sched = build(net)
    one_step(net, opt)
    assert moment_dtypes(opt) == {torch.bfloat16}
    return ckpt.save_checkpoint(str(tmp_path), 1, net, opt, sched, {})


def test_kit_order_gives_fp32_moments(tiny_model_dir, bf16_checkpoint):
    dtype = precision.resolve_storage_dtype("auto", force_fp32_params=True)
    net = load_reranker(tiny_model_dir, dtype)        # 1. model in the storage dtype
    ckpt.load_model_weights(net, bf16_checkpoint)     #    + weights
    net.to(dtype)                                     # 2. cast
    opt, sched = build(net)                           # 3. optimizer, then its state
    ckpt.load_optimizer(opt, bf16_checkpoint)
    ckpt.load_scheduler(sched, bf16_checkpoint)       # 4. scheduler
    assert {p.dtype for p in net.parameters()} == {torch.float32}
    assert moment_dtypes(opt) == {torch.float32}
    precision.check_optimizer_state_dtype(opt)        # passes
    one_step(net, opt)
    assert moment_dtypes(opt) == {torch.float32}


def test_swapped_order_gives_bf16_moments_and_the_check_fires(tiny_model_dir, bf16_checkpoint):
    net = load_reranker(tiny_model_dir, torch.bfloat16)  # loaded in the checkpoint's dtype
    ckpt.load_model_weights(net, bf16_checkpoint)
    opt, _ = build(net)
    ckpt.load_optimizer(opt, bf16_checkpoint)             # state loaded into bf16 params ...
    net.to(torch.float32)                                 # ... and cast afterwards
    assert {p.dtype for p in net.parameters()} == {torch.float32}
    assert moment_dtypes(opt) == {torch.bfloat16}
    with pytest.raises(RuntimeError, match="model -> cast to storage dtype -> optimizer"):
        precision.check_optimizer_state_dtype(opt)


@needs_cpu_bf16
def test_autocast_forward_computes_in_bf16_and_hands_back_fp32_embeddings_and_scores(tiny_model_dir, tokenizer):
    """The inference tools' --compute-dtype bf16: the layers run in bf16 (seen by a hook), while the
    embeddings come back pooled and normalized in fp32, close to the fp32 model's, and the reranker's
    scores close to its fp32 scores."""
    import copy

    import torch.nn.functional as F

    from retrieval_kit.pairs import PAIR
    from retrieval_kit.encode import encode_texts, score_pairs
    from retrieval_kit.heads.classifier import Classifier
    from retrieval_kit.heads.single_vector import BiEncoder
    from retrieval_kit.models import load_encoder

    texts = ["a short text", "a somewhat longer text about package managers and their caches", "x"] * 3
    enc = load_encoder(tiny_model_dir).eval()
    fp32 = encode_texts(BiEncoder(enc), tokenizer, texts, 32)
    half = precision.autocast_forward(copy.deepcopy(enc), "cpu", torch.bfloat16)
    seen = []
    half.encoder.layer[0].intermediate.dense.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    got = encode_texts(BiEncoder(half), tokenizer, texts, 32)
    assert seen and set(seen) == {torch.bfloat16}
    assert got.dtype == torch.float32 and not torch.equal(got, fp32)
    assert F.cosine_similarity(got, fp32).min() > 0.999
    assert precision.autocast_forward(enc, "cpu", None) is enc and enc.forward.__func__ is type(enc).forward

    torch.manual_seed(0)
    rr = Classifier(load_reranker(tiny_model_dir)).eval()
    settings = {"prompt_template": PAIR, "rerank_max_length": 48, "append_eos": False, "padding_side": "right",
                "pad_to_multiple_of": 8}
    ref = score_pairs(rr, tokenizer, texts, texts[::-1], settings)
    bf = score_pairs(precision.autocast_forward(rr, "cpu", torch.bfloat16), tokenizer, texts, texts[::-1], settings)
    assert bf.dtype == torch.float32 and not torch.equal(bf, ref)
    assert (bf - ref).abs().max() <= 0.02 * ref.abs().max().clamp_min(1e-3)


def chunked_step(net, cast):
    """Forward three chunks of different lengths under `cast`, backward of one loss over them (the
    plain step's shape); (loss, {name: grad}, {saved bf16 storages by shape})."""
    saved = {}

    def keep(t):
        if t.dtype == torch.bfloat16:
            saved.setdefault(tuple(t.shape), set()).add(t.untyped_storage().data_ptr())
        return t

    net.zero_grad()
    torch.manual_seed(1)  # the same dropout masks both ways
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), cast():
        logits = [net(input_ids=torch.randint(5, 100, (rows, n))).logits for rows, n in ((2, 23), (3, 11), (4, 6))]
    loss = sum(x.float().pow(2).sum() for x in logits)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in net.named_parameters()}, saved


def test_shared_weight_casts_give_the_per_use_casts_numbers_and_keep_one_copy(tiny_model_dir):
    """precision.autocast casts each linear weight to bf16 once per context (SharedCasts), not once
    per chunk, and keeps one copy for the backward; the loss and every gradient are bitwise those of
    torch's autocast with a cast per use. A shared copy behind one autograd node (autocast's own
    cache) sums the uses' gradients in bf16 and fails the gradient check."""
    net = load_reranker(tiny_model_dir).train()
    linears = {tuple(m.weight.shape): 0 for m in net.modules() if isinstance(m, torch.nn.Linear)}
    for m in net.modules():
        if isinstance(m, torch.nn.Linear) and m is not net.classifier:  # the head computes in fp32
            linears[tuple(m.weight.shape)] += 1
    per_use = chunked_step(net, lambda: torch.autocast("cpu", torch.bfloat16, cache_enabled=False))
    shared = chunked_step(net, lambda: precision.autocast("cpu", torch.bfloat16))
    assert torch.equal(per_use[0], shared[0])
    assert all(torch.equal(per_use[1][k], shared[1][k]) for k in per_use[1]), \
        [k for k in per_use[1] if not torch.equal(per_use[1][k], shared[1][k])]
    for shape, n in linears.items():  # bf16 weight copies kept: one per weight, against one per chunk
        if n:
            assert len(shared[2][shape]) == n and len(per_use[2][shape]) == 3 * n, shape
    cached = chunked_step(net, lambda: torch.autocast("cpu", torch.bfloat16, cache_enabled=True))
    assert not all(torch.equal(per_use[1][k], cached[1][k]) for k in per_use[1])  # the test can tell


def test_shared_weight_casts_without_grad_and_inside_a_disabled_region(tiny_model_dir):
    """Under no_grad (validation, inference) the shared copy serves every chunk as is; a region
    with autocast off (the fp32 head) is left alone."""
    net = load_reranker(tiny_model_dir).eval()
    ids = torch.randint(5, 100, (3, 9))
    with torch.no_grad():
        with torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
            want = [net(input_ids=ids).logits for _ in range(2)]
        with precision.autocast("cpu", torch.bfloat16):
            got = [net(input_ids=ids).logits for _ in range(2)]
            with torch.autocast("cpu", enabled=False):
                fp32 = torch.nn.functional.linear(torch.ones(1, 32), net.classifier.weight)
    assert all(torch.equal(a, b) for a, b in zip(want, got)) and fp32.dtype == torch.float32

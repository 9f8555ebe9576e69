"""retrieval_kit.plan: the memory plan equals the bytes the real tensors hold after one AdamW step
(parameters by dtype, gradients, optimizer state) on tiny models, for one process and for 2 FSDP2
ranks (rank 0's shards), and the command line prints it without training."""

import json
import os
import sys

import pytest
import torch

from retrieval_kit import optim, plan
from retrieval_kit.heads.single_vector import BiEncoder
from retrieval_kit.models import load_encoder
from tests.conftest import python_run, ROOT, run_watched


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def real_bytes(model, optimizer):
    """What the tensors hold on this rank: params by dtype (a tied one once), grads, optimizer state."""
    params, seen = {}, set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        t = local(p)
        key = str(t.dtype).replace("torch.", "")
        params[key] = params.get(key, 0) + t.numel() * t.element_size()
    grads = sum(local(p.grad).numel() * local(p.grad).element_size() for p in model.parameters() if p.grad is not None)
    state = sum(local(v).numel() * local(v).element_size() for s in optimizer.state.values() for v in s.values()
                if torch.is_tensor(v))
    return {"params": params, "grads": grads, "optimizer": state}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plan_is_what_one_step_holds_in_one_process(tiny_model_dir, dtype):
    enc = load_encoder(tiny_model_dir, dtype)  # BERT's pooler: frozen, so no grad and no AdamW state
    want = plan.memory_plan(enc)
    opt = optim.build_optimizer(optim.param_groups(enc, 0.01), 1e-3)
    ids = torch.randint(5, 100, (4, 12))
    BiEncoder(enc)(q={"input_ids": ids, "attention_mask": torch.ones_like(ids)})["q"].float().pow(2).sum().backward()
    opt.step()
    got = real_bytes(enc, opt)
    assert {k: want[k] for k in ("params", "grads", "optimizer")} == got
    assert want["grads"] < sum(want["params"].values())  # the frozen pooler is in params only
    assert want["total"] == sum(want["params"].values()) + want["grads"] + want["optimizer"]


def test_fsdp2_shards_are_planned_per_rank(tmp_path):
    assert plan.local_numel((10, 4), 2, "fsdp2") == 20 and plan.local_numel((11, 4), 2, "fsdp2") == 24
    assert plan.local_numel((11, 4), 2, "ddp") == 44 and plan.local_numel((1,), 4, "fsdp2") == 1


@pytest.mark.slow
def test_the_plan_is_what_rank_0_holds_under_fsdp2_on_2_ranks(tiny_model_dir, tmp_path):
    out = tmp_path / "plan.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    run = run_watched([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       os.path.join(ROOT, "tests", "plan_worker.py"), tiny_model_dir, str(out)], env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for kind, r in json.loads(out.read_text()).items():  # full fine-tuning, LoRA
        assert {k: r["plan"][k] for k in ("params", "grads", "optimizer")} == r["real"], kind


@pytest.mark.slow
def test_the_command_line_prints_the_plan_without_training(tiny_model_dir):
    out = python_run(["-m", "retrieval_kit.plan", "--model", tiny_model_dir, "--world-size", 8, "--parallel", "fsdp2",
                      "--torch-dtype", "bf16"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "memory per rank (fsdp2, world 8): params" in out.stdout and "bfloat16" in out.stdout

"""Run under torchrun (tests/test_plan.py): a tiny BERT bi-encoder sharded with FSDP2 takes one
AdamW step, fully fine-tuned and with LoRA; rank 0 writes the bytes its shards, gradients and
optimizer state really hold, and the plan's, to the JSON file named on the command line."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from retrieval_kit import dist, lora, optim, plan  # noqa: E402
from retrieval_kit.heads.single_vector import BiEncoder  # noqa: E402
from retrieval_kit.models import load_encoder  # noqa: E402
from tests.test_plan import real_bytes  # noqa: E402


def one_step(enc, world_size):
    """(plan, real bytes) of `enc` sharded with FSDP2 after one AdamW step."""
    want = plan.memory_plan(enc, world_size, "fsdp2")  # planned before sharding, from the full shapes
    model = dist.wrap_fsdp2(BiEncoder(enc), dist.transformer_layers(enc))
    opt = optim.build_optimizer(optim.param_groups(enc, 0.01), 1e-3)
    ids = torch.randint(5, 100, (4, 12))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    model(q=batch)["q"].pow(2).sum().backward()
    opt.step()
    return {"plan": want, "real": real_bytes(enc, opt)}


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    ctx = dist.init()
    torch.manual_seed(0)
    results = {"full": one_step(load_encoder(model_dir), ctx.world_size)}
    enc = load_encoder(model_dir)
    lora.apply_lora(enc, 4, 8)  # a frozen base: params only; the adapters: grads and AdamW state too
    results["lora"] = one_step(enc, ctx.world_size)
    if ctx.is_main:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.cleanup()


if __name__ == "__main__":
    main()

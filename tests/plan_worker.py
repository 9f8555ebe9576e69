"""Run under torchrun (tests/test_plan.py): a tiny BERT bi-encoder sharded with FSDP2 takes one
AdamW step; rank 0 writes the bytes its shards, gradients and optimizer state really hold, and the
plan's, to the JSON file named on the command line."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from retrieval_kit import dist, optim, plan  # noqa: E402
from retrieval_kit.models import BiEncoder, load_encoder  # noqa: E402
from tests.test_plan import real_bytes  # noqa: E402


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    ctx = dist.init()
    torch.manual_seed(0)
    enc = load_encoder(model_dir)
    want = plan.memory_plan(enc, ctx.world_size, "fsdp2")  # planned before sharding, from the full shapes
    model = dist.wrap_fsdp2(BiEncoder(enc), dist.transformer_layers(enc))
    opt = optim.build_optimizer(optim.param_groups(enc, 0.01), 1e-3)
    ids = torch.randint(5, 100, (4, 12))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    model(q=batch)["q"].pow(2).sum().backward()
    opt.step()
    got = real_bytes(enc, opt)
    if ctx.is_main:
        with open(out, "w") as f:
            json.dump({"plan": want, "real": got}, f)
    dist.cleanup()


if __name__ == "__main__":
    main()

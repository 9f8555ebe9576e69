"""The GPU path's choices, checked on CPU with a mocked CUDA: device and backend per rank, CUDA RNG
state of the current device only, the `auto` defaults per device, the FLOPs count behind MFU, and
the autograd gather importing on its own (issue 16)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from retrieval_kit import ckpt, cli, dist, log, precision
from tests.conftest import ROOT


@pytest.mark.parametrize("local_rank,local_world,count,expect", [
    (3, 8, 8, "cuda:3"),  # one process per GPU, all visible
    (5, 8, 1, "cuda:0"),  # a launcher that gives each process one visible GPU (CUDA_VISIBLE_DEVICES per rank)
    (5, 4, 4, "cuda:1"),  # local_rank % visible GPUs
])
def test_device_is_the_local_rank_modulo_the_visible_gpus(local_rank, local_world, count, expect):
    device, backend = dist.choose_device(local_rank, local_world, cuda_available=True, device_count=count)
    assert str(device) == expect and backend == "nccl"


def test_backend_and_device_flags():
    assert dist.choose_device(0, 2, cuda_available=False) == (torch.device("cpu"), "gloo")
    assert dist.choose_device(1, 2, device="cpu", cuda_available=True, device_count=2) == (torch.device("cpu"), "gloo")
    assert dist.choose_device(1, 2, backend="gloo", cuda_available=True, device_count=2) == (torch.device("cuda", 1), "gloo")
    with pytest.raises(SystemExit, match="--device cuda"):
        dist.choose_device(0, 1, device="cuda", cuda_available=False)
    with pytest.raises(SystemExit, match="--dist-backend nccl"):
        dist.choose_device(0, 1, backend="nccl", cuda_available=False)
    with pytest.raises(SystemExit, match="8 processes on this node but 2 visible GPUs"):
        dist.choose_device(0, 8, cuda_available=True, device_count=2)
    # gloo may share a GPU between ranks; NCCL may not
    assert dist.choose_device(7, 8, backend="gloo", cuda_available=True, device_count=2)[0] == torch.device("cuda", 1)


def test_ranks_sharing_a_gpu_are_found():
    every = [("n1", "GPU-a"), ("n1", "GPU-b"), ("n2", "GPU-a"), ("n1", "GPU-a")]  # same uuid on two hosts is fine
    assert dist.shared_gpus(every) == [[0, 3]]
    assert dist.shared_gpus([("n1", "GPU-a"), ("n1", "GPU-b")]) == []


class FakeCuda:
    """torch.cuda's RNG calls on a machine with `count` GPUs, `current` the rank's own."""

    def __init__(self, count, current):
        self.count, self.current, self.states, self.calls = count, current, {}, []

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)

        def get(device="cuda"):
            self.calls.append(("get", device))
            return torch.full((4,), float(device), dtype=torch.uint8) if isinstance(device, int) else None

        def set_(state, device="cuda"):
            self.calls.append(("set", device))
            self.states[device] = state

        def all_(*a):
            raise AssertionError("the RNG state of every visible GPU was read: resume needs this rank's only")
        monkeypatch.setattr(torch.cuda, "get_rng_state", get)
        monkeypatch.setattr(torch.cuda, "set_rng_state", set_)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", all_)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", all_)


def test_cuda_rng_state_is_the_current_devices_and_restores_onto_it(monkeypatch):
    saved_on = FakeCuda(count=8, current=5)
    saved_on.install(monkeypatch)
    state = ckpt.rng_state()
    assert saved_on.calls == [("get", 5)] and state["cuda"].tolist() == [5] * 4
    resumed_on = FakeCuda(count=1, current=0)  # fewer visible GPUs at resume: rank 5 now sees its GPU as cuda:0
    resumed_on.install(monkeypatch)
    ckpt.set_rng_state(state)
    assert resumed_on.calls == [("set", 0)] and resumed_on.states[0].tolist() == [5] * 4


class Args:
    def __init__(self, **kw):
        self.compute_dtype, self.tf32, self.chunk_tokens, self.num_workers = "auto", None, None, None
        self.keep_freed_memory = None
        self.__dict__.update(kw)


def test_auto_defaults_on_cpu_are_fp32_unless_it_has_bf16_matmul_instructions(monkeypatch, capsys):
    monkeypatch.setattr(precision, "cpu_bf16_blocked", lambda: False)  # (as on any CPU run at its own kernels)
    for has, compute in ((None, "none"), ("avx512_bf16", "bf16"), ("amx_bf16", "bf16")):
        monkeypatch.setattr(precision, "cpu_bf16_matmul", lambda has=has: has)
        args = cli.resolve_device_defaults(Args(), torch.device("cpu"))
        assert (args.compute_dtype, args.tf32, args.chunk_tokens, args.num_workers) == (compute, False, 1024, 0)
        assert args.keep_freed_memory is True
        said = capsys.readouterr().out
        assert (has in said) if has else not said, said  # the run header says why
    explicit = cli.resolve_device_defaults(Args(compute_dtype="bf16", chunk_tokens=0, tf32=False, num_workers=3,
                                                keep_freed_memory=False), torch.device("cpu"))
    assert (explicit.compute_dtype, explicit.chunk_tokens, explicit.num_workers) == ("bf16", 0, 3)
    assert explicit.keep_freed_memory is False
    with pytest.raises(SystemExit, match="--tf32"):
        cli.resolve_device_defaults(Args(tf32=True), torch.device("cpu"))


def test_the_cpu_bf16_probe_prefers_amx_and_falls_back_to_the_kernels_flags(monkeypatch):
    def best(has):
        return "amx_bf16" if has("amx_bf16") else "avx512_bf16" if has("avx512_bf16") else None

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")  # torch's kernels at AVX512
    caps = torch.cpu.get_capabilities()  # torch's own CPUID reading (what its kernels use)
    assert precision.cpu_bf16_matmul() == best(lambda name: caps.get(name))
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    monkeypatch.delattr(torch.cpu, "get_capabilities")  # an older torch: /proc/cpuinfo itself
    assert precision.cpu_bf16_matmul() == best(lambda name: name in flags)
    for below in ("AVX2", "DEFAULT"):  # ATEN_CPU_CAPABILITY below AVX512: torch's bf16 matmuls stop there
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda below=below: below)
        assert precision.cpu_bf16_matmul() is None


def test_bf16_asked_for_where_torch_cannot_run_it_is_one_sentence(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_bf16": True}, raising=False)
    assert precision.cpu_bf16_blocked()
    says = r"--compute-dtype bf16: torch runs its AVX2 kernels here \(ATEN_CPU_CAPABILITY\) on a CPU with bf16"
    with pytest.raises(SystemExit, match=says):
        cli.resolve_device_defaults(Args(compute_dtype="bf16"), torch.device("cpu"))
    with pytest.raises(SystemExit, match=says):
        precision.autocast_forward(torch.nn.Linear(2, 2), "cpu", torch.bfloat16)
    assert cli.resolve_device_defaults(Args(compute_dtype="auto"), torch.device("cpu")).compute_dtype == "none"
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {}, raising=False)  # a CPU without: slow, allowed
    assert not precision.cpu_bf16_blocked()


def test_auto_defaults_on_cuda_are_bf16_compute_tf32_and_larger_chunks(monkeypatch):
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        for bf16, compute in ((True, "bf16"), (False, "none")):  # a GPU without bf16 (V100) computes in fp32
            monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, bf16=bf16, **k: bf16)
            args = cli.resolve_device_defaults(Args(), torch.device("cuda", 0))
            assert (args.compute_dtype, args.tf32, args.chunk_tokens, args.num_workers) == (compute, True, 8192, 2)
            assert args.keep_freed_memory is False
            assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        cli.resolve_device_defaults(Args(tf32=False), torch.device("cuda", 0))
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    storage, compute, autocast = precision.resolve("auto", True, "bf16", "fsdp2")
    assert (storage, compute, autocast) == (torch.float32, torch.bfloat16, None)  # fp32 master weights


def test_flops_per_token_counts_six_per_trained_non_embedding_param(tiny_model_dir):
    from retrieval_kit.models import load_encoder

    enc = load_encoder(tiny_model_dir)  # its BERT pooler is frozen (our pooling replaces it)
    by_hand = 0
    for name, p in enc.named_parameters():
        if "embeddings." in name and name.endswith("embeddings.weight") or not p.requires_grad:
            continue
        by_hand += p.numel()
    assert log.flops_per_token(enc) == 6 * by_hand
    from retrieval_kit.lora import apply_lora

    apply_lora(enc, 4, 8)  # the frozen base still runs forward and passes gradients back: 4 per param
    adapters = sum(p.numel() for n, p in enc.named_parameters() if ".lora_" in n)
    pooler = sum(p.numel() for n, p in enc.named_parameters() if n.startswith("pooler."))
    assert log.flops_per_token(enc) == 6 * adapters + 4 * (by_hand + pooler)
    # 1e5 tokens/s on 2 ranks of a 989-TFLOP/s GPU
    assert log.mfu(1e5, 6e9, 989, 2) == pytest.approx(1e5 * 6e9 / (2 * 989e12))
    assert log.mfu(1e5, 6e9, None, 2) is None
    info = log.device_info(torch.device("cpu"))
    assert info["type"] == "cpu" and info["cpus"] == os.cpu_count()


@pytest.mark.slow
def test_the_autograd_gather_imports_and_runs_on_its_own(tmp_path):
    """Only retrieval_kit.dist imported (no DDP, no FSDP first): gather_with_grad on 2 gloo ranks,
    its backward summing each rank's slice of the gradient."""
    script = tmp_path / "gather.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {ROOT!r})
        import torch
        import torch.distributed as tdist
        from retrieval_kit.dist import gather_with_grad

        def main(rank):
            tdist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=rank, world_size=2)
            x = torch.full((2, 3), float(rank + 1), requires_grad=True)
            y = gather_with_grad(x)  # (4, 3): rank 0's rows, then rank 1's
            (y * torch.arange(4.0).view(4, 1)).sum().backward()
            # every rank's loss uses all rows: the grad of my rows is the sum over the 2 ranks
            expect = 2 * torch.arange(4.0).view(4, 1)[2 * rank:2 * rank + 2].expand(2, 3)
            assert y[:, 0].tolist() == [1, 1, 2, 2] and torch.equal(x.grad, expect), (y, x.grad)
            tdist.destroy_process_group()

        if __name__ == "__main__":
            torch.multiprocessing.spawn(main, nprocs=2)
        """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]

"""Ranks that die or hang (issue 30): the survivors end within seconds - a dead peer at once, a hung
one after --dist-timeout plus a margin - with one sentence naming the newest intact checkpoint and
no traceback, under torchrun and without its agent (gloo, 2 ranks)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.conftest import process_tree
from tests.test_ckpt import bi_args, wait_for_checkpoint

pytestmark = pytest.mark.slow  # 2-rank launches


def worker_pid(agent, local_rank):
    """The pid of the torchrun agent's worker of `local_rank`."""
    for pid in process_tree(agent.pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"LOCAL_RANK={local_rank}\0".encode() in f.read() and pid != agent.pid:
                    return pid
        except OSError:
            continue
    raise AssertionError(f"no worker of local rank {local_rank}")


def assert_one_sentence(err, what, run_dir):
    lines = [line for line in err.splitlines() if line.startswith("rank 0: ") or "rank 0: " in line]
    assert lines and what in lines[-1] and f"the newest intact checkpoint is {run_dir}" in lines[-1], err[-3000:]
    assert "--resume auto" in lines[-1]
    # the worker's own output holds no traceback (torchrun's agent prints its summary of the failure after it)
    assert "[rank0]:" not in err and "Traceback" not in err.split(lines[-1])[0], err[-3000:]


def test_a_rank_killed_under_torchrun_ends_the_other_at_once_with_one_sentence(tiny_model_dir, small_train_file,
                                                                                tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              os.path.join(ROOT, "train_biencoder.py"),
                              *map(str, bi_args(tiny_model_dir, small_train_file, tmp_path, "--max-steps", 100000))],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    wait_for_checkpoint(agent, tmp_path / "step_000002")
    os.kill(worker_pid(agent, 1), signal.SIGKILL)
    t0 = time.time()
    _, err = agent.communicate(timeout=120)
    assert agent.returncode != 0 and time.time() - t0 < 15, (time.time() - t0, err[-3000:])
    assert_one_sentence(err, "another rank stopped answering (it died or was killed)", tmp_path)


def test_a_hung_rank_ends_the_other_after_the_dist_timeout_without_the_agent(tiny_model_dir, small_train_file,
                                                                             tmp_path):
    args = [sys.executable, os.path.join(ROOT, "train_biencoder.py"),
            *map(str, bi_args(tiny_model_dir, small_train_file, tmp_path, "--max-steps", 100000, "--dist-timeout",
                              0.1))]  # 6 s
    procs = []
    for r in range(2):  # as a scheduler without torchrun starts them
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT, RANK=str(r),
                   LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(29400 + os.getpid() % 500))
        procs.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    try:
        wait_for_checkpoint(procs[0], tmp_path / "step_000002")
        procs[1].send_signal(signal.SIGSTOP)  # hung: alive, but never answers
        t0 = time.time()
        _, err = procs[0].communicate(timeout=120)
        assert procs[0].returncode == 1 and time.time() - t0 < 6 + 15, (time.time() - t0, err[-3000:])
        assert_one_sentence(err, "a collective waited past --dist-timeout: another rank hung", tmp_path)
    finally:
        for p in procs:
            p.kill()
            p.communicate()

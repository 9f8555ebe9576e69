"""Two torchrun agents on one machine as two nodes (issue 29, item 3): `--nnodes 2 --node-rank 0/1`, a
static rendezvous on 127.0.0.1, one rank per node, gloo. Every rank has LOCAL_RANK 0 here, so anything
keyed on the local rank instead of the global one (who writes checkpoints and the export, who holds
the run folder's lock) would show: the run must equal the one-node run of the same world size, step for
step and bitwise, write its export once, and survive one node's SIGKILL with --resume auto on both."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_script
from tests.conftest import process_tree
from tests.test_ckpt import STEPS, assert_same_run, bi_args, wait_for_checkpoint

pytestmark = pytest.mark.slow  # torchrun launches


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_nodes(script, args, nnodes=2):
    """One torchrun agent per node, each in a session of its own (as two machines would be)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                              f"--node-rank={node}", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                              f"--master-port={port}", os.path.join(ROOT, script), *map(str, args)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True) for node in range(nnodes)]


def finish(agents, timeout=300):
    outs = [a.communicate(timeout=timeout) for a in agents]
    return [a.returncode for a in agents], [o for o, _ in outs], [e for _, e in outs]


def test_two_nodes_train_as_one_node_of_the_same_world_and_resume_after_one_is_killed(tiny_model_dir,
                                                                                      small_train_file, tmp_path):
    ref = tmp_path / "one_node"  # 2 ranks under one agent
    run_script("train_biencoder.py", bi_args(tiny_model_dir, small_train_file, ref, "--max-steps", STEPS), nproc=2)

    # node 1 goes away (its agent and worker SIGKILLed) after a checkpoint; node 0's rank ends on its own
    nodes = tmp_path / "two_nodes"
    args = bi_args(tiny_model_dir, small_train_file, nodes)
    agents = launch_nodes("train_biencoder.py", args + ["--max-steps", 100000])  # constant LR: the STEPS path
    wait_for_checkpoint(agents[0], nodes / "step_000002")
    for pid in process_tree(agents[1].pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    codes, _, errs = finish(agents)
    assert codes[0] != 0 and codes[1] == -signal.SIGKILL, (codes, errs[0][-3000:])
    assert "another rank stopped answering" in errs[0] and "--resume auto" in errs[0], errs[0][-3000:]
    # the same two commands with --resume auto: the one-node run, every logged step and the weights, bitwise
    codes, outs, errs = finish(launch_nodes("train_biencoder.py", args + ["--max-steps", STEPS, "--resume", "auto"]))
    assert codes == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    assert_same_run(ref, nodes)
    assert sum(o.count(f"exported the bi-encoder to {nodes / 'final'}") for o in outs) == 1, outs  # by rank 0 only

"""Every flag of both scripts is documented in the README."""

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("script", ["train_biencoder.py", "train_reranker.py"])
def test_every_flag_is_in_the_readme(script):
    out = subprocess.run([sys.executable, os.path.join(ROOT, script), "--help"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT, COLUMNS="10000"), timeout=120)
    assert out.returncode == 0, out.stderr
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*(?![\w-])", out.stdout)) - {"--help"}
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert len(flags) > 30
    missing = sorted(f for f in flags if f"`{f}`" not in readme and f"{f} " not in readme)
    assert not missing, f"flags of {script} missing from README.md: {missing}"

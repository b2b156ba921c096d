"""The README's Quick start script, as it stands in README.md, runs under
torchrun on 2 CPU ranks and its loss falls: the snippet users copy cannot
drift from a script that works."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"


def quickstart_script() -> str:
    """The first ```python block after the "## Quick start" heading."""
    text = README.read_text()
    section = text[text.index("\n## Quick start\n") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "README.md: no python block under ## Quick start"
    return match.group(1)


def test_quickstart_is_a_complete_script() -> None:
    script = quickstart_script()
    compile(script, "quickstart.py", "exec")
    for needed in (
        "init_device_mesh(",
        "torch.manual_seed(0)",
        "fully_shard(model, mesh=mesh)",
        "dist.destroy_process_group()",
    ):
        assert needed in script, needed
    # The blocks, then the root, then the optimizer.
    order = [script.index(s) for s in ("fully_shard(block", "fully_shard(model", "optim.Adam")]
    assert order == sorted(order), order


@pytest.mark.distributed
def test_quickstart_runs_under_torchrun(tmp_path: Path) -> None:
    path = tmp_path / "quickstart.py"
    path.write_text(quickstart_script())
    # --standalone: torchrun picks a free port itself (no port races).
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", done.stdout)]
    assert len(losses) == 4, output
    assert losses[-1] < losses[0] / 2, losses

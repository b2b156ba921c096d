"""The scripts the docs show, taken from the docs as they stand and run as a
user would (under torchrun), so that a snippet users copy cannot drift from
a script that works."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def python_block(doc: Path, heading: str) -> str:
    """The first ```python block after the line ``heading`` in ``doc``."""
    text = doc.read_text()
    section = text[text.index(f"\n{heading}\n") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, f"{doc.name}: no python block under {heading}"
    return match.group(1)


def losses_under_torchrun(script: str, nproc: int, tmp_path: Path, name: str) -> list[float]:
    """Runs ``script`` as ``tmp_path/name`` under torchrun on ``nproc`` CPU
    ranks; returns the losses it printed (``step N: loss X``)."""
    path = tmp_path / name
    path.write_text(script)
    # --standalone: torchrun picks a free port itself (no port races).
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", done.stdout)]

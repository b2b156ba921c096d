"""The README's Quick start script, as it stands in README.md, runs under
torchrun on 2 CPU ranks and its loss falls: the snippet users copy cannot
drift from a script that works. Its API section shows ``fully_shard``'s
signature as it is."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fsdp2

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


def _shown(default: object) -> str:
    """A default as the README writes it: a policy with its own defaults as ``Policy()``."""
    if dataclasses.is_dataclass(default) and default == type(default)():
        return f"{type(default).__name__}()"
    return repr(default)


def test_api_section_shows_fully_shards_signature() -> None:
    params = inspect.signature(fsdp2.fully_shard).parameters.values()
    keywords = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    shown = ", ".join(f"{p.name}={_shown(p.default)}" for p in keywords)
    text = README.read_text()
    assert f"`fully_shard(module, *, {shown}) -> FSDPModule`" in text
    api = text[text.index("\n## API\n") :]
    for p in keywords:
        assert f"\n- `{p.name}`: " in api, f"README.md's API section has no entry for {p.name}"

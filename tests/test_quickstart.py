"""The README's Quick start script, as it stands in README.md, runs under
torchrun on 2 CPU ranks and its loss falls: the snippet users copy cannot
drift from a script that works. Its API section shows ``fully_shard``'s
signature as it is."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
from doc_scripts import losses_under_torchrun, python_block

import fsdp2

README = Path(__file__).parent.parent / "README.md"


def quickstart_script() -> str:
    return python_block(README, "## Quick start")


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
    losses = losses_under_torchrun(quickstart_script(), 2, tmp_path, "quickstart.py")
    assert len(losses) == 4, losses
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

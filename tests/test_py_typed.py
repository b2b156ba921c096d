"""fsdp2 ships ``py.typed`` (PEP 561), so a user's mypy checks calls against
fsdp2's annotations. Checked the way a user meets it: the package is built
into a wheel from pyproject.toml, unpacked where the interpreter finds it
(``sys.path``, as site-packages would be; not ``MYPYPATH``), and mypy is run
on a user's script outside the repository. About 7 s."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

USER_SCRIPT = """\
import torch.nn as nn

import fsdp2

model = fsdp2.fully_shard(nn.Linear(4, 4), reshard_after_forward="yes")
"""

# torch's own annotations are not what is checked here, and analysing them takes a minute.
MYPY_CONFIG = """\
[mypy]
[mypy-torch.*]
follow_imports = skip
"""


def _build_wheel(tmp_path: Path) -> Path:
    """The wheel of a copy of the package (the build writes into its source tree)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "fsdp2", source / "fsdp2", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "-w", str(dist), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("fsdp2-*.whl")
    return wheel


def _mypy(user: Path, site: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    env["PYTHONPATH"] = str(site)  # on the interpreter's sys.path, like site-packages
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--python-executable", sys.executable]
        + ["--no-incremental", "--config-file", "mypy.ini", "train.py"],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode in (0, 1), result.stderr
    return result.stdout


def test_the_wheel_ships_py_typed_and_mypy_checks_a_users_call(tmp_path: Path) -> None:
    assert (ROOT / "fsdp2" / "py.typed").is_file()
    wheel = _build_wheel(tmp_path)
    assert "fsdp2/py.typed" in zipfile.ZipFile(wheel).namelist()
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    user = tmp_path / "user"  # outside the repository: fsdp2 is not a source file of it
    user.mkdir()
    (user / "train.py").write_text(USER_SCRIPT)
    (user / "mypy.ini").write_text(MYPY_CONFIG)

    output = _mypy(user, site)
    assert 'train.py:5: error: No overload variant of "__call__" of "FullyShard"' in output
    assert 'argument types "Any", "str"' in output
    assert "reshard_after_forward: bool | int | None" in output

    # Without the marker, the same mypy skips fsdp2 as untyped: the marker is what it read.
    (site / "fsdp2" / "py.typed").unlink()
    output = _mypy(user, site)
    assert "missing library stubs or py.typed marker" in output, output
    assert "No overload variant" not in output

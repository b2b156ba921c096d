"""Multi-process gloo harness: run one function on every rank and report the root cause.

Each rank is a fresh process (forked from a server that imported torch and
fsdp2 once per test session; ``spawn``ed when the test changed the
environment, which a fork would not see) with a ``file://`` store under the test's
``tmp_path`` (no port races) and a 60 s process-group timeout, so a hung
collective becomes an error instead of a hung test run. A rank that fails
writes its traceback, stamped with the time of failure, to a file; the parent
re-raises the *earliest* one. Later failures are usually a peer's
"connection reset" caused by the first, and would hide it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import perturb
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PROCESS_GROUP_TIMEOUT = timedelta(seconds=60)
JOIN_TIMEOUT_S = 180.0
# Once a rank has failed, its peers are usually blocked in a collective with it
# until the process-group timeout. Give them this long to fail on their own (a
# peer may have failed first but exited later), then kill them.
PEER_GRACE_S = 3.0


# Modules the fork server imports once, so each rank starts without importing
# them again (seconds per rank on two cores, a third of a small test's time).
_PRELOAD = ["torch", "torch.distributed.tensor", "fsdp2", "dist", "models", "pytest"]
# The environment the fork server was started with: its children inherit that
# one, not the test's current one.
_server_environment: dict[str, str] | None = None


def _context() -> Any:
    global _server_environment
    environment = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    if _server_environment is None:
        _server_environment = environment
        mp.set_forkserver_preload(_PRELOAD)
    if environment != _server_environment:
        return mp.get_context("spawn")
    return mp.get_context("forkserver")


def _error_path(tmp_dir: Path, rank: int) -> Path:
    return tmp_dir / f"rank{rank}.error"


def _stacks_path(tmp_dir: Path, rank: int) -> Path:
    return tmp_dir / f"rank{rank}.stacks"


def _worker(
    fn: Callable[..., None], rank: int, world_size: int, tmp_dir: Path, args: tuple[Any, ...]
) -> None:
    # If the parent is about to kill us for running too long, leave every
    # thread's stack behind so the timeout says where the rank was stuck.
    with open(_stacks_path(tmp_dir, rank), "w") as stacks:
        faulthandler.dump_traceback_later(JOIN_TIMEOUT_S - 10, file=stacks)
        try:
            torch.set_num_threads(1)
            dist.init_process_group(
                "gloo",
                init_method=f"file://{tmp_dir}/store",
                rank=rank,
                world_size=world_size,
                timeout=PROCESS_GROUP_TIMEOUT,
            )
            perturb.install_from_environment()  # tests/perturb.py: unset, nothing
            fn(rank, world_size, *args)
            # Without this, gloo's threads can still hold tensors at exit and
            # abort the process (about 1 run in 8 for a 2-rank FSDP test).
            gc.collect()
            dist.destroy_process_group()
        except BaseException:
            text = f"{time.time_ns()}\n{traceback.format_exc()}"
            partial = tmp_dir / f"rank{rank}.error.partial"
            partial.write_text(text)
            partial.replace(_error_path(tmp_dir, rank))  # atomic: the parent never reads half
            # Skip interpreter teardown: the process group may be wedged with a
            # peer, and the traceback is all the parent needs.
            os._exit(1)
        finally:
            faulthandler.cancel_dump_traceback_later()
    # The rank's work is done and its process group destroyed. A spawned child
    # would now run interpreter finalization, where gloo's worker threads can
    # still abort the process ("terminate called without an active exception",
    # seen about once per CI run of 120 tests). Exit as a forked child does:
    # flush and leave without finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _first_error(tmp_dir: Path, world_size: int) -> tuple[int, str] | None:
    errors = []
    for rank in range(world_size):
        path = _error_path(tmp_dir, rank)
        if path.exists():
            stamp, _, text = path.read_text().partition("\n")
            errors.append((int(stamp), rank, text))
    if not errors:
        return None
    _, rank, text = min(errors)
    return rank, text


def run_ranks(fn: Callable[..., None], world_size: int, tmp_path: Path, *args: Any) -> None:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Args:
        fn: a module-level (picklable) function. It runs after
            ``init_process_group`` and before ``destroy_process_group``.
        world_size: number of processes to spawn.
        tmp_path: a fresh directory (pytest's ``tmp_path``) for the store and
            the per-rank error files.
        args: extra picklable arguments passed to ``fn``.

    Raises:
        AssertionError: with the rank and traceback of the first rank that
            failed, or if a rank crashed without a traceback, or if the ranks
            did not finish within ``JOIN_TIMEOUT_S``.
    """
    __tracebackhide__ = True  # pytest: show the rank's traceback, not this harness
    tmp_dir = Path(tmp_path)
    tmp_dir.mkdir(parents=True, exist_ok=True)  # e.g. tmp_path / "case" for a second run
    ctx = _context()
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, tmp_dir, args), name=f"rank{rank}")
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    failed_at: float | None = None
    timed_out = False
    try:
        while alive := [p for p in procs if p.is_alive()]:
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > PEER_GRACE_S:
                break
            if now > deadline:
                timed_out = True
                break
            wait([p.sentinel for p in alive], timeout=0.2)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()

    if (first := _first_error(tmp_dir, world_size)) is not None:
        rank, text = first
        raise AssertionError(f"rank {rank} of {world_size} failed first:\n{text}")
    if timed_out:
        stacks = "\n".join(
            f"--- rank {rank} ---\n{_stacks_path(tmp_dir, rank).read_text()}"
            for rank in range(world_size)
            if _stacks_path(tmp_dir, rank).exists()
        )
        raise AssertionError(
            f"ranks did not finish within {JOIN_TIMEOUT_S:.0f} s; their stacks:\n{stacks}"
        )
    for rank, proc in enumerate(procs):
        if proc.exitcode != 0:
            raise AssertionError(
                f"rank {rank} of {world_size} exited with code {proc.exitcode} and no "
                "traceback (a crash or abort, e.g. at interpreter exit)"
            )


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as ``rank`` of a "fake" process group of ``world_size``, for
    single-process tests: meshes and groups can be built, but the collectives
    move no data, so only construction (not communication) can be checked."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a test left a default process group behind"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Call(NamedTuple):
    output: torch.Tensor
    input: torch.Tensor
    group: dist.ProcessGroup | None


@contextlib.contextmanager
def wrapped_collectives(method: str, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Replaces ``method`` ("all_gather", "reduce_scatter" or "all_reduce") of
    fsdp2's collectives, torch's and gloo's (fsdp2/comm/primitives.py), with
    ``wrap(original)`` while active, in this process."""
    from fsdp2.comm.primitives import Collectives, GlooCollectives

    classes = (Collectives, GlooCollectives)
    originals = [getattr(cls, method) for cls in classes]
    with contextlib.ExitStack() as stack:
        for cls, original in zip(classes, originals, strict=True):
            stack.enter_context(mock.patch.object(cls, method, wrap(original)))
        yield


@contextlib.contextmanager
def recorded(method: str) -> Iterator[list[Call]]:
    """Records each of fsdp2's collectives ``method`` ("all_gather",
    "reduce_scatter") made while active; torch's fully_shard calls others."""
    calls: list[Call] = []

    def wrap(original: Callable) -> Callable:
        def recording(self, output, input, *args, **kwargs):
            calls.append(Call(output, input, self.process_group))
            return original(self, output, input, *args, **kwargs)

        return recording

    with wrapped_collectives(method, wrap):
        yield calls


@contextlib.contextmanager
def labelled(label: str) -> Iterator[None]:
    """Prefixes the message of an AssertionError raised inside with ``[label]``,
    keeping its traceback: for rank functions that check several cases in turn."""
    try:
        yield
    except AssertionError as error:
        error.args = (f"[{label}] {error.args[0] if error.args else ''}", *error.args[1:])
        raise

"""A dead or stuck peer: the timeouts of the groups fsdp2 communicates on, and
the error a collective that failed or timed out raises.

[Note: a dead or stuck peer]
A peer that dies (SIGKILL, out of memory) closes its connections, and gloo
fails the collectives waiting on it at once. A peer that stops (stuck in user
code, or raising and not exiting) closes nothing: the others wait until their
group's timeout. ``init_process_group(timeout=...)`` sets the default
group's; a group created without one (``new_group``, and the groups of a
2-D ``init_device_mesh``: HSDP's shard and replicate groups) gets the
backend's default, 30 min on gloo and 10 on NCCL, so HSDP ranks waited that
long whatever the job asked for. ``align_timeouts`` (root lazy init) lowers
each group fsdp2 communicates on whose timeout is still its backend's
default to the default group's, when that is shorter; a group created with
a timeout of its own keeps it. Every wait on a collective turns the
backend's error into one naming the collective, the module, the group and
its ranks (``collective_failed``), so a survivor says where it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch.distributed as dist

from ..base.log import logger
from ..base.private_dist import backend_default_timeout, group_timeout, set_group_timeout
from .primitives import Collectives, backend_for


def describe(role: str, group: dist.ProcessGroup) -> str:
    """E.g. "the replicate group (ranks [0, 2])", for messages."""
    try:
        ranks = dist.get_process_group_ranks(group)
    except Exception:  # not one of c10d's groups (torchft's): the message must not fail
        return f"the {role} (ranks unknown)"
    return f"the {role} (ranks {ranks})"


def align_timeouts(groups: Iterable[tuple[str, dist.ProcessGroup]], device_type: str) -> None:
    """Lowers the timeout of each of ``groups`` (role, group) that still has
    its backend's default to the default group's, when that is shorter (see
    [Note: a dead or stuck peer]); logs one line at INFO saying which."""
    default_group = dist.group.WORLD
    if default_group is None:
        return
    job_timeout = group_timeout(default_group, device_type)
    if job_timeout is None:
        return
    seen = {id(default_group)}
    lowered = []
    for role, group in groups:
        if id(group) in seen:
            continue
        seen.add(id(group))
        timeout = group_timeout(group, device_type)
        if timeout is None or timeout <= job_timeout:
            continue
        if timeout != backend_default_timeout(backend_for(group, device_type)):
            continue  # chosen by whoever created the group
        set_group_timeout(group, job_timeout)
        lowered.append(f"{describe(role, group)} from {timeout}")
    if lowered:
        logger.info(
            "timeouts lowered to the default group's %s, so that a stuck peer fails "
            "them in time: %s. Create a group with a timeout of its own to keep it.",
            job_timeout,
            "; ".join(lowered),
        )


def collective_failed(what: str, on: Collectives | None, error: Exception) -> RuntimeError:
    """The error for ``what`` (e.g. "reduce-scatter of module 'layers.1'"), a
    collective of ``on`` that raised ``error``."""
    where = ""
    if on is not None:
        where = f" on {describe(on.role, on.process_group)}"
        if (timeout := group_timeout(on.process_group, on.device_type)) is not None:
            where = f"{where[:-1]}, timeout {timeout})"
    return RuntimeError(
        f"fsdp2 (rank {dist.get_rank()}): the {what}{where} failed or timed out: {error}. "
        "A peer rank may have died, raised, stopped calling forward, or run a different "
        "sequence of collectives; the first error among the ranks says which."
    )


@contextlib.contextmanager
def naming_failures(what: str, on: Collectives) -> Iterator[None]:
    """Around a blocking collective of ``on``: its error as ``collective_failed``'s."""
    try:
        yield
    except RuntimeError as error:
        raise collective_failed(what, on, error) from error

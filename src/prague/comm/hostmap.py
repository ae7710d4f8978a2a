"""Which ranks of a job share a host: each rank publishes a label of its host through the job's store.

Two ranks share a host when they run on the same machine (host name) in the same network namespace:
on one machine, ranks placed in different namespaces (``prague run --hosts``) reach each other only
over the emulated links, so for a collective they are on different hosts. Torchrun's
``LOCAL_WORLD_SIZE`` cannot tell that, and says nothing of the other machines' ranks.
``$PRAGUE_HOST_LABEL``, when set, is the label itself: ranks with equal labels are one host (for
containers that share a network namespace across machines, or tests).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist

from prague.jobenv import JobEnv


def host_label(job: JobEnv) -> str:
    """This process's host: ``$PRAGUE_HOST_LABEL`` (of ``job``, the environment its caller read) if set,
    else its machine's name and the identity of its network namespace."""
    given = job.host_label
    if given:
        return given
    try:
        namespace = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:  # no /proc (not Linux): the machine alone
        namespace = "-"
    return f"{socket.gethostname()}/{namespace}"


def host_labels(store: dist.Store, prefix: str, rank: int, world_size: int, timeout: timedelta,
                job: JobEnv) -> list[str]:
    """Every rank's :func:`host_label`, in rank order; each rank calls it once with the same ``prefix``.
    Blocks until every rank has published (the store's wait raises after ``timeout``)."""
    store.set(f"{prefix}/{rank}", host_label(job))
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    store.wait(keys, timeout)
    return [raw.decode() for raw in store.multi_get(keys)]

"""The machines of a multi-machine run meet before any of them launches: each says which machine it is and what it
would train, machine 0 compares, and every machine gets the same verdict, through a `torch.distributed.TCPStore`
that machine 0 hosts for the moment on ``main_process_ip:main_process_port`` (the port torchrun takes next).

Why not leave it to torchrun: with the static rendezvous Accelerate uses, a machine that never comes holds the
others for the rendezvous timeout (600 s by default in torch's static handler); of two launches claiming
machine_rank 0 on one host, Accelerate's port check stops one with a `ConnectionError` while the other waits; and
launches whose params differ (world size, strategy, inputs) meet nothing that compares them, so they wait in the
rendezvous or train different things in one world. Here each case is one `UserError`, on every machine that
came, within ``join_timeout_s``.

Protocol (keys in the store): every machine adds 1 to ``claim/<machine_rank>`` (a second claim of one rank is the
duplicate) and sets ``machine/<machine_rank>`` to what it would train (its params but where it sits, the hashes of its inputs
and code: `llmpipe.train.checkpoints.machine_identity`) and its local problem (or none);
machine 0 compares each arrival with its own, then sets ``verdict`` (``ok`` or the error) with `compare_set`, so
the first verdict is the only one; each machine reads it, adds 1 to ``ack`` and raises the error or launches.
Machine 0 keeps the store until every machine that came has read the verdict (at most :data:`ACK_WAIT_S`).
"""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from typing import Any

from llmpipe.core.errors import UserError

log = logging.getLogger(__name__)

OK = "ok"
ACK_WAIT_S = 10.0
"""How long machine 0 keeps the store after a verdict for the machines that came to read it."""
POLL_S = 0.1


def differences(mine: dict[str, Any], theirs: dict[str, Any], rank: int) -> list[str]:
    """Lines ``key: X on machine 0, Y on machine <rank>`` between two flat identities; inputs and code by name only
    (their hashes say nothing to a reader). The world size first when it differs: it is what torchrun would
    otherwise wait on."""
    lines = []
    world = [(d.get("distributed.num_processes"), d.get("distributed.num_machines")) for d in (mine, theirs)]
    if world[0] != world[1]:
        (p0, m0), (p1, m1) = world
        lines.append(f"world size (num_processes × num_machines): {p0} × {m0} on machine 0, {p1} × {m1} on machine {rank}")
    for key in sorted(mine.keys() | theirs.keys()):
        a, b = mine.get(key, "<absent>"), theirs.get(key, "<absent>")
        if a != b:
            lines.append(f"{key} differs" if key.startswith(("input ", "code ")) else
                         f"{key}: {a!r} on machine 0, {b!r} on machine {rank}")  # fmt: skip
    return lines


def _where(dist) -> str:
    return f"{dist.main_process_ip}:{dist.main_process_port}"


def _store(dist, host: bool):
    """Host the store on machine 0, or join it (also machine 0 when the port is taken, e.g. by another launch
    claiming rank 0). Returns ``(store, hosted)``.

    Raises:
        UserError: No machine 0 answered within ``join_timeout_s``.
    """
    from torch.distributed import TCPStore

    timeout = timedelta(seconds=dist.join_timeout_s)
    if host:
        try:
            return TCPStore(dist.main_process_ip, dist.main_process_port, None, True, timeout,
                            wait_for_workers=False), True  # fmt: skip
        except RuntimeError as err:  # DistNetworkError: the port is taken; the holder may be a launch claiming rank 0
            log.info("distributed: cannot host on %s (%s); joining whoever holds it", _where(dist), err)
    try:
        return TCPStore(dist.main_process_ip, dist.main_process_port, None, False, timeout), False
    except RuntimeError:  # DistNetworkError / DistStoreError: nothing answered in time
        raise UserError(
            f"distributed: machine {dist.machine_rank} waited distributed.join_timeout_s ({dist.join_timeout_s:g} s) "
            f"and no machine 0 answered at main_process_ip:main_process_port {_where(dist)}; start machine 0 "
            "(machine_rank 0) with the same params, or check the address, the port and the firewall"
        ) from None


def _verdict(store, message: str) -> str:
    """Set the verdict unless one is set; return the one that stands."""
    return store.compare_set("verdict", "", message).decode()


def _compare(store, task: str, mine: dict[str, Any], rank: int) -> str | None:
    """Machine 0's judgement of machine `rank`'s arrival: the error, or None when it may launch."""
    theirs = json.loads(store.get(f"machine/{rank}"))
    if lines := differences(mine, theirs["identity"], rank):
        return (f"distributed: machine {rank}'s launch of {task} differs from machine 0's (every machine runs the "
                "same params, inputs and code; only distributed.machine_rank differs):\n  " + "\n  ".join(lines))
    if theirs["problem"]:
        return f"distributed: machine {rank} cannot run {task}: {theirs['problem']}"
    return None


def _judge(store, params, task: str, mine: dict[str, Any]) -> str:
    """Machine 0: wait for machines 1 … n-1 (or a verdict another machine set), compare each arrival, decide."""
    dist = params.distributed
    waiting, seen = set(range(1, dist.num_machines)), 0
    deadline = time.monotonic() + dist.join_timeout_s
    while waiting:
        if store.check(["verdict"]):
            return store.get("verdict").decode()
        arrivals = store.get("arrivals").decode().split() if store.check(["arrivals"]) else []
        for rank in map(int, arrivals[seen:]):  # a rank outside 0 … n-1 comes from other params: _compare says so
            if error := _compare(store, task, mine, rank):
                return _verdict(store, error)
            waiting.discard(rank)
        seen = len(arrivals)
        if waiting and time.monotonic() > deadline:
            return _verdict(store, (
                f"distributed: machine(s) {', '.join(map(str, sorted(waiting)))} of {dist.num_machines} never joined "
                f"{_where(dist)} within distributed.join_timeout_s ({dist.join_timeout_s:g} s); start them with the "
                "same params and their own machine_rank, or check that they reach this address and port"))
        time.sleep(POLL_S)
    return _verdict(store, OK)


def meet(params, task: str, mine: dict[str, Any], problem: str | None) -> None:
    """Meet the other machines of ``distributed:`` before launching `task`; return when all of them agree.

    Args:
        params: Validated params with ``distributed.num_machines`` > 1.
        task: The stage every machine must launch.
        mine: What must be alike on every machine, flat and JSON-able
            (`llmpipe.train.checkpoints.machine_identity`: the caller computes it, this layer cannot).
        problem: Why this machine cannot run it (`llmpipe.distributed.launch.preflight`'s error), or None;
            machine 0 raises its own at once, before hosting (the others then time out waiting for it).

    Raises:
        UserError: On every machine that came, the same message: a machine missing after ``join_timeout_s``, two
            launches with one machine_rank, params/inputs/code that differ (named key by key, world size
            first), or a machine's own problem.
    """
    dist = params.distributed
    rank = dist.machine_rank
    if rank == 0 and problem:
        raise UserError(problem)
    import torch.distributed  # noqa: F401  (imported before the clock starts: seconds on a busy machine)

    mine = json.loads(json.dumps(mine, default=str))  # as the others' arrive: tuples as lists, paths as strings
    started = time.monotonic()
    store, hosted = _store(dist, host=rank == 0)
    if not hosted:
        store.add("joined", 1)
    if store.add(f"claim/{rank}", 1) > 1:
        _verdict(store, (f"distributed: two launches claim distributed.machine_rank {rank} at {_where(dist)}; "
                         f"give each of the {dist.num_machines} machines its own machine_rank, 0 … {dist.num_machines - 1}"))
    elif not hosted and rank:
        store.set(f"machine/{rank}", json.dumps({"identity": mine, "problem": problem}))
        store.append("arrivals", f"{rank} ")
    if hosted:
        verdict = _judge(store, params, task, mine)
        deadline = time.monotonic() + ACK_WAIT_S
        while store.add("ack", 0) < store.add("joined", 0) and time.monotonic() < deadline:
            time.sleep(POLL_S)  # every machine that came reads the verdict before the store goes
    else:
        left = dist.join_timeout_s - (time.monotonic() - started)
        try:
            store.wait(["verdict"], timedelta(seconds=max(1.0, left)))
        except RuntimeError:
            raise UserError(f"distributed: machine {rank} joined {_where(dist)} but machine 0 gave no answer within "
                            f"distributed.join_timeout_s ({dist.join_timeout_s:g} s)") from None
        verdict = store.get("verdict").decode()
        store.add("ack", 1)
    del store  # machine 0: the port is free again for torchrun's store
    if verdict != OK:
        raise UserError(verdict)
    log.info("distributed: machine %d of %d: every machine joined %s in %.1f s with the same params, inputs and code",
             rank, dist.num_machines, _where(dist), time.monotonic() - started)

"""What attnforge.distributed asks of torch.distributed: the group's size and rank, a check that every rank makes the
same call (so a mismatch raises on every rank instead of hanging one), the ring's point-to-point exchange, and
communication failures turned into one error type that names them. Nothing here computes attention."""
import os
import struct
import time
import zlib

import torch
import torch.distributed as dist

from .. import _C


class CommunicationError(RuntimeError):
    """A collective or point-to-point transfer of attnforge.distributed failed: a peer died, timed out or raised
    mid-call (the group's timeout bounds the wait). The message names the operation and the backend's reason."""


class _Checks:
    """Module settings. enabled: every call first checks that all ranks agree on shapes, dtypes and flags (one small
    all_gather; ATTNFORGE_DISTRIBUTED_CHECK=0 or set_consistency_check(False) turns it off)."""
    enabled = os.environ.get("ATTNFORGE_DISTRIBUTED_CHECK", "1") != "0"


checks = _Checks()


def set_consistency_check(enabled: bool) -> None:
    """Whether each call first checks that every rank of the group made the same call (default True). Off saves one
    small all_gather a call; a mismatch then shows as a wrong result or a communication error."""
    checks.enabled = bool(enabled)


def group_info(group):
    """(group, world size, this rank in the group); ValueError when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise _C.InvalidArgumentError("group: torch.distributed is not initialised (call "
                                      "torch.distributed.init_process_group first, e.g. under torchrun)")
    if group is None:
        group = dist.group.WORLD
    return group, dist.get_world_size(group), dist.get_rank(group)


def global_rank(group, rank: int) -> int:
    """A group rank as the global rank point-to-point calls take."""
    return rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, rank)


def guarded(what: str, function, *args, **kwargs):
    """function(*args, **kwargs), a torch.distributed call; its failure as CommunicationError naming `what`."""
    try:
        return function(*args, **kwargs)
    except CommunicationError:
        raise
    except RuntimeError as error:   # torch.distributed.DistError and its kinds are RuntimeErrors
        raise CommunicationError(f"attnforge.distributed: {what} failed: {error}") from error


def _code(value) -> int:
    """A descriptor field as an int64: ints as they are, floats by their bits, anything else by a CRC of its repr."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return zlib.crc32(repr(value).encode())


def check_consistent(group, world: int, device, what: str, fields: dict, local_error=None) -> None:
    """Every rank of `group` calls this with the same `fields` (name -> value: shapes, dtypes, flags, layouts) for one
    call of `what`; `local_error` is this rank's own refusal of its input (a message) or None. Raises on every rank
    when any rank refused or any field differs between ranks, naming the field and the ranks' values, so that no rank
    goes on into a transfer its peers never make. One all_gather of a few int64s when all agree."""
    if local_error is None and (world == 1 or not checks.enabled):
        return
    if world == 1:
        raise _C.InvalidArgumentError(local_error)
    names = list(fields)
    row = torch.tensor([0 if local_error is None else 1] + [_code(fields[n]) for n in names], dtype=torch.int64,
                       device=device)
    flat = torch.empty(world * row.numel(), dtype=torch.int64, device=device)   # gloo gathers along dim 0 only
    guarded(f"{what}: the ranks' consistency check (all_gather)", dist.all_gather_into_tensor, flat, row, group=group)
    rows = flat.view(world, row.numel())
    if bool((rows == rows[0]).all()) and int(rows[0, 0]) == 0:
        return
    gathered = [None] * world   # the slow path, only when something is wrong: readable values from every rank
    guarded(f"{what}: the ranks' consistency check (all_gather_object)", dist.all_gather_object, gathered,
            (local_error, [fields[n] for n in names]), group=group)
    refusals = [(r, e) for r, (e, _) in enumerate(gathered) if e is not None]
    if local_error is not None:
        raise _C.InvalidArgumentError(local_error)
    if refusals:
        r, message = refusals[0]
        raise _C.InvalidArgumentError(f"{what}: rank {r} of the group refused its input ({message}); every rank "
                                      "stops before any transfer")
    for i, name in enumerate(names):
        values = [g[1][i] for g in gathered]
        if any(v != values[0] for v in values):
            listing = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise _C.InvalidArgumentError(f"{what}: {name} differs between the ranks of the group ({listing}); "
                                          "every rank must make the same call on its own shard")
    raise _C.InvalidArgumentError(f"{what}: the ranks' calls differ")   # a CRC matched across different values


class _Stats:
    """Counters for benchmarks (bench/distributed_efficiency.py): seconds spent waiting for the ring's transfers
    (exposed communication) and bytes sent, since the last reset()."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.wait_seconds, self.bytes_sent, self.steps = 0.0, 0, 0


stats = _Stats()


class Ring:
    """Point-to-point exchange with the ring's neighbours: send to rank + 1, receive from rank - 1 (group ranks),
    posted together (batch_isend_irecv: one coalesced group on NCCL, plain isend/irecv on gloo), waited for later so
    that the transfer runs under the block's compute."""

    def __init__(self, group, world: int, rank: int, what: str):
        self.group, self.what = group, what
        self.next = global_rank(group, (rank + 1) % world)
        self.prev = global_rank(group, (rank - 1) % world)
        self._pending = []

    def post(self, send, receive):
        """Send each tensor of `send` to the next rank and receive into each of `receive` from the previous one."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in receive]
        requests = guarded(f"{self.what}: posting the ring's send/receive", dist.batch_isend_irecv, ops)
        stats.bytes_sent += sum(t.numel() * t.element_size() for t in send)
        stats.steps += 1
        self._pending.append((requests, tuple(send) + tuple(receive)))   # the tensors live until the wait

    def wait(self):
        pending, self._pending = self._pending, []
        start = time.perf_counter()
        for requests, _tensors in pending:
            for request in requests:
                guarded(f"{self.what}: the ring's send/receive", request.wait)
        stats.wait_seconds += time.perf_counter() - start

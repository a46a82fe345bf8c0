"""The rendezvous of a fake multi-node SGLang group: what stands in for torch.distributed.

Not run by itself: tests/fakes/fake_sglang.py runs every member (``--nnodes N --node-rank R
--dist-init-addr HEAD:PORT``), following SGLang 0.5.23's source, and uses this module for the one
thing it cannot have without torch and a GPU, the process group the ranks form:

- rank 0 (the head) listens on the dist-init port, as torch.distributed's TCP store does; a worker
  connects and sends ``JOIN <rank>\\n``; the head answers ``OK\\n``, and ``READY\\n`` to every rank
  once all ``nnodes`` have joined (the group is formed and the model loaded); a lost connection
  un-registers the rank;
- a worker that cannot reach the head within ``--join-timeout`` seconds (fake only) exits with
  status 1 and says so on stderr; a worker whose head goes away exits with status 1 too.

What each member serves over HTTP, and when, is fake_sglang.py's (SGLang's) part.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Awaitable, Callable


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class Rendezvous:
    """The head's side: which ranks joined, and an event set once all ``nnodes`` have."""

    def __init__(self, nnodes: int, dist_init_addr: str, label: str = "fake-sglang head") -> None:
        self.nnodes = nnodes
        self.dist_init_addr = dist_init_addr
        self.label = label
        self.joined: set[int] = {0}
        self.complete = asyncio.Event()  # every rank joined once (the group formed)
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def open(self) -> None:
        host, port = split_addr(self.dist_init_addr)
        self._server = await asyncio.start_server(self.on_worker, host, port)
        self._check_complete()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    def _check_complete(self) -> None:
        if len(self.joined) == self.nnodes and not self.complete.is_set():
            self.complete.set()
            for writer in self._writers:
                writer.write(b"READY\n")

    async def on_worker(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rank = None
        try:
            line = await asyncio.wait_for(reader.readline(), 10)
            parts = line.decode().split()
            if len(parts) != 2 or parts[0] != "JOIN" or not parts[1].isdigit():
                writer.write(b"ERR expected JOIN <rank>\n")
                return
            rank = int(parts[1])
            if not 0 < rank < self.nnodes or rank in self.joined:
                writer.write(f"ERR rank {rank} is not free\n".encode())
                rank = None
                return
            self.joined.add(rank)
            self._writers.append(writer)
            print(f"{self.label}: rank {rank} joined ({len(self.joined)}/{self.nnodes})", file=sys.stderr, flush=True)
            writer.write(b"OK\n")
            if self.complete.is_set():
                writer.write(b"READY\n")
            self._check_complete()
            await writer.drain()
            await reader.read()  # until the worker goes away
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            if rank is not None:
                self.joined.discard(rank)
                self._writers.remove(writer)
                print(f"{self.label}: rank {rank} left", file=sys.stderr, flush=True)
            writer.close()


async def run_worker(args: argparse.Namespace, label: str,
                     when_ready: Callable[[], Awaitable[object]] | None = None) -> int:
    """A worker rank: join the head, run ``when_ready`` once the group is formed, live while the head does."""
    host, port = split_addr(args.dist_init_addr)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.join_timeout
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            break
        except OSError as exc:
            if loop.time() >= deadline:
                print(f"{label} worker rank {args.node_rank}: cannot reach the head at "
                      f"{args.dist_init_addr}: {exc}", file=sys.stderr, flush=True)
                return 1
            await asyncio.sleep(0.1)
    writer.write(f"JOIN {args.node_rank}\n".encode())
    await writer.drain()
    answer = (await reader.readline()).decode().strip()
    if answer != "OK":
        print(f"{label} worker rank {args.node_rank}: the head refused: {answer or 'closed'}",
              file=sys.stderr, flush=True)
        return 1
    print(f"{label} worker rank {args.node_rank}: joined {args.dist_init_addr}", file=sys.stderr, flush=True)
    if (await reader.readline()).decode().strip() == "READY" and when_ready is not None:
        await when_ready()
    await reader.read()  # the head keeps the connection open while it lives
    print(f"{label} worker rank {args.node_rank}: lost the head", file=sys.stderr, flush=True)
    return 1

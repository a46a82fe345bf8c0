"""A fake member of a multi-node engine group, following SGLang's head/worker launch protocol.

    python tests/fakes/fake_multinode.py --nnodes N --node-rank R --dist-init-addr HEAD:PORT
        [--host 127.0.0.1 --port P] [--join-timeout S]

SGLang starts one process per node with the same ``--nnodes`` and ``--dist-init-addr`` and
its own ``--node-rank``; rank 0 (the head) opens the rendezvous port and serves the HTTP API.
This fake keeps that shape without torch or a GPU:

- the head listens on the dist-init port; a worker connects and sends ``JOIN <rank>\\n``, the
  head answers ``OK\\n`` and keeps the connection; a lost worker connection un-registers it;
- the head's ``GET /health`` is 200 only while all ``nnodes`` ranks are joined, 503 before;
  ``GET /fake/members`` lists the joined ranks; ``POST /release_memory_occupation`` and
  ``/resume_memory_occupation`` (SGLang's park API) release and resume tags as SGLang 0.5.23 does
  (200 with a null body; a resume of a tag not released, or a second release of one, kills the
  head, as in tests/fakes/fake_sglang.py), and /health reports ``released``;
- a worker that cannot reach the head within ``--join-timeout`` seconds exits with status 1
  and says so on stderr; a worker whose head goes away exits with status 1 too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

from aiohttp import web


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--dist-init-addr", required=True, help="HEAD:PORT")
    p.add_argument("--host", default="127.0.0.1", help="HTTP API address (head only)")
    p.add_argument("--port", type=int, default=0, help="HTTP API port (head only)")
    p.add_argument("--join-timeout", type=float, default=5.0)
    return p.parse_args(argv)


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class Head:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.joined: set[int] = {0}
        self.released = False
        self.offload_tags: set[str] = set()

    async def on_worker(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rank = None
        try:
            line = await asyncio.wait_for(reader.readline(), 10)
            parts = line.decode().split()
            if len(parts) != 2 or parts[0] != "JOIN" or not parts[1].isdigit():
                writer.write(b"ERR expected JOIN <rank>\n")
                return
            rank = int(parts[1])
            if not 0 < rank < self.args.nnodes or rank in self.joined:
                writer.write(f"ERR rank {rank} is not free\n".encode())
                rank = None
                return
            self.joined.add(rank)
            print(f"fake-multinode head: rank {rank} joined ({len(self.joined)}/{self.args.nnodes})",
                  file=sys.stderr, flush=True)
            writer.write(b"OK\n")
            await writer.drain()
            await reader.read()  # until the worker goes away
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            if rank is not None:
                self.joined.discard(rank)
                print(f"fake-multinode head: rank {rank} left", file=sys.stderr, flush=True)
            writer.close()

    async def health(self, request: web.Request) -> web.Response:
        complete = len(self.joined) == self.args.nnodes
        body = {"joined": sorted(self.joined), "nnodes": self.args.nnodes, "released": self.released}
        return web.json_response(body, status=200 if complete else 503)

    async def members(self, request: web.Request) -> web.Response:
        return web.json_response({"joined": sorted(self.joined)})

    async def _tags(self, request: web.Request) -> list[str]:
        # sglang/srt/managers/scheduler_components/weight_updater.py: null or [] means every tag
        # (sglang/srt/constants.py GPU_MEMORY_ALL_TYPES).
        body = await request.json()
        return list(body.get("tags") or ("kv_cache", "weights", "cuda_graph"))

    def _crash(self, error: str) -> None:
        # The scheduler's exception SIGQUITs SGLang's main process, which SIGKILLs its whole tree
        # (sglang/srt/managers/scheduler.py run_scheduler_process, utils/common.py kill_process_tree).
        print(f"fake-multinode head: Scheduler hit an exception: {error}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    async def release(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        for tag in tags:
            if tag in self.offload_tags:  # torch_memory_saver: a paused region paused again exits
                self._crash(f"Cannot pause allocation that is not active. tag={tag}")
        self.offload_tags.update(tags)
        self.released = bool(self.offload_tags)
        return web.json_response(None)

    async def resume(self, request: web.Request) -> web.Response:
        for tag in await self._tags(request):
            if tag not in self.offload_tags:  # offload_tags.remove(tag): KeyError
                self._crash(f"KeyError: {tag!r}")
            self.offload_tags.remove(tag)
        self.released = bool(self.offload_tags)
        return web.json_response(None)

    async def run(self) -> int:
        host, port = split_addr(self.args.dist_init_addr)
        server = await asyncio.start_server(self.on_worker, host, port)
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/fake/members", self.members)
        app.router.add_post("/release_memory_occupation", self.release)
        app.router.add_post("/resume_memory_occupation", self.resume)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, self.args.host, self.args.port)
        await site.start()
        print(json.dumps({"head": True, "dist_init": f"{host}:{port}", "http_port": self.args.port}),
              file=sys.stderr, flush=True)
        async with server:
            await server.serve_forever()
        return 0


async def run_worker(args: argparse.Namespace) -> int:
    host, port = split_addr(args.dist_init_addr)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.join_timeout
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            break
        except OSError as exc:
            if loop.time() >= deadline:
                print(f"fake-multinode worker rank {args.node_rank}: cannot reach the head at "
                      f"{args.dist_init_addr}: {exc}", file=sys.stderr, flush=True)
                return 1
            await asyncio.sleep(0.1)
    writer.write(f"JOIN {args.node_rank}\n".encode())
    await writer.drain()
    answer = (await reader.readline()).decode().strip()
    if answer != "OK":
        print(f"fake-multinode worker rank {args.node_rank}: the head refused: {answer or 'closed'}",
              file=sys.stderr, flush=True)
        return 1
    print(f"fake-multinode worker rank {args.node_rank}: joined {args.dist_init_addr}", file=sys.stderr, flush=True)
    await reader.read()  # the head keeps the connection open while it lives
    print(f"fake-multinode worker rank {args.node_rank}: lost the head", file=sys.stderr, flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not 0 <= args.node_rank < args.nnodes:
        print(f"--node-rank {args.node_rank} is outside 0..{args.nnodes - 1}", file=sys.stderr)
        return 2
    if args.node_rank == 0:
        return asyncio.run(Head(args).run())
    return asyncio.run(run_worker(args))


if __name__ == "__main__":
    sys.exit(main())

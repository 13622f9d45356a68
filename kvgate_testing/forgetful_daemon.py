"""A cache daemon that answers lookups truthfully but has lost every chunk by the time it is read.

It stands for chunks evicted between the scheduler's lookup and the worker's load: the failure a
connector must report (get_block_ids_with_load_errors) so the engine recomputes. Same flags as
`cachelayer server`: `python -m kvgate_testing.forgetful_daemon --port P --http-port Q ...`.
"""

from __future__ import annotations

import argparse

import zmq

from cachelayer.server import protocol
from cachelayer.server.daemon import StoreServer
from cachelayer.server.leases import Owner
from cachelayer.server.main import add_arguments, run
from cachelayer.server.protocol import Reply


class ForgetfulStoreServer(StoreServer):
    def _handle(self, frames: list[zmq.Frame], owner: Owner | None = None) -> tuple[Reply, memoryview | None]:
        header = frames[1] if frames and len(frames[0].bytes) == 0 else frames[0]
        if protocol.decode_request(header.buffer).op in ("retrieve", "lease"):
            return Reply(hit_tokens=0, chunk_size=self.config.chunk_size), None
        return super()._handle(frames, owner)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(), server_class=ForgetfulStoreServer)


if __name__ == "__main__":
    raise SystemExit(main())

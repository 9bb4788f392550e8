"""A TCP port forwarder: ``python forward.py LISTEN_PORT TARGET_HOST TARGET_PORT``.

What sits between a driver in a container and the cluster (Docker's ``-p``, a NAT gateway):
the executors connect to the forwarder's address, which is no address of the driver's.
Prints ``listening`` once it accepts connections, then a line per connection it relays.
"""

from __future__ import annotations

import asyncio
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        try:
            writer.write_eof()  # half-close, as the other side did
        except OSError:
            writer.close()


async def main(listen: int, host: str, port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        print(f"relaying {writer.get_extra_info('peername')[0]} to {host}:{port}", flush=True)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        for w in (writer, up_writer):
            w.close()

    server = await asyncio.start_server(handle, "0.0.0.0", listen)
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3])))

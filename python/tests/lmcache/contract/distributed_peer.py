"""A kvbridge transfer-channel context in its own process, driven over stdin/stdout.

``python distributed_peer.py URL PAGES PAGE_SIZE FILL`` registers an arena of PAGES pages
filled with byte FILL, listens on URL, prints ``ready``, then answers one command per line:

* ``read PEER_URL OFFSET SIZE`` reads the peer's ``[OFFSET, OFFSET+SIZE)`` into its own
  offset 0 through ``get_transfer_channel_client(PEER_URL)`` and prints ``read N HEX``
  (N: clients before the call; HEX: the first bytes read), or ``error TYPE MESSAGE``;
* ``clients`` prints ``clients N``;
* ``exit`` closes the context and exits 0.
"""

from __future__ import annotations

import sys
import time

import torch
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.transfer_channel.api import TransferChannelAddress

from kvbridge.lmcache.distributed import KvbridgeTransferChannelContext


def main(url: str, pages: int, page_size: int, fill: int) -> None:
    buf = torch.full((pages * page_size,), fill, dtype=torch.uint8)
    ctx = KvbridgeTransferChannelContext(
        L1MemoryDesc(ptr=buf.data_ptr(), size=buf.numel(), align_bytes=page_size),
        listen_url=url,
        advertise_url=url,
    )
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "exit":
            break
        if cmd == "clients":
            print(f"clients {ctx.get_num_connected_clients()}", flush=True)
        elif cmd == "read":
            peer_url, offset, size = args[0], int(args[1]), int(args[2])
            before = ctx.get_num_connected_clients()
            try:
                client = ctx.get_transfer_channel_client(peer_url)
                task = client.submit_read(
                    ctx.get_transfer_channel_address([(0, size)]),
                    [TransferChannelAddress(offset=offset, size=size)],
                )
                deadline = time.monotonic() + 30
                result = client.query_read_status(task)
                while not result.is_finished() and time.monotonic() < deadline:
                    time.sleep(0.001)
                    result = client.query_read_status(task)
                if not result.is_finished() or not all(result.succeeded_mask):
                    print(f"error ReadFailed {result}", flush=True)
                    continue
                print(f"read {before} {bytes(buf[:size][:16].tolist()).hex()}", flush=True)
            except Exception as err:  # noqa: BLE001 - reported to the driving test
                print(f"error {type(err).__name__} {err}", flush=True)
    ctx.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))

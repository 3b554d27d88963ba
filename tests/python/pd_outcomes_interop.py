"""Issue 3, test 6: the PD layer's outcomes, decoded by pyzmq + msgspec as LMCache's proxy does.

Binds a ZMQ PULL socket on 127.0.0.1, prints its port on the first stdout line, then reads
outcome messages until it has seen every request id named in argv (or its deadline passes),
decoding each with msgspec tagged structs. Prints one JSON line per message and `OK` at the end;
exits non-zero on a decode error or a timeout.

Run by crates/kvbridge-pd/tests/python_interop.rs; needs `pip install pyzmq msgspec`.
"""
import json
import sys
from typing import Union

import msgspec
import zmq


class ProxyNotif(msgspec.Struct, tag=True):
    req_id: str


class KvReady(msgspec.Struct, tag=True):
    req_id: str
    rank: int
    chunks: int
    bytes: int


class KvFailed(msgspec.Struct, tag=True):
    req_id: str
    rank: int
    reason: str


Outcome = Union[ProxyNotif, KvReady, KvFailed]


def main() -> int:
    wanted = set(sys.argv[1:])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    decoder = msgspec.msgpack.Decoder(Outcome)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    seen = set()
    while not wanted <= seen:
        if not poller.poll(20_000):
            print(f"TIMEOUT waiting for {sorted(wanted - seen)}", flush=True)
            return 2
        raw = sock.recv()
        msg = decoder.decode(raw)
        # The bytes we would write ourselves for the same message must match (same shape).
        if msgspec.msgpack.encode(msg) != raw:
            print(f"SHAPE {raw!r} != {msgspec.msgpack.encode(msg)!r}", flush=True)
            return 3
        d = msgspec.to_builtins(msg)
        d["type"] = type(msg).__name__
        print(json.dumps(d), flush=True)
        seen.add(msg.req_id)
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

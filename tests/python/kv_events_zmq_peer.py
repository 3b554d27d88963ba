"""A pyzmq (libzmq) peer for the KV-events PUB/SUB tests (crates/kvbridge-sim/tests/kv_events_pubsub.rs).

    python kv_events_zmq_peer.py pub        # bind a PUB, print its port, publish a
                                             # BlockStored batch every 20 ms (at most 10 s)
    python kv_events_zmq_peer.py pub ipc://PATH  # the same on a Unix socket; prints the endpoint
    python kv_events_zmq_peer.py sub PORT   # SUB to 127.0.0.1:PORT, print the first
                                             # message as JSON [topic, seq, batch]

Batches are written and read with msgspec as vLLM's ZmqEventPublisher does
([topic, 8-byte big-endian sequence, msgpack payload]).
"""

import json
import sys
import time

import msgspec
import zmq


def main():
    ctx = zmq.Context.instance()
    if sys.argv[1] == "pub":
        s = ctx.socket(zmq.PUB)
        if len(sys.argv) > 2:
            s.bind(sys.argv[2])
            print(sys.argv[2], flush=True)
        else:
            port = s.bind_to_random_port("tcp://127.0.0.1")
            print(port, flush=True)
        batch = [
            0.5,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [7],
                    "parent_block_hash": None,
                    "token_ids": [1, 2],
                    "block_size": 2,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            ],
            None,
        ]
        payload = msgspec.msgpack.encode(batch)
        for seq in range(500):
            s.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
            time.sleep(0.02)
    else:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.RCVTIMEO, 10_000)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(f"tcp://127.0.0.1:{sys.argv[2]}")
        topic, seq, payload = s.recv_multipart()
        print(json.dumps([topic.decode(), int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)]), flush=True)


if __name__ == "__main__":
    main()

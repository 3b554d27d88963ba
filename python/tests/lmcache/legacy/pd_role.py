"""One side of LMCache's PD backend (``PDBackendAsync``, unmodified) in its own process.

The test wires LMCache and kvbridge together exactly as a user does: an LMCache YAML file with
``transfer_channel: "kvbridge"`` and ``pd_buffer_device: "cpu"``, and ``kvbridge.lmcache``'s
``install()``. Everything else is LMCache's code. The process answers commands, one JSON
object per line on stdin, with one JSON object per line on stdout prefixed ``@@ ``:

* sender: ``{"op": "put", "req_id", "chunks", "last_chunk_toks", "seed"}`` fills ``chunks``
  chunks with a pattern derived from (seed, rank, chunk) and submits them in one batch, as
  LMCache's connector does; ``{"op": "free"}`` reports the free/total pages of the arena.
* receiver: ``{"op": "check", "req_id", "chunks", "last_chunk_toks", "seed"}`` compares the
  received chunks with the pattern byte for byte; ``{"op": "free"}``;
  ``{"op": "consume", "keys", "want_free"}`` reads and removes those chunks as LMCache's
  retrieve does, then waits (10 s at most) until ``want_free`` pages are free; ``{"op": "die_when_bytes_land", "seed"}`` kills the process (SIGKILL) as soon as the first
  bytes of that pattern appear in its arena, i.e. in the middle of the sender's write.

With ``--http-port`` the process is also an OpenAI-style worker for ``kvbridge proxy`` (flow
``lmcache``): the sender answers a prefill by putting the request's chunks for the
``disagg_spec`` it carries (chunk count and pattern derived from the request id), the receiver
answers a decode by checking those chunks byte for byte (``kv-verified`` in its answer, or a
500), and both answer ``GET /health``.

LMCache's ``close()`` hangs when nothing is mocked (its ZMQ contexts never terminate), so the
process ends with ``os._exit`` on ``{"op": "exit"}`` or end of input.
"""

from __future__ import annotations

import argparse
import ctypes
import http.server
import json
import os
import signal
import sys
import threading
import time
import zlib
from types import SimpleNamespace


def emit(**kw) -> None:
    sys.stdout.write("@@ " + json.dumps(kw) + "\n")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["sender", "receiver"])
    ap.add_argument("--config", required=True, help="LMCache YAML file")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--kv-shape", default="2,2,16,4,64")
    ap.add_argument("--receiver-host", default="127.0.0.1")
    ap.add_argument("--receiver-init-ports", default="")
    ap.add_argument("--receiver-alloc-ports", default="")
    ap.add_argument("--http-port", type=int, default=0)
    args = ap.parse_args()

    import torch

    import kvbridge.lmcache
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.pd_backend import PDBackend
    from lmcache.v1.storage_backend.pd_backend_async import PDBackendAsync

    kvbridge.lmcache.install()
    kv_shape = tuple(int(x) for x in args.kv_shape.split(","))
    config = LMCacheEngineConfig.from_file(args.config)
    md = LMCacheMetadata(
        model_name="kvbridge-test",
        world_size=args.world_size,
        local_world_size=args.world_size,
        worker_id=args.rank,
        local_worker_id=args.rank,
        kv_dtype=torch.bfloat16,
        kv_shape=kv_shape,
        chunk_size=kv_shape[2],
    )
    # As LMCache's storage manager chooses: `pd_backend_mode` (default async).
    backend_cls = PDBackend if config.pd_backend_mode == "sync" else PDBackendAsync
    backend = backend_cls(config, md)
    channel = backend.transfer_channel
    alloc = backend.memory_allocator.cpu_allocator
    emit(
        event="ready",
        channel=type(channel).__module__ + "." + type(channel).__name__,
        backend=type(backend).__name__,
        total=alloc.buffer_size // alloc.align_bytes,
    )

    def key(req_id: str, i: int) -> CacheEngineKey:
        return CacheEngineKey(
            model_name="kvbridge-test",
            world_size=args.world_size,
            worker_id=args.rank,
            chunk_hash=zlib.crc32(f"{req_id}/{i}".encode()),
            dtype=torch.bfloat16,
        )

    def shape_of(i: int, n: int, last_toks: int) -> torch.Size:
        s = list(kv_shape)
        if i == n - 1:
            s[2] = last_toks
        return torch.Size(s)

    def pattern(seed: int, i: int, shape: torch.Size) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + args.rank * 1009 + i)
        raw = torch.randint(-32768, 32767, shape, generator=g, dtype=torch.int16)
        return raw.view(torch.bfloat16)

    def first_word(seed: int) -> int:
        n_toks = kv_shape[2]
        return int(pattern(seed, 0, shape_of(0, 2, n_toks)).view(torch.int16).flatten()[:4].view(torch.int64)[0])

    def free() -> dict:
        return {"free": len(alloc.free_blocks), "total": alloc.buffer_size // alloc.align_bytes}

    def die_when_bytes_land(seed: int) -> None:
        want = first_word(seed)
        base, size, page = alloc.buffer_ptr, alloc.buffer_size, alloc.align_bytes

        def watch() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                for off in range(0, size, page):
                    if ctypes.c_int64.from_address(base + off).value == want:
                        os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.0005)

        threading.Thread(target=watch, daemon=True).start()

    def put(req: str, n: int, last: int, seed: int, host: str, init_ports, alloc_ports) -> dict:
        keys, objs = [], []
        for i in range(n):
            shape = shape_of(i, n, last)
            obj = backend.allocate(shape, torch.bfloat16, fmt=MemoryFormat.KV_2LTD)
            assert obj is not None, "sender arena full"
            obj.tensor.copy_(pattern(seed, i, shape))
            keys.append(key(req, i))
            objs.append(obj)
        spec = SimpleNamespace(
            req_id=req,
            receiver_host=host,
            receiver_init_port=[int(p) for p in str(init_ports).split(",")] if isinstance(init_ports, str) else list(init_ports),
            receiver_alloc_port=[int(p) for p in str(alloc_ports).split(",")] if isinstance(alloc_ports, str) else list(alloc_ports),
            is_last_prefill=True,
            num_transferred_tokens=0,
            total_chunks=n,
        )
        t0 = time.monotonic()
        try:
            backend.batched_submit_put_task(keys, objs, transfer_spec=spec)
            return dict(event="submitted", req_id=req, secs=time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - reported to the test
            return dict(event="submit_failed", req_id=req, secs=time.monotonic() - t0,
                        error=f"{type(e).__name__}: {e}")
        finally:
            # The backend holds its own references while it transfers.
            for o in objs:
                o.ref_count_down()

    def check(req: str, n: int, last: int, seed: int) -> dict:
        bad = []
        for i in range(n):
            obj = backend.get_blocking(key(req, i))
            want = pattern(seed, i, shape_of(i, n, last))
            got = obj.tensor
            if got.shape != want.shape or not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                bad.append(i)
        for i in range(n):
            backend.remove(key(req, i))
        return dict(event="checked", req_id=req, bad=bad, chunks=n)

    if args.http_port:
        serve_http(args, put, check)
        emit(event="http", port=args.http_port)

    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "exit":
                break
            if op == "free":
                emit(event="free", **free())
            elif op == "page":  # the digest of one page of the arena, as it is now
                at = alloc.buffer_ptr + cmd["index"] * alloc.align_bytes
                emit(event="page", digest=kvbridge.digest_ranges([(at, alloc.align_bytes)])[0])
            elif op == "windows":  # write windows: on? how many open, writes refused
                emit(event="windows", on=channel.write_windows, open=len(channel._windows),
                     refused=channel.write_refusals)
            elif op == "sessions":  # who the receiver's kvbridge channel knows, and refused
                st = channel.kvbridge_channel.stats()
                emit(event="sessions", sessions=st["sessions"], auth_failed=st["auth_failed"],
                     peer_id=channel.writer_id, open=len(channel._windows),
                     writers=sorted({w for _, w in channel._windows.values()}))
            elif op == "consume":  # as LMCache's retrieve: read each chunk, then remove it
                for k in cmd["keys"]:
                    ck = CacheEngineKey.from_string(k)
                    obj = backend.get_blocking(ck)
                    backend.remove(ck)
                    if isinstance(backend, PDBackend) and not isinstance(backend, PDBackendAsync):
                        obj.ref_count_down()  # sync remove() leaves it to the cache engine
                # with write windows, pages go back once their windows closed (a thread)
                until = time.monotonic() + 10
                while free()["free"] < cmd.get("want_free", 0) and time.monotonic() < until:
                    time.sleep(0.005)
                emit(event="consumed", **free())
            elif op == "die_when_bytes_land":
                die_when_bytes_land(cmd["seed"])
                emit(event="armed")
            elif op == "put":
                emit(**put(cmd["req_id"], cmd["chunks"], cmd["last_chunk_toks"], cmd["seed"],
                            args.receiver_host, args.receiver_init_ports, args.receiver_alloc_ports))
            elif op == "check":
                emit(**check(cmd["req_id"], cmd["chunks"], cmd["last_chunk_toks"], cmd["seed"]))
            else:
                emit(event="error", error=f"unknown op {op!r}")
        except Exception as e:  # noqa: BLE001 - reported to the test
            emit(event="error", op=op, error=f"{type(e).__name__}: {e}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def request_shape(req_id: str) -> tuple[int, int, int]:
    """(chunks, last chunk's tokens, seed) of a proxied request, derived from its id."""
    h = zlib.crc32(req_id.encode())
    return 2 + h % 3, 1 + (h >> 8) % 16, h % 100_000


def serve_http(args, put, check) -> None:
    role = args.role

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):  # the test reads stdout
            pass

        def answer(self, status: int, doc: dict) -> None:
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.answer(200, {"ok": True}) if self.path == "/health" else self.answer(404, {})

        def do_POST(self):
            doc = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
            params = doc.get("kv_transfer_params") or {}
            try:
                if role == "sender":
                    spec = params["disagg_spec"]
                    req = spec["req_id"]
                    n, last, seed = request_shape(req)
                    res = put(req, n, last, seed, spec["receiver_host"],
                              spec["receiver_init_port"], spec["receiver_alloc_port"])
                    if res["event"] != "submitted":
                        return self.answer(500, {"error": {"message": res["error"]}})
                    text = " first"
                else:
                    req = params["lmcache.pd_handoff_id"]
                    n, last, seed = request_shape(req)
                    res = check(req, n, last, seed)
                    if res["bad"]:
                        return self.answer(500, {"error": {"message": f"chunks {res['bad']} differ"}})
                    text = f" kv-verified {req} {n} chunks"
                emit(event="http", req_id=req, role=role)
            except Exception as e:  # noqa: BLE001 - the proxy gets the reason
                return self.answer(500, {"error": {"message": f"{type(e).__name__}: {e}"}})
            self.answer(200, {
                "id": "cmpl-" + req, "object": "text_completion", "created": int(time.time()),
                "model": doc.get("model", "m"),
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            })

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", args.http_port), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()


if __name__ == "__main__":
    main()

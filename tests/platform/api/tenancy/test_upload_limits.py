"""Limits enforced while a request is read: an upload over the size limit is refused (413) as
its bytes arrive, chunked or not, without reading the rest; uploads are read two at a time here
(no tenant holding both) into temporary files, not memory; a connection that sends no headers,
or stalls in its body, is answered 408 and closed. On a tiny random Llama."""

from __future__ import annotations

import json
import select
import socket
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from tenant_helpers import create_tenants, start_server, upload

sys.path.insert(0, str(Path(__file__).parents[3] / "adapters"))
from random_adapters import write_adapter  # noqa: E402

LIMIT = 8 * 1024 * 1024  # --max-adapter-bytes
READ_TIMEOUT_S = 1.0  # --request-read-timeout
BOUNDARY = "loraplexboundary"


@pytest.fixture(scope="module")
def world(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("uploads")
    tiny = tiny_llama_dir
    server = start_server(
        tiny, root / "data", max_adapter_bytes=LIMIT, max_concurrent_uploads=2,
        request_read_timeout_s=READ_TIMEOUT_S,
    )  # fmt: skip
    keys = create_tenants(server, "alpha", "bob", "carol")
    adapter = write_adapter(root / "adapter", json.loads((tiny / "config.json").read_text()), 2)
    yield {"server": server, "key": keys["alpha"], "keys": keys, "adapter": adapter}
    server.stop()


def _connect(world) -> socket.socket:
    host, port = world["server"].base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _upload_head(world, framing: str, key: str | None = None) -> bytes:
    return (
        f"POST /v1/adapters HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {key or world['key']}\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n{framing}\r\n\r\n"
    ).encode()


def _part_head() -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="name"\r\n\r\nbig\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="files"; '
        'filename="adapter_model.safetensors"\r\nContent-Type: application/octet-stream\r\n\r\n'
    ).encode()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _response(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))  # fmt: skip
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body[:length])


def test_a_chunked_upload_over_the_limit_is_refused_as_it_arrives(world):
    """512 MiB offered in chunks against an 8 MiB limit: the 413 comes long before the end."""
    sock = _connect(world)
    sock.sendall(_upload_head(world, "Transfer-Encoding: chunked") + _chunk(_part_head()))
    sent, piece = 0, b"\0" * 65536
    try:
        while sent < 64 * LIMIT and not select.select([sock], [], [], 0)[0]:
            sock.sendall(_chunk(piece))
            sent += len(piece)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed while we were still sending
    status, body = _response(sock)
    sock.close()
    assert status == 413 and body["error"]["code"] == "adapter_too_large"
    assert sent < 4 * LIMIT, sent  # the limit, and what socket buffers held: not the body


def test_a_declared_length_over_the_limit_is_refused_before_reading(world):
    sock = _connect(world)
    sock.sendall(_upload_head(world, f"Content-Length: {64 * LIMIT}"))
    status, body = _response(sock)
    sock.close()
    assert status == 413 and body["error"]["code"] == "adapter_too_large"


def test_upload_slots_are_bounded_and_no_tenant_holds_them_all(world):
    """Two slots: a tenant trickling an upload in holds one (its second upload: 429), another
    tenant's takes the other, a third tenant's then answers 503; once they end, it is served."""
    keys, adapter = world["keys"], world["adapter"]
    clients = {name: world["server"].client(key) for name, key in keys.items()}

    def hold(key: str) -> socket.socket:  # an upload that has sent part of its body
        sock = _connect(world)
        sock.sendall(_upload_head(world, "Transfer-Encoding: chunked", key) + _chunk(_part_head()))
        sock.sendall(_chunk(b"\0" * 1000))
        time.sleep(0.3)  # the server reads its head and takes an upload slot
        return sock

    alpha = hold(keys["alpha"])
    second = upload(clients["alpha"], "other", adapter)
    assert second.status_code == 429, second.text
    assert second.json()["error"]["type"] == "rate_limit_error"
    bob = hold(keys["bob"])
    busy = upload(clients["carol"], "other", adapter)
    assert busy.status_code == 503, busy.text
    assert busy.json()["error"]["code"] == "uploads_busy" and busy.headers["Retry-After"]
    alpha.close()  # the held uploads end (their clients gone), and their slots free
    bob.close()
    deadline = time.monotonic() + 10
    while (response := upload(clients["carol"], "other", adapter)).status_code == 503:
        assert time.monotonic() < deadline, "the held uploads' slots never freed"
        time.sleep(0.1)
    assert response.status_code == 201, response.text


def test_an_upload_is_spooled_to_disk_not_memory(world):
    """A 6 MiB upload raises the server's Python heap by far less than its size (its first MiB
    is held in memory, the rest goes to a temporary file, and it is unpacked in chunks)."""
    weights = b"\0" * (6 * 1024 * 1024)
    body = _part_head() + weights + f"\r\n--{BOUNDARY}--\r\n".encode()
    head = _upload_head(world, f"Content-Length: {len(body)}")
    sock = _connect(world)
    tracemalloc.start()
    try:
        sock.sendall(head)
        for start in range(0, len(body), 65536):
            sock.sendall(body[start : start + 65536])
        status, _ = _response(sock)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        sock.close()
    assert status == 400  # zeros are no safetensors file: read, stored, then refused
    assert peak < len(weights) // 2, peak


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: te"])
def test_a_connection_without_its_headers_is_closed_with_408(world, sent):
    sock = _connect(world)
    sock.sendall(sent)
    start = time.monotonic()
    status, body = _response(sock)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert READ_TIMEOUT_S - 0.2 < time.monotonic() - start < READ_TIMEOUT_S + 5
    assert sock.recv(1) == b""  # closed
    sock.close()


def test_a_body_that_stalls_is_answered_408_and_closed(world):
    sock = _connect(world)
    sock.sendall(
        (
            f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {world['key']}"
            "\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        ).encode()
        + b'{"prompt": "'
    )
    start = time.monotonic()
    status, body = _response(sock)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < READ_TIMEOUT_S + 5
    assert sock.recv(1) == b""
    sock.close()
    client = world["server"].client(world["key"])  # the server serves on
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).is_success

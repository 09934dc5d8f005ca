"""A local Cloud Storage for tests: gcp-storage-emulator behind a small fix-up proxy, both on 127.0.0.1.

The emulator serves gcsfs as it is, but tensorstore (Orbax's array writer) needs two things it lacks:
  - a media download carries the object's generation in `x-goog-generation` (else "Malformed
    StorageGeneration");
  - generation preconditions (`ifGenerationMatch`, `ifGenerationNotMatch`) answer 412 / 304 instead of
    being ignored (tensorstore's conditional reads and writes, and the workdir lock, rely on them).
The proxy forwards every request and adds both, serialising requests so that a precondition check and
the write it guards see the same object; it also turns away `moveTo` (gcsfs then copies and deletes). Everything runs in daemon threads of the test process and stops
with `close()` (or when the process exits). `stop_serving()` / `serve_again()` stage an outage: the proxy's port
refuses connections while the emulator keeps what it stores.
"""

from __future__ import annotations

import http.client
import http.server
import json
import logging
import threading
import urllib.parse
from email.parser import BytesParser

import portpicker

BUCKET = "bucket"
_OBJECT_PATHS = ("/storage/v1/b/", "/download/storage/v1/b/")


def _object_of(path: str) -> tuple[str, str] | None:
  """(bucket, object name) of an object URL path, else None."""
  for prefix in _OBJECT_PATHS:
    if path.startswith(prefix) and "/o/" in path:
      bucket, _, name = path[len(prefix):].partition("/o/")
      if name and "/" not in bucket:
        return bucket, urllib.parse.unquote(name)
  return None


def _upload_name(path: str, query: dict, headers, body: bytes) -> tuple[str, str] | None:
  """(bucket, name) of an upload: the `name` parameter, or the JSON part of a multipart body."""
  prefix = "/upload/storage/v1/b/"
  if not (path.startswith(prefix) and path.endswith("/o")):
    return None
  bucket = path[len(prefix):-len("/o")]
  if "name" in query:
    return bucket, query["name"][0]
  content_type = headers.get("Content-Type", "")
  if content_type.startswith("multipart/") and body:
    message = BytesParser().parsebytes(f"Content-Type: {content_type}\r\n\r\n".encode() + body)
    return bucket, json.loads(message.get_payload()[0].get_payload())["name"]
  if content_type.startswith("application/json") and body:  # a resumable upload's start
    return bucket, json.loads(body)["name"]
  return None


class _Proxy(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"  # answers `Expect: 100-continue` at once (curl would wait 1 s per upload)
  upstream: tuple[str, int]
  lock: threading.Lock

  def log_message(self, format, *args):  # noqa: A002 (the base class's name)
    pass

  def _body(self) -> bytes:
    if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
      chunks = []
      while True:
        size = int(self.rfile.readline().split(b";")[0], 16)
        if not size:
          self.rfile.readline()
          return b"".join(chunks)
        chunks.append(self.rfile.read(size))
        self.rfile.readline()
    return self.rfile.read(int(self.headers.get("Content-Length") or 0))

  def _upstream(self, method: str, url: str, body: bytes | None = None, headers=None):
    conn = http.client.HTTPConnection(*self.upstream, timeout=60)
    conn.request(method, url, body=body, headers=headers or {})
    response = conn.getresponse()
    return response.status, response.getheaders(), response.read()

  def _generation(self, bucket: str, name: str) -> int | None:
    status, _, data = self._upstream("GET", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}")
    return int(json.loads(data)["generation"]) if status == 200 else None

  def _reply(self, status: int, headers=(), body: bytes = b""):
    self.send_response(status)
    for key, value in headers:
      if key.lower() not in ("content-length", "connection", "transfer-encoding", "server", "date"):
        self.send_header(key, value)
    self.send_header("Content-Length", str(len(body)))
    self.send_header("Connection", "close")
    self.end_headers()
    self.close_connection = True
    if self.command != "HEAD":
      try:
        self.wfile.write(body)
      except (BrokenPipeError, ConnectionResetError):
        pass  # the client stopped reading (it had what it needed)

  def _handle(self):
    body = self._body()
    parsed = urllib.parse.urlsplit(self.path)
    query = urllib.parse.parse_qs(parsed.query)
    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "expect", "connection")}
    if body or self.command in ("POST", "PUT", "PATCH"):
      headers["Content-Length"] = str(len(body))
    if "/moveTo/" in parsed.path:  # not served by the emulator (501, which gcsfs retries for half a minute);
      return self._reply(400)  # a 400 makes gcsfs fall back to copy + delete at once
    target = _object_of(parsed.path) or (
        _upload_name(parsed.path, query, self.headers, body) if self.command == "POST" else None)
    with self.lock:
      generation = self._generation(*target) if target else None
      match = query.get("ifGenerationMatch", [None])[0]
      not_match = query.get("ifGenerationNotMatch", [None])[0]
      if match is not None and (generation or 0) != int(match) and not (generation is None and self.command == "DELETE"):
        return self._reply(412)
      if not_match is not None and generation is not None and generation == int(not_match):
        return self._reply(304 if self.command in ("GET", "HEAD") else 412)
      if self.command == "GET" and match == "0":  # "does it not exist?" asked of an absent object
        return self._reply(204)
      status, response_headers, data = self._upstream(self.command, self.path, body or None, headers)
      if status == 200 and target and query.get("alt") == ["media"] and generation is not None:
        response_headers = [*response_headers, ("x-goog-generation", str(generation)),
                            ("x-goog-metageneration", "1")]
    self._reply(status, response_headers, data)

  do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle


class LocalGCS:
  """An emulator with one bucket, behind the fix-up proxy; `env` points gcsfs and tensorstore at it."""

  def __init__(self, bucket: str = BUCKET):
    from gcp_storage_emulator.server import create_server

    self.bucket = bucket
    emulator_port, proxy_port = portpicker.pick_unused_port(), portpicker.pick_unused_port()
    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)  # it logs every miss and text reply
    self._emulator = create_server("127.0.0.1", emulator_port, in_memory=True, default_bucket=bucket)
    self._emulator.start()
    handler = type("Proxy", (_Proxy,), {"upstream": ("127.0.0.1", emulator_port), "lock": threading.Lock()})
    self._handler, self._port = handler, proxy_port
    self._serve()
    self.url = f"http://127.0.0.1:{proxy_port}"
    self.env = {
        "STORAGE_EMULATOR_HOST": self.url,  # gcsfs and google-cloud-storage
        "TENSORSTORE_GCS_HTTP_URL": self.url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",  # tensorstore: no credential lookup
        "NO_GCE_CHECK": "true",  # google-auth: do not probe for a metadata server
        "FSSPEC_GCS_TOKEN": "anon",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # no bucket-type lookups the emulator does not serve
        "EPATH_USE_TF": "false",
    }

  def _serve(self):
    self._proxy = http.server.ThreadingHTTPServer(("127.0.0.1", self._port), self._handler)
    self._proxy.daemon_threads = True
    self._thread = threading.Thread(target=self._proxy.serve_forever, name="gcs-proxy", daemon=True)
    self._thread.start()

  def stop_serving(self):
    """An outage: connections to `url` are refused from now on; the stored objects stay (`serve_again`)."""
    self._proxy.shutdown()
    self._proxy.server_close()

  def serve_again(self):
    """The end of an outage: the same bucket, with what it held, at the same `url`."""
    self._serve()

  def exists(self, name: str) -> bool:
    """Whether the bucket holds the object `name` (asked of the emulator itself, not through the proxy)."""
    conn = http.client.HTTPConnection(*self._handler.upstream, timeout=10)
    conn.request("GET", f"/storage/v1/b/{self.bucket}/o/{urllib.parse.quote(name, safe='')}")
    response = conn.getresponse()
    response.read()
    return response.status == 200

  def read(self, name: str) -> bytes | None:
    """The object `name`'s bytes, or None if the bucket has none (asked of the emulator itself)."""
    conn = http.client.HTTPConnection(*self._handler.upstream, timeout=10)
    conn.request("GET", f"/storage/v1/b/{self.bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media")
    response = conn.getresponse()
    body = response.read()
    return body if response.status == 200 else None

  def close(self):
    self.stop_serving()
    self._emulator.stop()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

"""The S3 test server itself: it starts, takes objects, survives a crash and restart."""

from __future__ import annotations

import obstore
from obstore.store import S3Store

from tests.s3server import SeaweedS3


def _store(server: SeaweedS3, bucket: str) -> S3Store:
    options = server.options()
    endpoint = options.pop("endpoint")
    return S3Store(bucket, endpoint=endpoint, client_options={"allow_http": True}, **options)


def test_server_keeps_objects_across_a_crash(s3_server: SeaweedS3) -> None:
    bucket = s3_server.new_bucket()
    store = _store(s3_server, bucket)
    obstore.put(store, "run/a", b"x" * 1000)
    s3_server.kill()
    s3_server.start()
    assert bytes(obstore.get(store, "run/a").bytes()) == b"x" * 1000
    assert [m["path"] for m in obstore.list(store, prefix="run").collect()] == ["run/a"]

"""Remote-tier benchmark: astage's upload and restore against raw obstore on the same server.

An S3-compatible server on 127.0.0.1 (SeaweedFS, started here; or ``--url`` with its
options from the environment), two inputs: (a) ``gpt2-like``, the staging benchmark's
GPT-2-small-shaped checkpoint with Adam state (~1.5 GB at scale 1), and (b) ``small-20k``,
20,000 small tensors.  Each round, in the same process:

* ``upload``: a Checkpointer with the remote tier saves a step; timed from the start of the
  upload to its commit object durable on the store (``UploadStats.seconds``), against
  ``raw put``: one ``obstore.put`` of the same local file (same part size and concurrency)
  to the same server.  Target: astage's throughput >= 0.8x the raw put's.
* ``restore``: a fresh Checkpointer on an empty directory restores the step from the store
  (list, commit objects, download verified, commit locally, load with every checksum),
  against ``raw get + local restore``: one ``obstore.get`` of the object into a file plus
  ``load_checkpoint_file`` of it.  Target: <= 1.25x.
* ``save() blocking``: how long ``save()`` kept the caller, with and without the remote tier
  (each after a warm-up save). Target: unchanged (ratio ~1).
* ``peak RSS``: growth of the peak RSS over the RSS at the start of the upload, while it
  runs (the staged copy is already released then): target <= 64 MB.

Medians over ``--runs`` rounds; ratios are medians of per-round ratios.

    python -m benchmarks.bench_remote [--scale S] [--runs N] [--case NAME] [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import obstore

from .common import (
    PeakRss,
    default_scale,
    environment,
    format_table,
    gpt2_adam_state_dict,
    median,
    small_tensors_state_dict,
)

CASES: dict[str, Callable[[float], dict[str, Any]]] = {
    "gpt2-like": gpt2_adam_state_dict,
    "small-20k": small_tensors_state_dict,
}
CHUNK = 16 << 20
CONCURRENCY = 4


def _remote(url: str, options: dict[str, Any], client_options: dict[str, Any]) -> Any:
    import astage

    return astage.remote.Remote(
        url, options=options, client_options=client_options, chunk_nbytes=CHUNK, max_concurrency=CONCURRENCY
    )


async def _round(
    state: dict[str, Any], url: str, options: dict[str, Any], client: dict[str, Any], work: Path, i: int
) -> dict[str, float]:
    import astage
    from astage._remote.layout import data_key

    prefix = f"{url}/round{i}"
    remote = _remote(prefix, options, client)
    local = work / f"a{i}"
    async with astage.Checkpointer(local / "plain", keep=1) as plain:
        await (await plain.save(0, state)).wait()  # warm-up: the stager's buffers
        blocking_plain = (await plain.save(1, state)).staging_seconds
    async with astage.Checkpointer(local / "remote", keep=1, remote=remote) as ckpt:
        await (await ckpt.save(0, state)).uploaded()  # warm-up
        handle = await ckpt.save(1, state)
        await handle.wait()
        rss = PeakRss()
        stats = await handle.uploaded()
        peak = rss.growth()
    assert stats is not None
    path = local / "remote" / "step_0000000001" / "rank00000.astage"
    store = remote.client().store
    begin = time.perf_counter()
    await anyio.to_thread.run_sync(
        lambda: obstore.put(  # type: ignore[union-attr]
            store, "raw/object", path, chunk_size=CHUNK, max_concurrency=CONCURRENCY
        )
    )
    raw_put = time.perf_counter() - begin
    begin = time.perf_counter()
    async with astage.Checkpointer(work / f"fresh{i}", remote=_remote(prefix, options, client)) as fresh:
        await fresh.restore(step=1)
    restore = time.perf_counter() - begin
    raw_file = work / f"raw{i}.astage"
    begin = time.perf_counter()

    def raw_get() -> None:
        with open(raw_file, "wb") as f:
            for piece in obstore.get(store, data_key(1, 0)).stream(min_chunk_size=CHUNK):  # type: ignore[union-attr]
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())

    await anyio.to_thread.run_sync(raw_get)
    await astage.load_checkpoint_file(raw_file)
    raw_restore = time.perf_counter() - begin
    return {
        "nbytes": stats.nbytes,
        "upload_s": stats.seconds,
        "raw_put_s": raw_put,
        "restore_s": restore,
        "raw_restore_s": raw_restore,
        "save_blocking_s": handle.staging_seconds,
        "save_blocking_plain_s": blocking_plain,
        "upload_peak_rss": peak,
    }


def _summary(case: str, rounds: list[dict[str, float]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return median([r[key] for r in rounds])

    def ratio(a: str, b: str) -> float:
        return median([r[a] / r[b] for r in rounds if r[b] > 0])

    return {
        "case": case,
        "nbytes": rounds[0]["nbytes"],
        "upload_s": med("upload_s"),
        "raw_put_s": med("raw_put_s"),
        "upload_x_raw_throughput": ratio("raw_put_s", "upload_s"),
        "restore_s": med("restore_s"),
        "raw_restore_s": med("raw_restore_s"),
        "restore_x_raw": ratio("restore_s", "raw_restore_s"),
        "save_blocking_s": med("save_blocking_s"),
        "save_blocking_plain_s": med("save_blocking_plain_s"),
        "save_blocking_x_plain": ratio("save_blocking_s", "save_blocking_plain_s"),
        "upload_peak_rss_mb": med("upload_peak_rss") / 1e6,
        "rounds": rounds,
    }


def _print(results: list[dict[str, Any]]) -> None:
    headers = ["case", "MB", "upload s", "raw put s", "x raw tput", "restore s", "raw get+load s", "x raw"]
    headers += ["save() ms", "no remote ms", "x", "upload RSS MB"]
    rows = [
        [
            r["case"],
            f"{r['nbytes'] / 1e6:.1f}",
            f"{r['upload_s']:.3f}",
            f"{r['raw_put_s']:.3f}",
            f"{r['upload_x_raw_throughput']:.2f}",
            f"{r['restore_s']:.3f}",
            f"{r['raw_restore_s']:.3f}",
            f"{r['restore_x_raw']:.2f}",
            f"{r['save_blocking_s'] * 1e3:.1f}",
            f"{r['save_blocking_plain_s'] * 1e3:.1f}",
            f"{r['save_blocking_x_plain']:.2f}",
            f"{r['upload_peak_rss_mb']:.1f}",
        ]
        for r in results
    ]
    print(format_table(headers, rows))
    print("targets: x raw tput >= 0.8; restore x raw <= 1.25; save() x ~1; upload RSS <= 64 MB")


def _target(args: argparse.Namespace) -> tuple[str, dict[str, Any], dict[str, Any], Callable[[], None]]:
    """The store URL, its options, client options, and what stops the server."""
    if args.url:
        return args.url, {}, {}, lambda: None
    from .s3server import start_seaweed

    server, why = start_seaweed()
    if server is None:
        print(f"no S3 server ({why}): using a file:// store instead")
        root = Path(tempfile.mkdtemp(prefix="astage-bench-store-"))
        return root.as_uri(), {}, {}, lambda: shutil.rmtree(root, ignore_errors=True)
    bucket = server.new_bucket()

    def stop() -> None:
        server.stop()
        shutil.rmtree(server.root, ignore_errors=True)

    return f"s3://{bucket}/bench", server.options(), {"allow_http": True}, stop


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scale", type=float, default=None, help="input size (1.0: ~1.5 GB gpt2-like)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--case", choices=sorted(CASES), action="append")
    parser.add_argument("--url", default=None, help="a store URL instead of a local SeaweedFS")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="smallest sizes, one run (a smoke test)")
    args = parser.parse_args()
    scale = args.scale if args.scale is not None else (0.01 if args.quick else default_scale())
    runs = 1 if args.quick else args.runs
    url, options, client, stop = _target(args)
    work = Path(tempfile.mkdtemp(prefix="astage-bench-remote-"))
    results = []
    try:
        for case in args.case or sorted(CASES):
            state = CASES[case](scale)
            rounds = [anyio.run(_round, state, url, options, client, work / case, i) for i in range(runs)]
            results.append(_summary(case, rounds))
            shutil.rmtree(work / case, ignore_errors=True)
    finally:
        stop()
        shutil.rmtree(work, ignore_errors=True)
    _print(results)
    if args.json is not None:
        args.json.write_text(
            json.dumps({"environment": environment(), "scale": scale, "results": results}, indent=1)
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()

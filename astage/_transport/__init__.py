"""Move one replica between ranks of a process group without blocking the event loop.

A replica travels as a :class:`Payload`: a small ``prefix`` blob (the format's header) and
a logical ``body`` described by ``(offset, uint8 tensor)`` segments, gaps being zeros.  On
the wire it is a few large messages, each kind on its own tag, in this order::

    PREAMBLE  int64[8]   magic, version, prefix_len, body_nbytes, chunk_bytes, 0, 0, 0
    PREFIX    uint8[prefix_len]                    (absent when prefix_len == 0)
    BODY      uint8[chunk_bytes] x n, then the rest (absent when body_nbytes == 0)

and, once the receiver has persisted the replica, an acknowledgement back (``ACK``: 256
bytes holding ok/failed and a short message).  Body chunks lie on a fixed grid of
``chunk_bytes``, so both sides cut the body alike.  A chunk that one segment covers is sent
as a view of it (no copy); any other chunk is packed (one memmove a part) in a worker thread
into one of two reusable buffers while the previous chunk is on the wire.  The receiver
checks the preamble before it allocates anything, hands the prefix to ``on_prefix`` (which
may refuse it) before it allocates the body, then posts a window of chunk receives into the
body tensor and hands each chunk to ``on_chunk`` as it lands, while the next ones are in
flight.

The protocol above is the same on every backend; a *wire* per backend moves the messages
(:func:`wire_kind` picks it from the group's backend configuration):

* **gloo** (any group with ``cpu:gloo``, ``cpu:gloo,cuda:nccl`` included: the payload is on
  the CPU already).  CPU tensors go straight through.  Gloo reports a point-to-point
  ``Work`` complete only from inside ``wait()`` (its ``is_completed()`` stays false and
  ``get_future()`` is missing; checked on torch 2.13), so each direction waits in its own
  worker thread (two per call, under a private limiter).  Gloo sends are rendezvous: a send
  completes only once the peer has posted the matching receive, which is why
  acknowledgements go both ways at once (:func:`exchange_ack`).
* **nccl** (a ``cuda:nccl`` group without gloo).  NCCL moves device tensors only, so each
  message crosses through a device bounce buffer from a small per-call pool: a message to
  send is copied host-to-device on a side stream (from the loop when the host tensor is
  pinned, in a worker thread otherwise) and the NCCL launch waits for that stream; a
  received message lands in a bounce buffer and is copied device-to-host on a second side
  stream, and counts as received once that copy has completed.  NCCL's
  ``Work.is_completed()`` queries the work's CUDA end event, so completion is polled from
  the loop with :func:`astage._staging.events.wait_event`'s back-off and no thread waits.  NCCL
  ignores tags and runs a rank's point-to-point work on one stream in launch order: a lone
  send to a peer that is itself sending would never complete, so the k-th message of each
  direction is launched together with the k-th of the other, as one ``batch_isend_irecv``
  (one NCCL group), which :class:`Pairing` schedules.  Launches run one at a time, in
  order, in a worker thread: the first one on a group creates its NCCL communicator and
  blocks until every rank of the group has arrived.

Invariants:

* Every message is posted non-blocking, receives first, and each direction waits only on
  its own peer, so an exchange cannot deadlock for any world size and ring offset (W = 2,
  where both peers are one rank, included) as long as every rank takes part.  On NCCL the
  k-th launch of every rank matches the k-th launches of its peers, and a direction posts
  message k only once its message k - window has completed, so by induction on k every
  launch finds its matches.
* The whole call honours ``timeout``: it raises :class:`PeerTimeoutError` at the deadline,
  or :class:`TransportError` as soon as the backend reports a failure; it never waits for
  the process group's own timeout.  ``timeout`` is a parameter rather than the caller's
  cancel scope (ruff ASYNC109) because it must reach the gloo waits in worker threads.
* Pending point-to-point work cannot be cancelled.  So when a call fails or is cancelled
  after posting anything, it **breaks the group on purpose** before it returns (a call that
  fails before its first post, say on a bad argument, leaves the group as it was).  Gloo: a
  1 ms timed-out receive makes gloo close every connection of the group on this rank; gloo
  lets go of every payload and body tensor at once, and the peers fail at once instead of
  at their own deadline.  NCCL: ``ProcessGroup.abort()`` tears the communicator down (its
  kernels exit and let go of the bounce buffers, which torch keeps alive until then) and
  the side streams are drained, so no copy touches a payload or body afterwards; NCCL has
  no connection to close, so the peers fail at their own deadline.  The call returns once
  the abort has (torch bounds an abort by the group's own timeout).  Either way the caller
  must treat the group as dead: destroy it (``dist.destroy_process_group(pg)``) and make a
  new one, or restart the job.  A subgroup made with ``new_group`` breaks alone: the
  default group survives.  A failure that the peer *reports* in a well-formed
  acknowledgement (:class:`PeerReportedError`) leaves the group intact.
* Cancellation is delivered at once; only a packing copy or a copy from or to pageable
  memory (one chunk) finishes first.  Gloo threads waiting on abandoned work return when
  the group is broken, a few ms later.
* A buffer (a pack buffer, a bounce buffer, the caller's segments and body) is reused or
  released only once every copy and every backend operation touching it has been seen
  complete, or the group has been broken.

One call at a time per group, on every backend.  On NCCL, moreover, nothing else may use
the group during a call: its collectives and our launches share one communicator, whose
operations every rank must issue in the same order, so give replication a group of its own
(``dist.new_group``).  Each rank must use its own device: the group's bound device
(``init_process_group(device_id=...)``), else the current CUDA device
(``torch.cuda.set_device``).  The first call on a group must be made by all of its ranks (a
ring exchange is), unless the group was initialised with ``device_id``, which creates the
communicator up front.  In a group of one rank, NCCL may loop back (``send_to == recv_from
== 0``): one GPU runs the whole path that way.  Other backends are refused.

The package, one module per concept (only :mod:`.nccl` needs a GPU to run):

* :mod:`.protocol`: the wire format and pure decisions (payload, preamble, chunk plan,
  acknowledgement, peers, which wire); no I/O.
* :mod:`.pairing`: the order of NCCL launches; pure.
* :mod:`.core`: the protocol core, sans I/O: one call's state (deadline, progress, pending
  messages, outcome, when to break the group) and its directions as generators of actions
  (post, complete, expect, pack, hand to a hook), which both drivers run.
* :mod:`.wire`: what a backend's wire provides to the awaiting driver (post, complete,
  break the group).
* :mod:`.gloo`: gloo's post, wait and break (both drivers), and the gloo wire.
* :mod:`.nccl`: the NCCL wire (device bounce buffers, side streams, paired launches).
* :mod:`.link`: the awaiting driver: the core's actions on the event loop, under the
  deadline, breaking the group on failure.
* :mod:`.exchange`: the async calls (exchange, send, recv, acknowledgements).
* :mod:`.blocking`: the blocking driver and its calls (gloo, on a save's worker thread).
"""

from .exchange import exchange, exchange_ack, recv, recv_ack, send, send_ack
from .pairing import Pairing
from .protocol import (
    ACK_BYTES,
    ACK_MESSAGE_BYTES,
    ACK_TAG,
    BODY_TAG,
    CHUNK_BYTES,
    MAGIC,
    MAX_CHUNK_BYTES,
    MAX_PREFIX_BYTES,
    MIN_CHUNK_BYTES,
    PREAMBLE_TAG,
    PREAMBLE_WORDS,
    PREFIX_TAG,
    VERSION,
    Allocate,
    Chunk,
    ChunkPlan,
    ExchangeStats,
    OnChunk,
    OnPrefix,
    Payload,
    Received,
    WireKind,
    plan_chunks,
    ring_peers,
    wire_kind,
)

__all__ = [
    "ACK_BYTES",
    "ACK_MESSAGE_BYTES",
    "ACK_TAG",
    "BODY_TAG",
    "CHUNK_BYTES",
    "MAGIC",
    "MAX_CHUNK_BYTES",
    "MAX_PREFIX_BYTES",
    "MIN_CHUNK_BYTES",
    "PREAMBLE_TAG",
    "PREAMBLE_WORDS",
    "PREFIX_TAG",
    "VERSION",
    "Allocate",
    "Chunk",
    "ChunkPlan",
    "ExchangeStats",
    "OnChunk",
    "OnPrefix",
    "Pairing",
    "Payload",
    "Received",
    "WireKind",
    "exchange",
    "exchange_ack",
    "plan_chunks",
    "recv",
    "recv_ack",
    "ring_peers",
    "send",
    "send_ack",
    "wire_kind",
]

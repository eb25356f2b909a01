"""The checkpoint file format: one safe byte layout for the wire and the disk, pure.

A checkpoint file is a staged state_dict as bytes (a replica, a peer's copy kept on this
rank, is one such file)::

    MAGIC (8) | version u32 LE | header_len u64 LE | header (header_len bytes)
    | crc32c u32 LE of everything before it | zero padding to a 64-byte boundary | body

    header = counts u64[4] (tensors, dims, storages, structure bytes) | tensor table
           | dims int64[] | storage table | structure JSON | values JSON | spaces

The body holds each distinct storage's raw bytes once, in plan order, each segment starting
at the first 64-byte boundary after the previous one, gaps zero, nothing after the last.
The header says how to view those storages as tensors (a binary table of fixed-size
records, one per tensor and one per storage), how to rebuild the tree (the structure: JSON
that refers to tensors and to scalar table entries by index) and the values (the metadata
and the scalar table).  Only version :data:`FORMAT_VERSION` is written and read.  See
``docs/format.md`` for the schema.

This module is the format's façade: the names other rooms use, from the modules that make
them: :mod:`~astage._format.spec` (version, limits, allow-lists, header records),
:mod:`~astage._format.tables` (the binary tables), :mod:`~astage._format.scalars` (the
scalar table), :mod:`~astage._format.tree_encoder` and :mod:`~astage._format.header_parser`
(the JSON documents), :mod:`~astage._format.parse_bound` (the parse allocation bound),
:mod:`~astage._format.encoder` and :mod:`~astage._format.encoded` (writing),
:mod:`~astage._format.reader` and :mod:`~astage._format.body` (reading).

Invariants:

* No pickle, ``torch.load``, ``eval`` or import by name: the header is JSON, dtypes come from
  an explicit allow-list, namedtuples are rebuilt with :func:`collections.namedtuple`.
* Decoding trusts nothing.  Lengths are checked against :data:`HEADER_CAP` and against the
  bytes at hand before anything is allocated; the header is checksummed and its schema
  checked strictly (types, ranges, indices, layout, every tensor inside its storage; the
  binary tables column by column with numpy, not record by record in Python);
  every storage's crc32c is verified before any tensor is returned.  Each violation raises
  :class:`IntegrityError`; a wrong tensor is never returned.
* Parsing is bounded before it starts: a count of the header's tokens bounds what the parse
  can allocate (plus a fixed cost a table record, a scalar and the structure's charges, all
  from :data:`astage._format.parse_bound.NODE_COSTS`), a header that could need more than
  :data:`PARSE_AMPLIFICATION` times its length is refused, and the encoder counts the same
  charges and pads a header with spaces where it would not fit.
* Encoding is faithful or fails: aliasing and object identity survive the round trip, leaves
  come back with their type and value (numpy scalars bit for bit, ``-0.0`` too), and a value the
  format cannot hold raises :class:`UnsupportedInputError` naming its key path.
"""

from __future__ import annotations

from .body import BodyVerifier as BodyVerifier
from .body import byte_view as byte_view
from .body import decode as decode
from .body import verify_body as verify_body
from .encoded import Encoded as Encoded
from .encoder import FileLayout as FileLayout
from .encoder import FileMeta as FileMeta
from .encoder import encode as encode
from .encoder import lay_out as lay_out
from .encoder import lay_out_in_slices as lay_out_in_slices
from .reader import CheckedPrefix as CheckedPrefix
from .reader import check_prefix as check_prefix
from .reader import parse_checked as parse_checked
from .reader import parse_prefix as parse_prefix
from .reader import prefix_nbytes as prefix_nbytes
from .spec import ALIGNMENT as ALIGNMENT
from .spec import DTYPES as DTYPES
from .spec import FIXED_PREFIX_NBYTES as FIXED_PREFIX_NBYTES
from .spec import FORMAT_VERSION as FORMAT_VERSION
from .spec import HEADER_CAP as HEADER_CAP
from .spec import MAGIC as MAGIC
from .spec import MAX_DEPTH as MAX_DEPTH
from .spec import MAX_NDIM as MAX_NDIM
from .spec import NUMPY_DTYPES as NUMPY_DTYPES
from .spec import PARSE_AMPLIFICATION as PARSE_AMPLIFICATION
from .spec import PARSE_SLACK as PARSE_SLACK
from .spec import DTensorNote as DTensorNote
from .spec import FileHeader as FileHeader
from .spec import Segment as Segment
from .spec import Segments as Segments
from .tables import STORAGE_RECORD as STORAGE_RECORD
from .tables import TENSOR_RECORD as TENSOR_RECORD

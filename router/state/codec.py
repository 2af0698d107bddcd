"""Compact wire encoding of change batches (msgpack; block hashes as packed little-endian u64)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence

import msgpack

from router.state.records import ChangeKind, IndexChange, RegistryChange, RegistryKind

__all__ = ["CodecError", "decode_batch", "encode_batch", "pack_hashes", "unpack_hashes"]

_BIG_ENDIAN = sys.byteorder == "big"
_INDEX_KINDS = {k.value: k for k in ChangeKind}
_REGISTRY_KINDS = {k.value: k for k in RegistryKind}

Change = IndexChange | RegistryChange


class CodecError(ValueError):
    """A stream entry or snapshot that this version cannot decode (skipped and counted)."""


def pack_hashes(hashes: Iterable[int], typecode: str = "Q") -> bytes:
    """Pack integers as little-endian fixed-width values (8 bytes each for block hashes)."""
    packed = array(typecode, hashes)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def unpack_hashes(data: bytes, typecode: str = "Q") -> array[int]:
    """Inverse of pack_hashes."""
    unpacked = array(typecode)
    try:
        unpacked.frombytes(data)
    except (ValueError, TypeError) as exc:
        raise CodecError(f"bad packed array: {exc}") from exc
    if _BIG_ENDIAN:
        unpacked.byteswap()
    return unpacked


def encode_batch(changes: Sequence[Change]) -> bytes:
    """One stream entry's payload: a msgpack list of positional records."""
    items: list[list[object]] = []
    for change in changes:
        if isinstance(change, IndexChange):
            items.append(
                [
                    int(change.kind),
                    change.model,
                    pack_hashes(change.block_hashes),
                    change.replica_id,
                ]
            )
        else:
            items.append([int(change.kind), change.replica_id, change.url, list(change.models)])
    return msgpack.packb(items, use_bin_type=True)  # type: ignore[no-any-return]


def decode_batch(data: bytes, origin: str) -> list[Change]:
    """Decode one stream entry's payload, stamping every record with the publisher's id."""
    try:
        items = msgpack.unpackb(data, raw=False)
        out: list[Change] = []
        for item in items:
            code = item[0]
            if code in _INDEX_KINDS:
                out.append(
                    IndexChange(
                        kind=_INDEX_KINDS[code],
                        model=str(item[1]),
                        block_hashes=tuple(unpack_hashes(item[2])),
                        replica_id=str(item[3]),
                        origin=origin,
                    )
                )
            elif code in _REGISTRY_KINDS:
                out.append(
                    RegistryChange(
                        kind=_REGISTRY_KINDS[code],
                        replica_id=str(item[1]),
                        url=str(item[2]),
                        models=tuple(str(m) for m in item[3]),
                        origin=origin,
                    )
                )
            else:
                raise CodecError(f"unknown change kind {code!r}")
        return out
    except CodecError:
        raise
    except (ValueError, TypeError, IndexError, KeyError, msgpack.ExtraData) as exc:
        raise CodecError(f"undecodable change batch: {exc}") from exc

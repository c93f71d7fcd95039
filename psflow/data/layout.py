"""Decoding a batch of ``tf.train.Example`` records that share one layout, a few numpy calls each.

Records written for one parsing spec nearly always have the same features in the same wire
order, each with the same list kind: only lengths and values differ. This decoder learns that
layout (the sequence of feature keys) from one record in Python, then walks every record of the
batch along it at once: each step (a tag byte, a length, a key, a payload) is one numpy operation
over all records, whatever their varint lengths, so Python runs a fixed number of steps per
feature and none per record. The general walker in :mod:`psflow.data.fastparse` instead follows
each record's own field order, at several times the numpy calls.

Every byte the layout implies is checked: each tag, each key, each length against the end of
its enclosing message (exactly, so nothing is skipped or read past). A record that differs in
any way (another key order, a feature missing, an unknown field, an unpacked list, a list of
another kind, a varint over 5 bytes where a length is expected) is returned as "not decoded",
and the caller decodes it by the general path, which in turn hands what it cannot take to
protobuf. So a layout can only be a shortcut, never a different answer.
"""

from __future__ import annotations

import numpy as np

from psflow.data.fastparse import (
    BYTES,
    FLOAT,
    INT64,
    Column,
    decode_varints,
    empty_column,
    ragged_take,
    take_bytes,
)

_LIST_TAG = {BYTES: 0x0A, FLOAT: 0x12, INT64: 0x1A}  # Feature's oneof fields, length-delimited
MAX_LAYOUTS = 4
"""Layouts tried per batch (the first record's, then those of records it did not fit)."""


def _py_varint(raw: bytes, pos: int, end: int) -> tuple[int, int] | None:
    value = shift = 0
    while pos < end and shift < 35:
        b = raw[pos]
        value |= (b & 0x7F) << shift
        pos += 1
        if b < 0x80:
            return value, pos
        shift += 7
    return None


def learn(raw: bytes, start: int, end: int) -> list[bytes] | None:
    """The feature keys of one record in wire order, if it has the plain layout; else None.

    Plain: the record is one ``features`` field and nothing else, each map entry is a key then a
    value, each key occurs once. Values are not looked into here: the batch walk checks them.
    """
    keys: list[bytes] = []
    got = _py_varint(raw, start, end)
    if got is None or got[0] != 0x0A:
        return None
    got = _py_varint(raw, got[1], end)
    if got is None or got[0] + got[1] != end:
        return None
    pos = got[1]
    while pos < end:
        tag = _py_varint(raw, pos, end)
        size = tag and _py_varint(raw, tag[1], end)
        if not tag or not size or tag[0] != 0x0A:
            return None
        entry_end = size[1] + size[0]
        ktag = _py_varint(raw, size[1], entry_end)
        klen = ktag and _py_varint(raw, ktag[1], entry_end)
        if not ktag or not klen or ktag[0] != 0x0A:
            return None
        key_end = klen[1] + klen[0]
        vtag = _py_varint(raw, key_end, entry_end)
        vlen = vtag and _py_varint(raw, vtag[1], entry_end)
        if not vtag or not vlen or vtag[0] != 0x12 or vlen[1] + vlen[0] != entry_end:
            return None
        keys.append(raw[klen[1] : key_end])
        pos = entry_end
    if pos != end or len(set(keys)) != len(keys):
        return None
    try:
        [k.decode() for k in keys]
    except UnicodeDecodeError:  # protobuf rejects such a record: leave it to the general path
        return None
    return keys


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        out.append(b | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _varint(arr: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A length varint at each position (any shape): (value, position after it, ok).

    At most 5 bytes, as protobuf's lengths are below 2 GiB. Positions are clamped to the buffer:
    a record that has left the layout may point anywhere, and its ``ok`` is already False.
    """
    last = len(arr) - 1
    b = arr[np.minimum(pos, last)]
    more = b >= 0x80
    if not more.any():  # lengths below 128: one byte
        return b.astype(np.int64), pos + 1, np.ones(pos.shape, dtype=bool)
    value = (b & 0x7F).astype(np.int64)
    size = np.ones(pos.shape, dtype=np.int64)
    for k in range(1, 5):
        b = arr[np.minimum(pos + k, last)]
        value += np.where(more, (b & 0x7F).astype(np.int64) << (7 * k), 0)
        size += more
        more &= b >= 0x80
        if not more.any():
            break
    return value, pos + size, ~more


def _byte_is(arr: np.ndarray, pos: np.ndarray, value: int | np.ndarray) -> np.ndarray:
    return arr[np.minimum(pos, len(arr) - 1)] == value


def _starts_with(raw: bytes, arr: np.ndarray, pos: np.ndarray, heads: list[bytes]) -> np.ndarray:
    """Per record (column of ``pos``): whether the bytes at ``pos[k]`` start with ``heads[k]``.

    Compared 8 bytes at a time through an unaligned uint64 view of the buffer.
    """
    width = max(map(len, heads), default=0)
    ok = np.ones(pos.shape[1], dtype=bool)
    if not width:
        return ok
    if len(arr) < 8:  # no record with a feature is that short (the smallest takes 8 bytes)
        return ~ok
    words = np.ndarray((len(arr) - 7,), dtype="<u8", buffer=raw, strides=(1,))
    lengths = np.asarray([len(h) for h in heads], dtype=np.int64)[:, None]
    ok &= (pos + lengths <= len(arr)).all(axis=0)
    for off in range(0, width, 8):
        chunk = [h[off : off + 8] for h in heads]
        want = np.asarray([int.from_bytes(c.ljust(8, b"\0"), "little") for c in chunk], "<u8")
        mask = np.asarray([(1 << (8 * len(c))) - 1 for c in chunk], dtype="<u8")
        at = pos + off
        # Near the end of the buffer the word is read from up to 7 bytes earlier and shifted.
        word_at = np.minimum(at, len(words) - 1)
        shift = (np.minimum(at - word_at, 7) * 8).astype(np.uint64)
        got = words[word_at] >> shift
        ok &= (((got ^ want[:, None]) & mask[:, None]) == 0).all(axis=0)
    return ok


def decode(
    raw: bytes,
    arr: np.ndarray,
    rows: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    names: dict[str, int],
    keys: list[bytes],
) -> tuple[np.ndarray, dict[str, Column]]:
    """Decodes the records ``rows`` (ascending; ``starts``/``ends`` theirs) along layout ``keys``.

    Returns (mask over ``rows`` of those decoded, their columns with rids taken from ``rows``).
    A feature of ``names`` that the layout lacks comes out with no rows.
    """
    n, k_all = len(rows), len(keys)
    # Example: one `features` field spanning the record.
    ok = _byte_is(arr, starts, 0x0A)
    size, pos, good = _varint(arr, starts + 1)
    ok &= good & (pos + size == ends)
    # The map entries, one after another: the only step that goes entry by entry.
    entry = np.empty((k_all, n), dtype=np.int64)
    entry_end = np.empty((k_all, n), dtype=np.int64)
    for k in range(k_all):
        ok &= _byte_is(arr, pos, 0x0A)
        size, entry[k], good = _varint(arr, pos + 1)
        ok &= good
        pos = entry_end[k] = entry[k] + size
    ok &= pos == ends
    # Inside the entries, all at once: key field, then the value field spanning the rest.
    heads = [b"\x0a" + _encode_varint(len(key)) + key + b"\x12" for key in keys]
    ok &= _starts_with(raw, arr, entry, heads)
    head_len = np.asarray([len(h) for h in heads], dtype=np.int64)[:, None]
    size, value, good = _varint(arr, entry + head_len)
    ok &= (good & (value + size == entry_end)).all(axis=0)
    # Wanted features: the list kind's field spanning the value.
    wanted = [k for k, key in enumerate(keys) if key.decode() in names]
    kinds = [names[keys[k].decode()] for k in wanted]
    ok &= _byte_is(arr, value[wanted], np.asarray([_LIST_TAG[w] for w in kinds])[:, None]).all(
        axis=0
    )
    size, lists, good = _varint(arr, value[wanted] + 1)
    list_end = lists + size
    ok &= (good & (list_end == entry_end[wanted])).all(axis=0)
    found: dict[str, tuple[int, np.ndarray, np.ndarray, np.ndarray | None]] = {}
    numeric = [j for j, w in enumerate(kinds) if w != BYTES]
    if numeric:
        # Packed: one field 1 spanning the list; an empty list has no field at all (so the
        # reads below see the next feature there, and `empty` overrides what they find).
        at, stop = lists[numeric], list_end[numeric]
        empty = at == stop
        size, payload, good = _varint(arr, at + 1)
        ok &= (empty | (_byte_is(arr, at, 0x0A) & good & (payload + size == stop))).all(axis=0)
        start = np.where(empty, stop, payload)
        size = stop - start
        for row, j in enumerate(numeric):
            if kinds[j] == FLOAT:
                ok &= size[row] % 4 == 0
            else:  # the last byte must end a varint, or one would run into the next list
                ok &= empty[row] | (arr[np.clip(stop[row] - 1, 0, len(arr) - 1)] < 0x80)
            found[keys[wanted[j]].decode()] = (kinds[j], start[row], size[row], None)
    for j, w in enumerate(kinds):
        if w == BYTES:
            owner, start, size = _bytes_values(arr, lists[j], list_end[j], ok)
            found[keys[wanted[j]].decode()] = (w, start, size, owner)
    while True:
        columns, misfits = _columns(raw, arr, rows, ok, names, found)
        if not len(misfits):
            return ok, columns
        ok = ok.copy()
        ok[np.searchsorted(rows, misfits)] = False


def _bytes_values(
    arr: np.ndarray, pos: np.ndarray, list_end: np.ndarray, ok: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Walks one BytesList per record: (record of each value, value start, value length).

    Records where the list does not parse get ``ok`` False.
    """
    r_parts, s_parts, n_parts = [], [], []
    active = np.flatnonzero(ok & (pos < list_end))
    pos = pos[active]
    while len(active):
        size, start, good = _varint(arr, pos + 1)
        after = start + size
        good &= _byte_is(arr, pos, 0x0A) & (after <= list_end[active])
        ok[active[~good]] = False
        r_parts.append(active[good])
        s_parts.append(start[good])
        n_parts.append(size[good])
        more = good & (after < list_end[active])
        active, pos = active[more], after[more]
    if not r_parts:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    if len(r_parts) == 1:
        return r_parts[0], s_parts[0], n_parts[0]
    r = np.concatenate(r_parts)
    order = np.argsort(r, kind="stable")
    return r[order], np.concatenate(s_parts)[order], np.concatenate(n_parts)[order]


def _columns(
    raw: bytes,
    arr: np.ndarray,
    rows: np.ndarray,
    ok: np.ndarray,
    names: dict[str, int],
    lists: dict[str, tuple[int, np.ndarray, np.ndarray, np.ndarray | None]],
) -> tuple[dict[str, Column], np.ndarray]:
    """Columns of the rows ``ok``; else the rids of rows whose lists turned out malformed."""
    all_ok = bool(ok.all())
    keep = np.flatnonzero(ok)
    rid = rows if all_ok else rows[keep]
    m = len(rid)
    columns: dict[str, Column] = {}
    for name, want in names.items():
        values: np.ndarray | list[bytes]
        if name not in lists:
            columns[name] = empty_column(want)
            continue
        _, start, size, owner = lists[name]
        kind = np.full(m, want, dtype=np.int8)
        if owner is not None:  # BYTES: one entry per value, `owner` its row
            if not all_ok:
                sel = ok[owner]
                owner, start, size = np.searchsorted(keep, owner[sel]), start[sel], size[sel]
            counts = np.bincount(owner, minlength=m)
            values = take_bytes(raw, start, size)
            columns[name] = Column(rid, kind, counts, values)
            continue
        if not all_ok:
            start, size = start[keep], size[keep]
        payload = ragged_take(raw, arr, start, size)
        if want == FLOAT:
            counts = size // 4
            values = np.ascontiguousarray(payload).view("<f4").astype(np.float32, copy=False)
        else:
            values, last, sizes = decode_varints(payload)
            list_end = np.cumsum(size) - 1
            if (sizes > 10).any():  # protobuf rejects these: let it say so
                return columns, rid[np.searchsorted(list_end, last[sizes > 10])]
            counts = np.diff(np.searchsorted(last, list_end, side="right"), prepend=0)
        columns[name] = Column(rid, kind, counts, values)
    return columns, np.zeros(0, dtype=np.int64)

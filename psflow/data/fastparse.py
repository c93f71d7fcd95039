"""Vectorized decoding of serialized ``tf.train.Example`` batches straight from the wire format.

Decoding one protobuf message per record in Python costs microseconds per feature. Here a whole
batch is decoded at once: every step of the wire-format walk (read a tag, read a length, skip a
field) is one numpy operation over all records of the batch, so Python runs once per *field
position*, not once per record. Values land in flat numpy arrays with per-record counts
(:class:`Column`), which :mod:`psflow.data.features` turns into dense, padded or ragged output.

A record this walker does not expect (unpacked repeated values, a feature given twice, several
``features`` fields, groups) or cannot decode is handed back in ``Decoded.irregular``; the caller
decodes those through protobuf, which is also the reference the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BYTES, FLOAT, INT64 = 1, 2, 3  # Feature's oneof field numbers, as in feature.proto


@dataclass
class Column:
    """The values of one feature across a batch, for records that have it.

    Attributes:
        rid: ascending record numbers (0-based in the batch) that have the feature.
        kind: the list kind per record (0: a Feature with no list set, else BYTES/FLOAT/INT64).
        counts: number of values per record.
        values: all values in record order: a numpy array, or a list of bytes for BYTES.
    """

    rid: np.ndarray
    kind: np.ndarray
    counts: np.ndarray
    values: np.ndarray | list[bytes]


@dataclass
class Decoded:
    columns: dict[str, Column]
    irregular: np.ndarray  # record numbers to decode by the protobuf path instead


def _varint(
    arr: np.ndarray, pos: np.ndarray, end: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decodes one varint at each position; returns (value, position after it, ok)."""
    last = len(arr) - 1
    if len(pos) and pos.max() > last:
        pos = np.minimum(pos, last)  # past the buffer: `ok` comes out False below
    b = arr[pos]
    more = b >= 0x80
    if not more.any():  # tags and short lengths: one byte each, the common case
        after = pos + 1
        return b.astype(np.uint64), after, after <= end
    val = (b & 0x7F).astype(np.uint64)
    size = np.ones(len(pos), dtype=np.int64)
    ok = np.ones(len(pos), dtype=bool)
    idx = np.flatnonzero(more)
    k = 1
    while len(idx):
        if k == 10:
            ok[idx] = False
            break
        b = arr[np.minimum(pos[idx] + k, last)]
        val[idx] |= (b & 0x7F).astype(np.uint64) << np.uint64(7 * k)
        size[idx] += 1
        idx = idx[b >= 0x80]
        k += 1
    after = pos + size
    ok &= after <= end
    return val, after, ok


def _next_field(
    arr: np.ndarray, pos: np.ndarray, end: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Reads the field at each position: (field number, wire type, payload start, end, ok).

    Only length-delimited fields (wire type 2) have a payload; for the others payload start ==
    end == the next field.
    """
    tag, p, ok = _varint(arr, pos, end)
    wt = (tag & np.uint64(7)).astype(np.int64)
    field = (tag >> np.uint64(3)).astype(np.int64)
    pstart = p.copy()
    ld = np.flatnonzero(wt == 2)
    if len(ld):
        ln, after, ok2 = _varint(arr, p[ld], end[ld])
        ok2 &= ln <= np.uint64(1 << 40)
        pstart[ld] = after
        ok[ld] &= ok2
    pend = pstart.copy()
    if len(ld):
        pend[ld] += np.where(ok2, ln, 0).astype(np.int64)
    vi = np.flatnonzero(wt == 0)
    if len(vi):
        _, after, ok0 = _varint(arr, p[vi], end[vi])
        pstart[vi] = pend[vi] = after
        ok[vi] &= ok0
    pend[wt == 1] += 8
    pend[wt == 5] += 4
    fixed = (wt == 1) | (wt == 5)
    pstart[fixed] = pend[fixed]
    ok &= (wt != 3) & (wt != 4) & (wt <= 5) & (field > 0) & (pend <= end)
    return field, wt, pstart, pend, ok


def _fields(
    arr: np.ndarray,
    rid: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    want: tuple[int, ...],
    bad: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every length-delimited field numbered in ``want`` inside the regions, in wire order.

    Returns (rid, field, start, end) sorted by rid, wire order kept within one rid. Regions that
    do not parse, or that hold a wanted field number with another wire type, set ``bad[rid]``;
    other fields are skipped as protobuf skips unknown fields.
    """
    out_r, out_f, out_s, out_e = [], [], [], []
    pos = start.copy()
    active = np.flatnonzero(pos < end)
    while len(active):
        r, p, e = rid[active], pos[active], end[active]
        field, wt, ps, pe, ok = _next_field(arr, p, e)
        wanted = field == want[0]
        for w in want[1:]:
            wanted |= field == w
        ok &= ~wanted | (wt == 2)
        bad[r[~ok]] = True
        take = np.flatnonzero(ok & wanted)
        if len(take):
            out_r.append(r[take])
            out_f.append(field[take])
            out_s.append(ps[take])
            out_e.append(pe[take])
        pos[active] = np.where(ok, pe, e)
        active = active[ok & (pe < e)]
    if not out_r:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, z
    r = np.concatenate(out_r)
    order = np.argsort(r, kind="stable")
    return (
        r[order],
        np.concatenate(out_f)[order],
        np.concatenate(out_s)[order],
        np.concatenate(out_e)[order],
    )


def _repeats(rid: np.ndarray) -> np.ndarray:
    """The rids that occur more than once in a sorted array."""
    return rid[1:][rid[1:] == rid[:-1]]


def ragged_take(raw: bytes, arr: np.ndarray, start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """``concatenate([arr[s : s + n] for s, n in zip(start, length)])``, as uint8."""
    if not len(start) or not length.any():
        return arr[:0]
    total = int(length.sum())
    width = int(length.max())
    if int(start.max()) + width <= len(arr) and width * len(start) <= 2 * total:
        # Rows of `width` bytes, gathered as one opaque item each from an overlapping view of
        # the buffer (a memcpy per row, no Python loop); rows longer than their list are
        # trimmed by a mask when lengths differ.
        items = np.ndarray(
            (len(arr) - width + 1,), dtype=np.dtype((np.void, width)), buffer=raw, strides=(1,)
        )
        rows = items[start].view(np.uint8).reshape(len(start), width)
        if (length == width).all():
            return rows.reshape(-1)
        return rows[np.arange(width) < length[:, None]]
    if total <= 64 * len(start):
        # Short lists: an index array is cheaper than one Python slice per record.
        offsets = np.cumsum(length) - length
        return arr[np.repeat(start - offsets, length) + np.arange(total, dtype=np.int64)]
    # Slicing bytes is a memcpy; an index array would cost 8 bytes per byte moved.
    slices = map(slice, start.tolist(), (start + length).tolist())
    return np.frombuffer(b"".join(map(raw.__getitem__, slices)), dtype=np.uint8)


def take_bytes(raw: bytes, start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """``raw[s : s + n]`` for each pair, as a numpy object array of ``bytes``.

    When every value has one length (fixed-size ids, hashes, names), the values are gathered as
    opaque items and turned into ``bytes`` by numpy's C loop, several times faster than slicing.
    """
    out: np.ndarray
    width = int(length[0]) if len(length) else 0
    if width and (length == width).all() and int(start.max()) + width <= len(raw):
        items = np.ndarray(
            (len(raw) - width + 1,), dtype=np.dtype((np.void, width)), buffer=raw, strides=(1,)
        )
        out = items[start].astype(object)
        return out
    out = np.empty(len(start), dtype=object)
    out[:] = list(map(raw.__getitem__, map(slice, start.tolist(), (start + length).tolist())))
    return out


def decode_varints(payload: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decodes concatenated varints: (values as int64, index of each one's last byte, sizes)."""
    ends = np.flatnonzero(payload < 0x80)
    if not len(ends):
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    sizes = ends - starts + 1
    longest = int(sizes.max())
    # 32-bit arithmetic while it holds (values below 2**28), at half the memory traffic.
    wide = np.dtype(np.uint64 if longest > 4 else np.uint32)
    values: np.ndarray = (payload[starts] & 0x7F).astype(wide)
    last = len(payload) - 1
    # One pass per byte position (3 for values below 2**21), each over all varints at once;
    # bits past the 64th are dropped, as protobuf drops them.
    for k in range(1, min(longest, 10)):
        b = payload[np.minimum(starts + k, last)] & np.uint8(0x7F)
        b[sizes <= k] = 0
        values |= np.left_shift(b.astype(wide), np.asarray(7 * k, dtype=wide))
    return values.astype(np.uint64).view(np.int64), ends, sizes


def decode_batch(
    buffer: bytes | bytearray | memoryview,
    starts: np.ndarray,
    lengths: np.ndarray,
    names: dict[str, int],
) -> Decoded:
    """Decodes the features named in ``names`` (name -> expected kind) from a batch of records."""
    raw = buffer if isinstance(buffer, bytes) else bytes(buffer)
    arr = np.frombuffer(raw, dtype=np.uint8)
    n = len(starts)
    bad = np.zeros(n, dtype=bool)
    starts = np.asarray(starts, dtype=np.int64)
    ends = starts + np.asarray(lengths, dtype=np.int64)
    f_r, _, f_s, f_e = _fields(arr, np.arange(n, dtype=np.int64), starts, ends, (1,), bad)
    bad[_repeats(f_r)] = True  # several `features` fields merge: protobuf's job
    e_r, _, e_s, e_e = _fields(arr, f_r, f_s, f_e, (1,), bad)
    # Map entries: key (field 1) and value (field 2), in either order, each possibly absent.
    bad_e = np.zeros(len(e_r), dtype=bool)
    x_r, x_f, x_s, x_e = _fields(arr, np.arange(len(e_r)), e_s, e_e, (1, 2), bad_e)
    key_s = np.zeros(len(e_r), dtype=np.int64)
    key_n = np.zeros(len(e_r), dtype=np.int64)
    val_s = np.zeros(len(e_r), dtype=np.int64)
    val_e = np.zeros(len(e_r), dtype=np.int64)
    for f, (s_arr, n_arr) in ((1, (key_s, key_n)), (2, (val_s, val_e))):
        sel = x_f == f
        r = x_r[sel]
        bad_e[_repeats(r)] = True
        s_arr[r] = x_s[sel]
        n_arr[r] = x_e[sel] - x_s[sel] if f == 1 else x_e[sel]
    bad[e_r[bad_e]] = True

    columns: dict[str, Column] = {}
    for name, want in names.items():
        key = np.frombuffer(name.encode(), dtype=np.uint8)
        ent = np.flatnonzero(key_n == len(key))
        if len(ent) and len(key):
            ent = ent[(arr[key_s[ent, None] + np.arange(len(key))] == key).all(axis=1)]
        rid = e_r[ent]  # sorted, since e_r is
        bad[_repeats(rid)] = True
        columns[name] = _decode_features(raw, arr, rid, val_s[ent], val_e[ent], want, bad)
    return Decoded(columns, np.flatnonzero(bad))


def _decode_features(
    raw: bytes,
    arr: np.ndarray,
    rid: np.ndarray,
    vs: np.ndarray,
    ve: np.ndarray,
    want: int,
    bad: np.ndarray,
) -> Column:
    m = len(rid)
    bad_m = np.zeros(m, dtype=bool)
    r, f, s, e = _fields(arr, np.arange(m, dtype=np.int64), vs, ve, (BYTES, FLOAT, INT64), bad_m)
    bad_m[_repeats(r)] = True  # oneof given twice: the last wins; rare, so protobuf decides
    kind = np.zeros(m, dtype=np.int8)
    ls = np.zeros(m, dtype=np.int64)
    le = np.zeros(m, dtype=np.int64)
    kind[r], ls[r], le[r] = f, s, e
    counts = np.zeros(m, dtype=np.int64)
    sel = np.flatnonzero(kind == want)
    values: np.ndarray | list[bytes]
    if want == BYTES:
        vr, _, vs2, ve2 = _fields(arr, sel, ls[sel], le[sel], (1,), bad_m)
        counts[:] = np.bincount(vr, minlength=m)
        values = take_bytes(raw, vs2, ve2 - vs2)
    else:
        # Packed encoding (what every protobuf writer emits): one field 1 spanning the list.
        nonempty = sel[le[sel] > ls[sel]]
        field, wt, ps, pe, ok = _next_field(arr, ls[nonempty], le[nonempty])
        packed = ok & (field == 1) & (wt == 2) & (pe == le[nonempty])
        if want == FLOAT:
            packed &= (pe - ps) % 4 == 0
        else:
            # the last byte of a list must end a varint, or one would run into the next list
            packed &= (pe == ps) | (arr[np.clip(pe - 1, 0, len(arr) - 1)] < 0x80)
        bad_m[nonempty[~packed]] = True
        use = nonempty[packed]
        ps, pe = ps[packed], pe[packed]
        payload = ragged_take(raw, arr, ps, pe - ps)
        if want == FLOAT:
            counts[use] = (pe - ps) // 4
            values = np.ascontiguousarray(payload).view("<f4").astype(np.float32, copy=False)
        else:
            values, last, sizes = decode_varints(payload)
            list_end = np.cumsum(pe - ps) - 1
            counts[use] = np.diff(np.searchsorted(last, list_end, side="right"), prepend=0)
            if (sizes > 10).any():
                owner = np.searchsorted(list_end, last[sizes > 10])
                bad_m[use[owner]] = True
    bad[rid[bad_m]] = True
    return Column(rid, kind, counts, values)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])``, without the loop."""
    total = int(counts.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    before = np.cumsum(counts) - counts
    return np.repeat(starts - before, counts) + np.arange(total, dtype=np.int64)


def _objects(values: np.ndarray | list[bytes]) -> np.ndarray:
    """Bytes values as an object array (``np.asarray`` would make fixed-width strings)."""
    if isinstance(values, np.ndarray):
        return values
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _values_at(values: np.ndarray | list[bytes], idx: np.ndarray) -> np.ndarray | list[bytes]:
    if isinstance(values, list):
        return [values[j] for j in idx.tolist()]
    return values[idx]


def select(col: Column, mask: np.ndarray, rid: np.ndarray | None = None) -> Column:
    """The rows of ``col`` where ``mask`` (one flag per row of the column), rids mapped by ``rid``.

    ``rid`` maps the column's rids to others (``rid[col.rid]``), e.g. from a subset of a batch
    back to the batch.
    """
    new_rid = col.rid if rid is None else rid[col.rid]
    if mask.all():
        return Column(new_rid, col.kind, col.counts, col.values)
    offsets = np.cumsum(col.counts) - col.counts
    idx = _ranges(offsets[mask], col.counts[mask])
    return Column(new_rid[mask], col.kind[mask], col.counts[mask], _values_at(col.values, idx))


def empty_column(kind: int) -> Column:
    """A column with no rows, for a feature of list kind ``kind``."""
    z = np.zeros(0, dtype=np.int64)
    values = np.zeros(
        0, dtype=object if kind == BYTES else np.float32 if kind == FLOAT else z.dtype
    )
    return Column(z, z.astype(np.int8), z, values)


def merge(cols: list[Column]) -> Column:
    """Columns over disjoint rows, merged into one in row order."""
    nonempty = [c for c in cols if len(c.rid)]
    if len(nonempty) <= 1:
        return nonempty[0] if nonempty else cols[0]
    rid = np.concatenate([c.rid for c in nonempty])
    order = np.argsort(rid, kind="stable")
    counts = np.concatenate([c.counts for c in nonempty])
    offsets = np.cumsum(counts) - counts
    idx = _ranges(offsets[order], counts[order])
    if any(isinstance(c.values, list) or c.values.dtype == object for c in nonempty):
        values = np.concatenate([_objects(c.values) for c in nonempty])[idx]
    else:
        values = np.concatenate([np.asarray(c.values) for c in nonempty])[idx]
    kind = np.concatenate([c.kind for c in nonempty])[order]
    return Column(rid[order], kind, counts[order], values)

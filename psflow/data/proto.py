"""``tf.train.Example`` and ``SequenceExample`` as protobuf classes, with no protoc step.

The descriptor is built here from ``descriptor_pb2`` so that it works with every protobuf runtime
from 4.21 on (generated ``_pb2`` modules are tied to the protoc version that wrote them). It lives
in a private descriptor pool: TensorFlow registers ``tensorflow.Example`` in the default pool, and
a second registration there would clash when both libraries are imported in one process.
``example.proto`` beside this file is the source of truth, with TensorFlow's field numbers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "tensorflow"

_F = descriptor_pb2.FieldDescriptorProto


def _field(
    name: str, number: int, ftype: int, *, repeated: bool = False, type_name: str = ""
) -> _F:
    field = _F(
        name=name,
        number=number,
        type=ftype,  # type: ignore[arg-type]
        label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL,
    )
    if type_name:
        field.type_name = f".{PACKAGE}.{type_name}"
    return field


def _map_entry(name: str, value_type: str) -> descriptor_pb2.DescriptorProto:
    entry = descriptor_pb2.DescriptorProto(name=name)
    entry.options.map_entry = True
    entry.field.append(_field("key", 1, _F.TYPE_STRING))
    entry.field.append(_field("value", 2, _F.TYPE_MESSAGE, type_name=value_type))
    return entry


def file_descriptor_proto() -> descriptor_pb2.FileDescriptorProto:
    """The descriptor of ``example.proto``, built in Python."""
    fd = descriptor_pb2.FileDescriptorProto(
        name="psflow/data/example.proto", package=PACKAGE, syntax="proto3"
    )
    for name, ftype in (
        ("BytesList", _F.TYPE_BYTES),
        ("FloatList", _F.TYPE_FLOAT),
        ("Int64List", _F.TYPE_INT64),
    ):
        msg = fd.message_type.add(name=name)
        value = _field("value", 1, ftype, repeated=True)
        if ftype != _F.TYPE_BYTES:
            value.options.packed = True
        msg.field.append(value)

    feature = fd.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for number, kind in enumerate(("BytesList", "FloatList", "Int64List"), start=1):
        lower = {"BytesList": "bytes_list", "FloatList": "float_list", "Int64List": "int64_list"}
        f = _field(lower[kind], number, _F.TYPE_MESSAGE, type_name=kind)
        f.oneof_index = 0
        feature.field.append(f)

    features = fd.message_type.add(name="Features")
    features.nested_type.append(_map_entry("FeatureEntry", "Feature"))
    features.field.append(
        _field("feature", 1, _F.TYPE_MESSAGE, repeated=True, type_name="Features.FeatureEntry")
    )
    feature_list = fd.message_type.add(name="FeatureList")
    feature_list.field.append(
        _field("feature", 1, _F.TYPE_MESSAGE, repeated=True, type_name="Feature")
    )
    feature_lists = fd.message_type.add(name="FeatureLists")
    feature_lists.nested_type.append(_map_entry("FeatureListEntry", "FeatureList"))
    feature_lists.field.append(
        _field(
            "feature_list",
            1,
            _F.TYPE_MESSAGE,
            repeated=True,
            type_name="FeatureLists.FeatureListEntry",
        )
    )
    example = fd.message_type.add(name="Example")
    example.field.append(_field("features", 1, _F.TYPE_MESSAGE, type_name="Features"))
    seq = fd.message_type.add(name="SequenceExample")
    seq.field.append(_field("context", 1, _F.TYPE_MESSAGE, type_name="Features"))
    seq.field.append(_field("feature_lists", 2, _F.TYPE_MESSAGE, type_name="FeatureLists"))
    return fd


POOL = descriptor_pool.DescriptorPool()
POOL.Add(file_descriptor_proto())


def _message_class(name: str) -> Any:
    descriptor = POOL.FindMessageTypeByName(f"{PACKAGE}.{name}")
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(POOL).GetPrototype(descriptor)  # type: ignore[attr-defined]


BytesList: Any = _message_class("BytesList")
FloatList: Any = _message_class("FloatList")
Int64List: Any = _message_class("Int64List")
Feature: Any = _message_class("Feature")
Features: Any = _message_class("Features")
FeatureList: Any = _message_class("FeatureList")
FeatureLists: Any = _message_class("FeatureLists")
Example: Any = _message_class("Example")
SequenceExample: Any = _message_class("SequenceExample")

FeatureValue = Any
"""What :func:`make_feature` accepts: a scalar, a sequence or numpy array, or a ``Feature``."""


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_unique_names(names: list[str], *, where: str = "", rename: str = "") -> None:
    """Refuses a column name given more than once: an Example holds one feature of a name
    (the columns were merged, or the last kept). ``where`` goes before the message, ``rename``
    says how to rename them."""
    for name in names:
        if names.count(name) > 1:
            raise ValueError(
                f"{where}column {name!r} appears {names.count(name)} times; an Example holds "
                f"one feature of a name (rename the columns{rename})"
            )


def check_float32(values: np.ndarray, what: str) -> np.ndarray:
    """``values`` as float32, refusing a finite value that float32 cannot hold (it would be inf).

    Rounding to float32's precision is what a ``float_list`` does and is not refused; ``inf`` and
    ``nan`` stay as they are. ``what`` names the feature or column in the error.
    """
    wide = np.asarray(values)
    with np.errstate(over="ignore", invalid="ignore"):
        narrow = wide.astype(np.float32)
    bad = np.isinf(narrow) & np.isfinite(wide)
    if bad.any():
        value = wide[bad].reshape(-1)[0]
        raise ValueError(
            f"{what}: value {float(value)!r} is beyond float32's range (±{_FLOAT32_MAX:.7g}), which "
            "is what a float_list holds; it would be stored as inf (scale it, or store it as bytes)"
        )
    return narrow


def check_int64(values: np.ndarray, what: str) -> np.ndarray:
    """Integer ``values`` as int64, refusing unsigned ones of 2**63 and above (they would wrap)."""
    arr = np.asarray(values)
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size:
        big = arr >= np.uint64(1 << 63)
        if big.any():
            raise ValueError(
                f"{what}: value {int(arr[big].reshape(-1)[0])} does not fit an int64 "
                "(an int64_list holds -2**63 .. 2**63-1)"
            )
    return arr.astype(np.int64)


def int64_feature(values: Iterable[int] | int) -> Any:
    """A ``Feature`` holding an ``int64_list`` (also the way to write an empty int list)."""
    vals = [values] if isinstance(values, int | np.integer) else values
    return Feature(int64_list=Int64List(value=[int(v) for v in vals]))


def float_feature(values: Iterable[float] | float, *, name: str = "?") -> Any:
    """A ``Feature`` holding a ``float_list`` (float32 on the wire, as in TensorFlow).

    A finite value beyond float32's range raises ``ValueError`` (it would become inf).
    """
    vals = [values] if isinstance(values, float | int | np.floating) else values
    floats = [float(v) for v in vals]
    check_float32(np.asarray(floats, dtype=np.float64), f"feature {name!r}")
    return Feature(float_list=FloatList(value=floats))


def bytes_feature(values: Iterable[bytes | str] | bytes | str) -> Any:
    """A ``Feature`` holding a ``bytes_list``; ``str`` values are encoded as UTF-8."""
    vals = [values] if isinstance(values, bytes | str) else values
    return Feature(
        bytes_list=BytesList(value=[v.encode() if isinstance(v, str) else bytes(v) for v in vals])
    )


def make_feature(value: FeatureValue, *, name: str = "?") -> Any:
    """Converts a Python or numpy value to a ``Feature``, choosing the list kind by type.

    ints and bools go to ``int64_list``, floats to ``float_list``, ``bytes``/``str`` to
    ``bytes_list``. An empty sequence has no type: pass a ``Feature`` (e.g. ``float_feature([])``)
    or an empty numpy array with a dtype.
    """
    if isinstance(value, Feature):
        return value
    if isinstance(value, bytes | str):
        return bytes_feature(value)
    if isinstance(value, bool | int | np.integer | np.bool_):
        return int64_feature([int(value)])
    if isinstance(value, float | np.floating):
        return float_feature([float(value)], name=name)
    if isinstance(value, np.ndarray):
        flat = value.reshape(-1)
        if flat.dtype.kind in "iub":
            return int64_feature(check_int64(flat, f"feature {name!r}").tolist())
        if flat.dtype.kind == "f":
            return float_feature(check_float32(flat, f"feature {name!r}").tolist(), name=name)
        if flat.dtype.kind in "SOU":
            return bytes_feature(flat.tolist())
        raise TypeError(f"feature {name!r}: cannot store numpy dtype {value.dtype}")
    if isinstance(value, Sequence):
        items = list(value)
        if not items:
            raise TypeError(
                f"feature {name!r}: an empty list has no type; pass int64_feature([]), "
                "float_feature([]) or bytes_feature([])"
            )
        if all(isinstance(v, bytes | str) for v in items):
            return bytes_feature(items)
        if all(isinstance(v, bool | int | np.integer) for v in items):
            return int64_feature(items)
        if all(isinstance(v, float | int | np.floating | np.integer) for v in items):
            for v in items:  # a mixed list is a float list: its ints must survive float32
                if isinstance(v, int | np.integer) and (
                    abs(int(v)) > _FLOAT32_MAX or int(np.float32(int(v))) != int(v)
                ):
                    raise ValueError(
                        f"feature {name!r}: the int {int(v)} in a list with floats would be "
                        "stored as a float32, which does not hold it exactly; pass a list of "
                        "ints (int64_list), or floats float32 holds"
                    )
            return float_feature(items, name=name)
        raise TypeError(f"feature {name!r}: mixed or unsupported element types in {items[:5]!r}")
    raise TypeError(f"feature {name!r}: cannot store a value of type {type(value).__name__}")


def make_example(features: Mapping[str, FeatureValue]) -> Any:
    """Builds a ``tf.train.Example`` from a mapping of feature name to value.

    Example:
        >>> ex = make_example({"label": 3, "x": [0.5, 1.5], "name": b"abc"})
        >>> example_to_dict(Example.FromString(ex.SerializeToString()))["label"]
        array([3])
    """
    ex = Example()
    for key, value in features.items():
        ex.features.feature[key].CopyFrom(make_feature(value, name=key))
    return ex


def serialize_example(features: Mapping[str, FeatureValue]) -> bytes:
    """``make_example(features)`` serialized with map keys sorted, so equal input gives equal bytes."""
    return bytes(make_example(features).SerializeToString(deterministic=True))


def feature_to_value(feature: Any) -> np.ndarray | list[bytes]:
    """A ``Feature``'s values: int64 or float32 numpy array, or a list of ``bytes``."""
    kind = feature.WhichOneof("kind")
    if kind == "int64_list":
        return np.asarray(feature.int64_list.value, dtype=np.int64)
    if kind == "float_list":
        return np.asarray(feature.float_list.value, dtype=np.float32)
    if kind == "bytes_list":
        return list(feature.bytes_list.value)
    return []  # a Feature with no kind set: TensorFlow treats it as an empty list


def example_to_dict(example: Any | bytes) -> dict[str, np.ndarray | list[bytes]]:
    """Every feature of an ``Example`` (a message or its serialized bytes), by name."""
    if isinstance(example, bytes | bytearray | memoryview):
        example = Example.FromString(bytes(example))
    return {k: feature_to_value(v) for k, v in example.features.feature.items()}


def make_sequence_example(
    context: Mapping[str, FeatureValue], feature_lists: Mapping[str, Sequence[FeatureValue]]
) -> Any:
    """Builds a ``tf.train.SequenceExample``: context features and per-step feature lists."""
    seq = SequenceExample()
    for key, value in context.items():
        seq.context.feature[key].CopyFrom(make_feature(value, name=key))
    for key, steps in feature_lists.items():
        flist = seq.feature_lists.feature_list[key]
        for step in steps:
            flist.feature.add().CopyFrom(make_feature(step, name=key))
    return seq


def sequence_example_to_dict(
    seq: Any | bytes,
) -> tuple[dict[str, np.ndarray | list[bytes]], dict[str, list[np.ndarray | list[bytes]]]]:
    """A ``SequenceExample``'s (context, feature_lists), values as in :func:`example_to_dict`."""
    if isinstance(seq, bytes | bytearray | memoryview):
        seq = SequenceExample.FromString(bytes(seq))
    context = {k: feature_to_value(v) for k, v in seq.context.feature.items()}
    lists = {
        k: [feature_to_value(f) for f in v.feature]
        for k, v in seq.feature_lists.feature_list.items()
    }
    return context, lists

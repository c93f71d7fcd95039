"""Data: TFRecord files, ``tf.train.Example``, per-worker sharding, DataLoader, Spark.

No TensorFlow at run time. Where things live:

- ``tfrecord.py``: :class:`TFRecordReader`, :class:`TFRecordWriter`, :class:`RecordBatch`,
  :class:`DataLossError`, :func:`read_records`, :func:`write_records`, from their modules:
  ``tfrecord_reader.py`` (:class:`TFRecordReader`, :class:`RecordBatch`), ``tfrecord_writer.py``,
  ``tfrecord_framing.py`` (a record's framing, CRC32C, :class:`DataLossError`) and
  ``tfrecord_compression.py`` (GZIP/ZLIB)
- ``proto.py`` (+ ``example.proto``): :data:`Example`, :data:`SequenceExample`, :data:`Feature`
  and friends, built at run time with TensorFlow's field numbers; :func:`make_example`,
  :func:`serialize_example`, :func:`example_to_dict`, :func:`make_sequence_example`,
  :func:`sequence_example_to_dict`
- ``features.py``: :class:`FixedLenFeature`, :class:`VarLenFeature`, :class:`Ragged`,
  :func:`parse_examples` (fixed-length numeric batches in one C pass, ``native.py``; records
  sharing a layout decoded along it in ``layout.py``, the rest by the general vectorized wire
  decoder in ``fastparse.py``; protobuf as reference)
- ``encode.py``: :func:`serialize_examples` (many one-value-per-feature Examples at once, numpy)
- ``ctr.py``: the Criteo-layout click-through-rate set, from its modules: ``ctr_layout.py`` (the
  features, ``serialize_ctr``, hex ids, file names), ``synth_ctr.py`` (``SynthCTRConfig``/
  ``write_synth_ctr``: a synthetic set from a planted model, its best AUC known),
  ``ctr_reader.py`` (``ctr_batches``) and ``auc.py`` (``auc``/``expected_auc``)
- ``text.py``: text classification data: tab-separated (label, text) files to TFRecord shards
  of token ids with a vocabulary from the training split (:func:`~psflow.data.text.prepare_text`,
  ``psflow data text``), and their reader (:func:`~psflow.data.text.text_batches`)
- ``hashing.py``: TensorFlow's hashed ids: :func:`to_hash_bucket_fast` (FarmHash's
  ``Fingerprint64`` modulo the buckets, as ``tf.strings.to_hash_bucket_fast``),
  :func:`hash_bucket_of_ints` (``categorical_column_with_hash_bucket`` on int64),
  :func:`fingerprint64`
- ``native.py`` (+ ``_native.c`` binding ``_farmhash.c``, ``_example.c`` and ``_tfrecord.c``,
  optional): the hash, the plain-form Example parser, TFRecord's framing and checksums and the
  packing of records in C, no torch; Python where they were not built or ``PSFLOW_KERNELS=0``
- ``schema.py``: :func:`infer_schema`, :func:`format_schema`
- ``pipeline.py``: file/record sharding, interleave, rebatching, prefetch
- ``shuffle.py``: :func:`~psflow.data.shuffle.shuffle_batches`, tf.data's shuffle buffer a
  chunk at a time (references to records, not copies)
- ``dataset.py``: :class:`TFRecordDataset` (a torch ``IterableDataset``), :class:`DatasetConfig`
- ``fs.py``: :func:`expand_paths` (local paths, fsspec URLs, globs)
- ``kafka.py``: :class:`KafkaReader`, :class:`KafkaConfig`, :func:`merge_states`: a Kafka topic,
  each worker its share of the partitions, its position (each partition's next offset) saved
  and restored as plain data (confluent-kafka imported when a reader is made: ``psflow[kafka]``);
  from its modules: ``kafka_offsets.py`` (that position as plain data: checked, merged, the
  stops of a replay) and ``kafka_wait.py`` (waiting for a broker that went away)
- ``stream.py``: :class:`FileStreamReader`, :class:`FileStreamConfig`,
  :func:`merge_file_states`: a glob watched for TFRecord files that land while it is read, each
  file once, its position (files read, the record reached) saved and restored as plain data
- ``batches.py``: what the two stream readers share: :class:`~psflow.data.batches.ExampleStream`
  (the batches of a training loop) and a batch parsed with its bad records found
- ``spark.py``: :func:`write_dataframe`, :func:`read_dataframe` (pyspark imported lazily)
- ``convert.py``: :func:`convert_table` (CSV/Parquet to TFRecord, pyarrow imported lazily)
- ``cli.py``: ``psflow data inspect``, ``convert``, ``synth-ctr`` and ``text``

``dataset.py`` is the one module here that needs torch: it is imported when
:class:`TFRecordDataset` or :class:`DatasetConfig` is first used, so that reading and writing files
(``psflow data inspect`` among them) does not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psflow.data.encode import serialize_examples
from psflow.data.features import FixedLenFeature, Ragged, VarLenFeature, parse_examples
from psflow.data.fs import expand_paths
from psflow.data.hashing import fingerprint64, hash_bucket_of_ints, to_hash_bucket_fast
from psflow.data.kafka import BadRecordError, KafkaConfig, KafkaReader, merge_states
from psflow.data.proto import (
    Example,
    Feature,
    SequenceExample,
    bytes_feature,
    example_to_dict,
    float_feature,
    int64_feature,
    make_example,
    make_sequence_example,
    sequence_example_to_dict,
    serialize_example,
)
from psflow.data.schema import format_schema, infer_schema
from psflow.data.spark import read_dataframe, write_dataframe
from psflow.data.stream import FileStreamConfig, FileStreamReader, merge_file_states
from psflow.data.tfrecord import (
    DataLossError,
    RecordBatch,
    TFRecordReader,
    TFRecordWriter,
    read_records,
    write_records,
)

if TYPE_CHECKING:
    from psflow.data.dataset import DatasetConfig, TFRecordDataset

__all__ = [
    "BadRecordError",
    "DataLossError",
    "DatasetConfig",
    "Example",
    "Feature",
    "FileStreamConfig",
    "FileStreamReader",
    "FixedLenFeature",
    "KafkaConfig",
    "KafkaReader",
    "Ragged",
    "RecordBatch",
    "SequenceExample",
    "TFRecordDataset",
    "TFRecordReader",
    "TFRecordWriter",
    "VarLenFeature",
    "bytes_feature",
    "example_to_dict",
    "expand_paths",
    "fingerprint64",
    "float_feature",
    "format_schema",
    "hash_bucket_of_ints",
    "infer_schema",
    "int64_feature",
    "make_example",
    "make_sequence_example",
    "merge_file_states",
    "merge_states",
    "parse_examples",
    "read_dataframe",
    "read_records",
    "sequence_example_to_dict",
    "serialize_example",
    "serialize_examples",
    "to_hash_bucket_fast",
    "write_dataframe",
    "write_records",
]


def __getattr__(name: str) -> Any:
    if name in ("DatasetConfig", "TFRecordDataset"):
        from psflow.data import dataset

        value = getattr(dataset, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Data: TFRecord files, tf.train.Example, per-worker sharding, Spark."""

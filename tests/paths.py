"""Where the tests find the repository and the shared TensorFlow-written fixtures."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# CI clones the repository with ../shared beside it, as the developers' checkouts have it.
TFRECORD_FIXTURES = ROOT.parent / "shared" / "fixtures" / "tfrecord"

"""A Kafka reader's saved position read back (psflow.data.kafka_offsets): hostile states are
refused, naming the partition, and never read as another position."""

from __future__ import annotations

from typing import Any

import pytest

from psflow.data.kafka_offsets import checked_state

pytestmark = pytest.mark.unit


def _state(offsets: Any) -> dict[str, Any]:
    return {"source": "kafka", "topic": "t", "offsets": offsets}


def test_partitions_as_ints_or_their_digits() -> None:
    assert checked_state(_state({"3": 4, 5: 6}), "t") == {"topic": "t", "offsets": {3: 4, 5: 6}}


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        # int() takes these: '01' read as partition 1 again (the last one won, the records
        # between skipped), '1_0' as partition 10.
        ({"1": 5, "01": 9}, "partition '01' is not a number"),
        ({"1_0": 3}, "partition '1_0' is not a number"),
        ({" 1": 3}, "partition ' 1' is not a number"),
        ({"\u0661": 3}, "is not a number"),  # an Arabic-Indic one
        ({1: 5, "1": 6}, "partition 1 given twice"),
        ({True: 5}, "partition True is not a number"),
        ({"-1": 2}, "partition '-1' is not a number"),
        ({"2": -1}, "partition '2' offset -1 is invalid"),
    ],
)
def test_a_hostile_state_is_refused_naming_the_partition(offsets: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        checked_state(_state(offsets), "t")

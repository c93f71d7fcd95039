"""The fault matrix (issue 12, item 5), each scenario a real ``psflow launch`` job: the job
finishes with the right model at or past its last step, whichever task was killed or hung.

``python tests/fault_matrix.py`` runs the same scenarios and prints the table of times.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fault_matrix import SCENARIOS, TRAIN_STEPS, Scenario, run

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_the_job_survives_the_fault(scenario: Scenario, tmp_path: Path) -> None:
    result, out = run(scenario, tmp_path, timeout=240)
    log = "\n".join(out[-60:])
    assert result.fault_step is not None, f"the fault never struck:\n{log}"
    assert result.exit_code == 0, f"{result}\n{log}"
    assert result.right_model, f"{result}\n{log}"
    assert result.final_step is not None and result.final_step >= TRAIN_STEPS - 100, result
    assert result.detected_s is not None, f"nothing named {scenario.task}:\n{log}"

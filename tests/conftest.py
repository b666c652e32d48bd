"""Test-session settings. The models here are tiny: one thread is as fast as two and leaves the other core free
(for CI's second job or a background data run)."""

import pytest
import torch

import modeling_xpress.tuning as tuning

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _own_timing_records(tmp_path, monkeypatch):
    """Each test keeps the machine's timed choices (`tuning.Records`) in a folder of its own: tiny models of one shape
    recur across tests, and a record timed under one test's stand-in costs must not decide another's. (SmolLM2 and the
    other downloads stay in the real cache folder: `bench.assets` does not look here.) And the check that other jobs
    left this process its CPU is off: stand-in costs take no time of their own, and CI's load is not the test's to
    judge (`test_tuning.py` turns it on where it is the subject)."""
    monkeypatch.setattr(tuning.Records, "folder", property(lambda self: tmp_path / "choices"))
    monkeypatch.setattr(tuning, "MIN_CPU_SHARE", 0.0)

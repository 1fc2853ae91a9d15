"""Fixtures shared by the real-process tests."""

from __future__ import annotations

import pytest

from support.toyrun import ToyReferences


@pytest.fixture(scope="session")
def toy_reference(tmp_path_factory: pytest.TempPathFactory) -> ToyReferences:
    """``toy_reference(steps, nproc)``: the final record of a clean toy_train.py run, made once a session."""
    return ToyReferences(tmp_path_factory.mktemp("toy-references"))


@pytest.fixture(scope="session")
def slurm_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One clean 2-node Slurm job for the session (slurm_helpers.clean_reference_run)."""
    from slurm_helpers import clean_reference_run

    return clean_reference_run(tmp_path_factory.mktemp("slurm-reference"))

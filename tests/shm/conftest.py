"""Fixtures for the shm tests: a unique segment instance name, unlinked afterwards."""

from __future__ import annotations

import os
import uuid

import pytest

from kvsched.shm.segments import unlink_segments


@pytest.fixture
def instance():
    name = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    unlink_segments(name)

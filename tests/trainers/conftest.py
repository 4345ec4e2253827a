"""What the trainer tests share: one torch thread per test, the built-in tokenizer, and the Ray
session of the Ray test files (one per file)."""

import pytest

from posttrain.data.tokenizer import build_tokenizer
from posttrain.distributed.ray_session import RaySession

from .ray_procs import raylets, wait_gone


@pytest.fixture(scope="module")
def ray_session():
    pytest.importorskip("ray")
    session = RaySession(None, num_cpus=4)  # 4 logical CPUs on CI's 2 cores: room for 3 pools
    marker = session.temp_dir
    try:
        yield session
    finally:
        own = raylets(marker)
        session.close()
        assert not wait_gone(own), "a raylet outlived ray.shutdown()"


@pytest.fixture(scope="module")
def tok():
    """The built-in byte tokenizer."""
    return build_tokenizer()

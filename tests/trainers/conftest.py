"""The Ray session the Ray test files of this folder share, one per file."""

import pytest

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

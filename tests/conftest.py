"""Test-wide settings.

Tests use tiny models, for which one intra-op thread is fastest, and a run on a loaded
2-core machine with two OpenMP threads can be 100× slower (threads spin waiting for each
other). Subprocesses started by tests inherit OMP_NUM_THREADS from the Makefile.
"""

import copy

import pytest
import torch

from posttrain.distributed.groups import _Dispatch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread():
    """Every test starts on one intra-op thread, and a test that changes the count gets it back."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class InProcessGroup(_Dispatch):
    """W workers in this process, called one after the other: the dispatch modes without Ray.
    Each worker gets its own copy of the factory's arguments (a model is not shared)."""

    def __init__(self, factory, world, *args):
        self.world_size = world
        self.workers = [factory(r, world, None, *copy.deepcopy(args)) for r in range(world)]

    def _run(self, method, args_per_rank):
        return [getattr(w, method)(*a) for w, a in zip(self.workers, args_per_rank, strict=True)]

    def _run_one(self, rank, method, args):
        return getattr(self.workers[rank], method)(*args)


@pytest.fixture
def in_process_group():
    """The `InProcessGroup` class (a fixture, so tests in any folder share one definition)."""
    return InProcessGroup

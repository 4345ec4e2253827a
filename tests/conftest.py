"""Test-wide settings.

Tests use tiny models, for which one intra-op thread is fastest, and a run on a loaded
2-core machine with two OpenMP threads can be 100× slower (threads spin waiting for each
other). Subprocesses started by tests inherit OMP_NUM_THREADS from the Makefile.
"""

import torch

torch.set_num_threads(1)

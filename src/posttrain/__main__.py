"""`python -m posttrain` (and `torchrun --nproc_per_node N -m posttrain sft ...`): the `posttrain` command."""

import sys

from posttrain.cli import main

sys.exit(main())

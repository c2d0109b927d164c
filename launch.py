"""torchrun entry point: ``torchrun --nproc-per-node G launch.py CONFIG [key=value ...]``.

The same as ``relax_launch/launch.py``, which ``relax-launch run`` starts (from a clone or an
installed package alike).
"""

import sys

from relax_launch.launch import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

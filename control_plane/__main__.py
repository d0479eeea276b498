"""`python -m splitserve.control_plane`: the `splitserve control-plane` command."""

import sys

from splitserve.control_plane.cli import main

sys.exit(main())

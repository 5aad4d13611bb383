"""``python -m replaybuf``: the ``replaybuf`` command."""

import sys

from replaybuf.cli import main

sys.exit(main())

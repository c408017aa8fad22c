"""``python -m lmrl.cli``: the ``lmrl`` command."""

import sys

from lmrl.cli import main

sys.exit(main())

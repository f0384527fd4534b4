"""``python -m mpiring.tools.grade``: the earlier spelling of ``python -m mpiring grade`` (deprecated)."""

import sys

from . import main

sys.exit(main())

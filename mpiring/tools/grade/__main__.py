"""``python -m mpiring.tools.grade``: see the package's docstring."""

import sys

from . import main

sys.exit(main())

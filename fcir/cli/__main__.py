"""``python -m fcir.cli``: the ``fcir`` command."""

import sys

from fcir.cli.main import main

sys.exit(main())

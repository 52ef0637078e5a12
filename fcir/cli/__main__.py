"""``python -m fcir.cli``: the ``fcir`` command."""

import sys

from fcir.cli.commands import main

sys.exit(main())

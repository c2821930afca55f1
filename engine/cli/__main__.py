"""`python -m refold.cli …` is the `refold` command."""

import sys

from refold.cli.main import main

sys.exit(main())

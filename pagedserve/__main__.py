"""`python -m pagedserve ...`: the same as the `pagedserve` command."""

import sys

from pagedserve.cli import main

sys.exit(main())

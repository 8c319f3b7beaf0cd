"""`python -m pagedmlx.cli`: the `pagedmlx` command."""

import sys

from pagedmlx.cli.main import main

if __name__ == "__main__":
    sys.exit(main())

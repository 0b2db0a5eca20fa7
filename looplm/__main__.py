"""`python -m looplm` is the `looplm` command."""

import sys

from .cli import main

sys.exit(main())

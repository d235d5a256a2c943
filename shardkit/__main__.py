"""`python -m shardkit ...` runs the `shardkit` command."""

import sys

from .cli.main import main

sys.exit(main())

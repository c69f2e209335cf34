"""`python -m services.cli ...`: how `radixserve serve` starts each child process."""

import sys

from services.cli.main import main

sys.exit(main())

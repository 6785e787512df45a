"""`python -m fanin_bench bench|sim|testbed ...`: the same as `fanin bench|sim|testbed ...`."""

import sys

from fanin_bench.cli import main

sys.exit(main())

"""``python -m kvcourse prepare | generate ...``: the command line, which lives in ``kvcourse.harness.cli``."""

import sys

from kvcourse.harness.cli import main

sys.exit(main())

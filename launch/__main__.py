"""``python -m hipress.launch`` is ``hipressrun``."""

import sys

from hipress.launch.cli import main

sys.exit(main())

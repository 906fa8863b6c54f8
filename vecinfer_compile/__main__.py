"""``python -m vecinfer_compile`` == the ``vecinfer`` command."""

import sys

from .cli import main

sys.exit(main())

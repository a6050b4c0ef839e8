"""``python -m verl_ext.cli``: the ``verl-ext`` command."""

import sys

from verl_ext.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""python -m producer: dq-producer (producer/cli/main.py)."""

import sys

from producer.cli.main import main

if __name__ == "__main__":
    sys.exit(main())

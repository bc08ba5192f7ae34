"""`python -m lorafleet.worker ...`: the same as `lorafleet worker ...`."""

import sys

from lorafleet.worker.main import main

if __name__ == "__main__":
    sys.exit(main())

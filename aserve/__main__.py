import sys

from aserve.cli import main

sys.exit(main())

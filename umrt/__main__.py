import sys

from umrt.cli import main

sys.exit(main())

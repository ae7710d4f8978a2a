import sys

from prague.cli import main

sys.exit(main())
